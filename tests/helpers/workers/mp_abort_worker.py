"""One rank of the abort-dispatch test (tests/lazarus/runtime/test_backend.py), a real process.

Two ranks form a gloo group and run one all-reduce. Rank 1 then enters an all-reduce that
rank 0 never joins; rank 0 waits until rank 1 announced it, then retires its groups with a
:class:`GroupAborter` of the given backend and prints what it did. Rank 1 prints how long its
blocked all-reduce took to fail (the collective timeout is long: only an abort ends it
early). Both leave with ``os._exit`` so a broken gloo group's destructor cannot abort the
interpreter afterwards.

    python tests/helpers/workers/mp_abort_worker.py RANK PORT BACKEND TIMEOUT_S
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from lazarus.runtime.worker._abort import GroupAborter  # noqa: E402
from lazarus.runtime.worker._trainer import is_collective_error  # noqa: E402


def main() -> None:
    rank, port, backend, timeout_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    store.add("arrived", 1)
    while store.add("arrived", 0) < 2:   # both store connections are up before tracking starts
        time.sleep(0.01)
    aborter = GroupAborter(backend)
    with aborter.sockets.track():
        dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store), rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s))
    t = torch.ones(1)
    dist.all_reduce(t)
    out: dict = {"rank": rank, "first_sum": float(t.item())}
    if rank == 1:
        store.set("blocking", "1")
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out["collective_error"] = is_collective_error(exc)
        out["blocked_s"] = time.monotonic() - t0
    else:
        store.wait(["blocking"])
        time.sleep(0.2)          # into the all-reduce (if not, it fails on entry just the same)
        report = aborter.retire()
        out.update(report=report.__dict__, initialized_after=dist.is_initialized())
        store.wait(["done1"], timedelta(seconds=timeout_s))
    print(json.dumps(out), flush=True)
    if rank == 1:
        store.set("done1", "1")
    os._exit(0)


if __name__ == "__main__":
    main()
