"""One rank of the three-"host" NCCL group on ONE GPU that loses a peer and re-forms with
the two others (tests/gpu/test_gpu_lazarus.py ``test_nccl_shrink_and_reinit_side_by_side``).

As ``mp_nccl_pair.py``: every rank on cuda:0 as a separate host (a distinct
``NCCL_HOSTID``, sockets on loopback, P2P and SHM off), the group formed as the trainer
forms it (``cpu:gloo,cuda:nccl``, eager, non-blocking communicator). The ranks all-reduce,
then wait quietly; the test SIGKILLs the last rank and sets ``lost`` on the store. From
that moment each survivor times how long it takes to have a working group of the
survivors (an all-reduce on the device and one on the host both done), one of two ways:

* ``shrink``: ``ncclCommShrink`` of the old communicator excluding the dead rank
  (``SHRINK_ABORT``: the peer is gone), the old group aborted, a ``cpu:gloo`` group formed
  and the shrunk communicator attached as its CUDA backend: the trainer's code
  (``lazarus.runtime.worker._reform``);
* ``reinit``: the old group aborted (``GroupAborter.retire``) and a new
  ``cpu:gloo,cuda:nccl`` group formed with ``init_process_group`` (what the trainer did
  before, and does where shrink is not possible).

With ``inflight``, every rank keeps all-reducing and the victim is killed mid-collective:
the survivors' training threads block in the device sync, as a trainer's do. A watcher
thread sees ``lost`` and either aborts the communicators (``reinit``: what the trainer does
now) or shrinks with ``SHRINK_ABORT`` from that thread (``shrink``), which should end the
parent's blocked kernel; if the blocked step is not back 3 s after the shrink returned,
the watcher aborts the parent and says so (``shrink_released_step`` false). This is the
question the trainer's failure path (which aborts, so cannot shrink) needs answered on a GPU.

    python tests/gpu/mp_nccl_shrink.py RANK WORLD PORT MODE OUT_JSON [inflight]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lazarus.runtime.worker._abort import GroupAborter, nccl_backends, reset_group_names  # noqa: E402
from lazarus.runtime.worker._backend import TrainerBackend, nccl_environment, nccl_init_kwargs  # noqa: E402
from lazarus.runtime.worker._reform import (agree_on_shrink, attach_nccl, local_shrink_available,  # noqa: E402
                                            shrink_default_nccl)

TIMEOUT = timedelta(seconds=30)


def _shrink(world: int, mode: str, out: dict, t1: float):
    """``shrink`` mode: the survivors' communicator without the last rank (None if it failed)."""
    shrunk = None
    if mode == "shrink":
        try:
            shrunk = shrink_default_nccl([world - 1], abort_parent=True)
            out["shrunk_rank_size"] = [int(shrunk.rank()), int(shrunk.size())]
        except Exception as exc:  # noqa: BLE001 - recorded: the test reports it
            out["shrink_error"] = f"{type(exc).__name__}: {exc}"[:400]
        out["shrink_s"] = time.monotonic() - t1
    return shrunk


def _lost_in_flight(rank: int, world: int, port: int, mode: str, x: torch.Tensor, aborter: GroupAborter,
                    out: dict) -> tuple[float, object]:
    """Train (all-reduce, sync, health check) until the step fails; a watcher thread
    interrupts it once the test says the last rank is lost (see the module docstring).
    Returns (when the loss was seen, the shrunk backend or None)."""
    if rank == world - 1:
        while True:                  # the victim: all-reduces until SIGKILLed mid-collective
            x.fill_(1.0)
            dist.all_reduce(x)
            torch.cuda.synchronize()
    seen: dict = {}
    back = threading.Event()

    def watcher() -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        client.wait(["lost"], timedelta(seconds=120))
        seen["t"] = time.monotonic()
        if mode == "shrink":
            seen["shrunk"] = _shrink(world, mode, out, seen["t"])
            if seen["shrunk"] is None:          # it failed: abort at once, as without a shrink
                out["aborted"] = aborter.interrupt().nccl_aborted
                return
            aborter.interrupted = True          # the step that was running is not valid
            released = back.wait(3.0)
            out["shrink_released_step"] = released
            if not released:
                out["aborted_after_shrink"] = aborter.interrupt_nccl()
        else:
            out["aborted"] = aborter.interrupt().nccl_aborted

    th = threading.Thread(target=watcher, daemon=True)
    th.start()
    steps = 0
    try:
        while True:
            x.fill_(1.0)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            aborter.check_healthy()
            steps += 1
    except Exception as exc:  # noqa: BLE001 - the failure the test waits for
        out["step_error"] = f"{type(exc).__name__}: {exc}"[:300]
    back.set()
    th.join(30)
    out["steps_before"] = steps
    out["blocked_s"] = time.monotonic() - seen["t"] if "t" in seen else None
    return seen.get("t", time.monotonic()), seen.get("shrunk")


