"""A failed group formation on one member must not desynchronise the next generation's.

Seen in `make soak` (seed 5): the controller was killed while a generation's group was
forming; on one member ``init_process_group`` had already taken a group name (torch's
per-process counter, reset only when WORLD is destroyed), on the others not. Every later
generation's group then waited for store keys the other members never wrote, and the job
never trained again. Two real gloo processes: rank 0 fails one formation alone, then both
form a group, without and with :func:`lazarus.runtime.worker._abort.reset_group_names`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lazarus.runtime.worker._abort import reset_group_names
from tests.helpers.rank_harness import run_ranks


def _form(path: Path, rank: int, seconds: float) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(path), 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=seconds))


def _after_a_failed_formation(rank: int, world: int, tmp: str, reset: bool) -> None:
    tmp_path = Path(tmp)
    dist.destroy_process_group()               # the harness's group: names start from 0 here
    if rank == 0:
        with pytest.raises(RuntimeError):      # rank 1 never comes: this formation times out
            _form(tmp_path / "failed", 0, 1.0)
        (tmp_path / "failed.done").touch()
    else:
        deadline = time.monotonic() + 60
        while not (tmp_path / "failed.done").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
    if reset:
        reset_group_names()
    try:
        _form(tmp_path / "next", rank, 5.0)
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        sub = dist.new_group(ranks=[0, 1])
        dist.all_reduce(t, group=sub)
        formed = int(t.item())
    except Exception as exc:  # noqa: BLE001 - reported as the outcome
        formed = -1
        (tmp_path / f"error.{rank}").write_text(str(exc))
    (tmp_path / f"formed.{rank}").write_text(str(formed))
    if not dist.is_initialized():              # the harness ends with a barrier on a live group
        reset_group_names()
        _form(tmp_path / f"end.{int(reset)}", rank, 30.0)


@pytest.mark.timeout(120)
def test_group_names_restart_from_zero_before_a_generation_forms(tmp_path):
    with_reset, without = tmp_path / "with", tmp_path / "without"
    with_reset.mkdir()
    without.mkdir()
    run_ranks(_after_a_failed_formation, 2, with_reset, str(with_reset), True)
    assert [(with_reset / f"formed.{r}").read_text() for r in range(2)] == ["6", "6"]
    # What torch alone does: rank 0's next group is named "1", rank 1's "0"; neither forms.
    run_ranks(_after_a_failed_formation, 2, without, str(without), False)
    assert [(without / f"formed.{r}").read_text() for r in range(2)] == ["-1", "-1"]
    assert "timeout" in (without / "error.0").read_text().lower()
