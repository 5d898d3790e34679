"""Run a test program on W gloo ranks, each a real spawned process.

``run_ranks(fn, world, tmp, *args)`` starts ``world`` processes that join one gloo group
(FileStore rendezvous, finite timeouts) and call ``fn(rank, world, *args)``; a rank's
traceback is written to ``tmp/err.<rank>`` and reported by the parent, which kills any
rank still alive when it returns, passed or not. A rank that finished exits with
``os._exit(0)`` (no interpreter finalization, see ``_entry``).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable


def _entry(module: str, fn_name: str, rank: int, world: int, tmp: str, args: tuple) -> None:
    err = Path(tmp) / f"err.{rank}"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["RANK"] = str(rank)
        store = dist.FileStore(str(Path(tmp) / "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        torch.manual_seed(1234 + rank)
        getattr(importlib.import_module(module), fn_name)(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        err.write_text(traceback.format_exc())
        os._exit(1)
    # The rank's work is done and its group destroyed: leave without the interpreter's
    # finalization, where torch objects (gloo work, tensors with Python references, held
    # by C++ threads) are torn down in no defined order. A CI run once saw a rank that had
    # passed everything die there with SIGABRT ("terminate called without an active
    # exception", tests/lazarus/moe/test_host_sync.py); 26 runs here, idle and loaded, did not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *args: Any, join_s: float = 200) -> None:
    from lazarus.dispatch import load_ops

    load_ops()  # build the extension once here, so the ranks only load it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn.__module__, fn.__name__, r, world, str(tmp), args), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_s)
        errors = [(tmp / f"err.{r}").read_text() for r in range(world) if (tmp / f"err.{r}").exists()]
        assert not errors, "\n".join(errors)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
