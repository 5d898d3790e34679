"""One rank of the two-"host" NCCL pair on ONE GPU (tests/gpu/test_gpu_lazarus.py).

Both ranks use cuda:0 as two separate hosts: a distinct ``NCCL_HOSTID`` per process (so
NCCL does not refuse two ranks on one GPU), sockets on loopback, the P2P and SHM transports
off (the test sets the environment). The group is formed as the trainer forms it: the
NCCL settings of ``lazarus.runtime.worker._backend``, ``init_process_group`` with ``device_id``
(eager, non-blocking communicator) and the ``_nccl_ready``-style probe. The ranks all-reduce
until the test SIGKILLs or SIGSTOPs rank 1; rank 0 then polls NCCL's watchdog the way the
trainer's watcher does, aborts its communicators, and prints how long its blocked
collective took to come back, and whether a fresh group of one forms in the same process.

    python tests/gpu/mp_nccl_pair.py RANK PORT TIMEOUT_S OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lazarus.runtime.worker._abort import GroupAborter  # noqa: E402
from lazarus.runtime.worker._backend import TrainerBackend, nccl_environment, nccl_init_kwargs  # noqa: E402


def main() -> None:
    rank, port, timeout_s, out_path = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    nccl_environment(f"pair rank {rank}", init_timeout=timedelta(seconds=60))
    torch.cuda.set_device(0)
    backend = TrainerBackend(device=torch.device("cuda", 0), backend="nccl")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    aborter = GroupAborter("nccl")
    t0 = time.monotonic()
    dist.init_process_group(backend.init_backend, store=dist.PrefixStore("gen0", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s), **nccl_init_kwargs(backend))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    out: dict = {"rank": rank, "formed_s": time.monotonic() - t0, "first_sum": float(x[0])}
    store.set(f"ready{rank}", "1")
    if rank == 1:
        while True:                       # until SIGKILLed / SIGSTOPped by the test
            dist.all_reduce(x)
            torch.cuda.synchronize()
            x.fill_(1.0)
    stop = threading.Event()

    def watcher() -> None:                # the trainer's _abort_on_watchdog_error, in small
        while not stop.wait(0.05):
            error = aborter.watchdog_error()
            if error is not None:
                out["watchdog_error"] = error
                out["aborted"] = aborter.interrupt().nccl_aborted
                return

    threading.Thread(target=watcher, daemon=True).start()
    steps, blocked_since = 0, None
    try:
        while True:
            blocked_since = time.monotonic()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            aborter.check_healthy()
            x.fill_(1.0)
            steps += 1
            if steps == 20:
                store.set("rank0_training", "1")
    except Exception as exc:  # noqa: BLE001 - the failure the test waits for
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["blocked_s"] = time.monotonic() - blocked_since
    out["steps"] = steps
    stop.set()
    aborter.retire()
    # back, alone: a new generation of one on the same GPU, in this process
    t1 = time.monotonic()
    solo = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group(backend.init_backend, store=dist.PrefixStore("gen1", solo), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s), **nccl_init_kwargs(backend))
    y = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    out["reformed_s"] = time.monotonic() - t1
    out["solo_sum"] = float(y.sum())
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main()
