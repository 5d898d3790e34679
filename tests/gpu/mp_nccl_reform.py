"""One rank of a three-node NCCL job on ONE GPU whose third node leaves, re-formed by the
trainer's own ``Reconfigurer`` (tests/gpu/test_gpu_lazarus.py
``test_trainer_leave_on_nccl_shrinks_or_reinits``).

As ``mp_nccl_pair.py``: every rank on cuda:0 as a separate host (a distinct
``NCCL_HOSTID``). Generation 1 (``n0 n1 n2``) forms through ``Reconfigurer._rendezvous``
(``cpu:gloo,cuda:nccl``, eager, the ``_nccl_ready`` probe); ``n2`` then leaves as a leaving
node does (it retires its group and exits), and ``n0``, ``n1`` apply generation 2 as the
between-steps path of ``Reconfigurer._apply`` does: ``_try_shrink`` (the
``ElasticConfig.reform`` decision and, where chosen, ``ncclCommShrink``), ``_retire``,
``_rendezvous`` (the members' agreement, the shrunk communicator attached, the probe).

    python tests/gpu/mp_nccl_reform.py NODE PORT REFORM OUT_JSON
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lazarus.runtime import ElasticConfig  # noqa: E402
from lazarus.runtime._plan import Plan  # noqa: E402
from lazarus.runtime.worker._abort import nccl_backends  # noqa: E402
from lazarus.runtime.worker._backend import TrainerBackend, nccl_environment  # noqa: E402
from lazarus.runtime.worker._reconfigure import Reconfigurer  # noqa: E402
from lazarus.runtime.worker._worker_state import StateDraft, WorkerContext, WorkerState  # noqa: E402

NODES = ["n0", "n1", "n2"]


def main() -> None:
    node, port, reform, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    out: dict = {"node": node, "reform": reform}
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    for name in ("lazarus.reconfigure", "lazarus.trainer"):
        logging.getLogger(name).addHandler(Keep())
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        config = ElasticConfig(device="cuda", backend="nccl", reform=reform,
                               collective_timeout=timedelta(seconds=20), rendezvous_timeout=timedelta(seconds=60))
        nccl_environment(f"reform {node}", init_timeout=config.rendezvous_timeout)
        torch.cuda.set_device(0)
        ctx = WorkerContext(node=node, local_rank=0, local_world=1, where=node,
                            backend=TrainerBackend(device=torch.device("cuda", 0), backend="nccl"),
                            layout={"layers": {}}, channel=SimpleNamespace(latest_plan=lambda: None))
        r = Reconfigurer(config, context=ctx, build_model=None, make_optimizer=None)
        out["available"] = list(r.shrink_available)

        def plan(gen: int, members: list[str]) -> Plan:
            return Plan.from_wire({"generation": gen, "members": members, "prefix": f"lazarus/gen{gen}",
                                   "store": {"host": "127.0.0.1", "port": port}, "mode": "between_steps"})

        s = StateDraft(WorkerState(generation=0, step=5))
        t0 = time.monotonic()
        r._rendezvous(s, plan(1, NODES))
        out["formed_s"] = time.monotonic() - t0
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        out["first_sum"] = float(x[0])
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        if node == "n2":                 # the leaving node: retires its group and goes
            r._retire(s)
            store.set("n2_left", "1")
            out["left"] = True
        else:
            store.wait(["n2_left"], timedelta(seconds=120))
            t1 = time.monotonic()
            shrink, shrunk = r._try_shrink(s, plan(2, NODES[:2]))
            out["shrink_s"] = time.monotonic() - t1
            r._retire(s, planned=True)
            r._rendezvous(s, plan(2, NODES[:2]), shrink=shrink, shrunk=shrunk)
            out["reformed_s"] = time.monotonic() - t1
            out["how"] = r.last_reform.how if r.last_reform else None
            out["why"] = r.last_reform.why if r.last_reform else None
            y = torch.full((4,), float(s.rank + 1), device="cuda")
            dist.all_reduce(y)
            h = torch.ones(2)
            dist.all_reduce(h)
            torch.cuda.synchronize()
            out["rank_world"] = [s.rank, s.world]
            out["device_sum"], out["host_sum"] = float(y[0]), float(h[0])
            out["nccl_backends"] = len(nccl_backends())
            r._retire(s, planned=True)
    except BaseException:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2500:]
    out["fallbacks"] = [m for m in records if "falling back" in m]
    out["reform_logs"] = [m for m in records if "re-forming the group" in m]
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main()