def main() -> None:
    rank, world, port, mode, out_path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                         sys.argv[5])
    inflight = sys.argv[6:] == ["inflight"]
    out: dict = {"rank": rank, "mode": mode, "inflight": inflight, "available": list(local_shrink_available())}
    try:
        # a shrink or an init waiting on a dead peer gives up after 20 s (TORCH_NCCL_NONBLOCKING_TIMEOUT)
        nccl_environment(f"shrink rank {rank}", init_timeout=timedelta(seconds=20))
        torch.cuda.set_device(0)
        backend = TrainerBackend(device=torch.device("cuda", 0), backend="nccl")
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        aborter = GroupAborter("nccl")
        t0 = time.monotonic()
        dist.init_process_group(backend.init_backend, store=dist.PrefixStore("gen0", store), rank=rank,
                                world_size=world, timeout=TIMEOUT, **nccl_init_kwargs(backend))
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        out["formed_s"] = time.monotonic() - t0
        out["first_sum"] = float(x[0])
        for _ in range(20):
            x.fill_(1.0)
            dist.all_reduce(x)
        torch.cuda.synchronize()
        store.set(f"ready{rank}", "1")
        survivors = world - 1
        if inflight:
            t1, shrunk = _lost_in_flight(rank, world, port, mode, x, aborter, out)
        else:
            if rank == world - 1:
                while True:              # the victim: SIGKILLed by the test
                    time.sleep(1)
            store.wait(["lost"], timedelta(seconds=120))
            t1 = time.monotonic()
            shrunk = _shrink(world, mode, out, t1)
        if mode == "shrink":         # the members agree as the trainer's do: all shrunk, or none used
            store.set(f"shrunk{rank}", "1" if shrunk is not None else "0")
            outcomes = [bytes(store.get(f"shrunk{r}")).decode() for r in range(survivors)]
            shrunk = agree_on_shrink(outcomes, shrunk, where=f"rank {rank} step -")
            out["shrunk_used"] = shrunk is not None
        aborter.retire()             # the old group: aborted, never destroyed
        reset_group_names()
        t2 = time.monotonic()
        if shrunk is not None:
            dist.init_process_group("cpu:gloo", store=dist.PrefixStore("gen1", store), rank=rank,
                                    world_size=survivors, timeout=TIMEOUT)
            attach_nccl(shrunk, backend.device, backend.init_backend)
        else:
            dist.init_process_group(backend.init_backend, store=dist.PrefixStore("gen1", store), rank=rank,
                                    world_size=survivors, timeout=TIMEOUT, **nccl_init_kwargs(backend))
        out["form_s"] = time.monotonic() - t2
        aborter.formed()
        y = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(y)
        torch.cuda.synchronize()
        h = torch.ones(2)
        dist.all_reduce(h)           # the host half (gloo)
        out["reformed_s"] = time.monotonic() - t1
        out["device_sum"], out["host_sum"] = float(y[0]), float(h[0])
        out["nccl_backends"] = len(nccl_backends())   # what the trainer's aborter would abort next time
        out["errors"] = [] if aborter.watchdog_error() is None else [aborter.watchdog_error()]
        # the new group's all-reduce in steady state (1M floats)
        torch.cuda.synchronize()
        t3 = time.monotonic()
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        out["allreduce_ms"] = (time.monotonic() - t3) / 20 * 1e3
    except BaseException:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2000:]
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main()
