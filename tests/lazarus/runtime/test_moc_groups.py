"""moc's groups formed in a thread during a reconfiguration (lazarus/runtime/worker/_moc_groups.py):
a plan that fails while they connect must not leave the thread holding the rendezvous'
store client, which the next plan's rendezvous uses (soak seed 4: 30 s lost)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lazarus.runtime._plan import Plan
from lazarus.runtime.worker._reconfigure import Reconfigurer
from lazarus.runtime.worker._worker_state import WorkerContext

pytestmark = pytest.mark.timeout(120)


def _reconfigurer(rendezvous_s: float) -> Reconfigurer:
    config = SimpleNamespace(rendezvous_timeout=timedelta(seconds=rendezvous_s),
                             collective_timeout=timedelta(seconds=5),
                             moc=SimpleNamespace(coordination_timeout=timedelta(seconds=5)))
    context = WorkerContext(node="n3", local_rank=0, local_world=1, where="n3",
                            backend=SimpleNamespace(backend="gloo"), layout={"layers": {}},
                            channel=SimpleNamespace(latest_plan=lambda: None))
    return Reconfigurer(config, context=context, build_model=None, make_optimizer=None)


def test_a_failed_plan_leaves_no_store_client_held_by_moc_groups_still_connecting():
    if dist.is_initialized():
        pytest.fail("a default process group is left over from another test")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    # MocGroups.start forms groups only beside a default group (world 1 here: its own store)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rendezvous_s = 20.0
        r = _reconfigurer(rendezvous_s)
        spec = {"host": "127.0.0.1", "port": server.port}
        # generation 11: rank 0 of 2 forms moc's groups; rank 1 died, its keys never come
        r.moc_groups.start(Plan.from_wire({"prefix": "lazarus/gen11", "store": spec, "generation": 11,
                                           "members": ["n3", "n4"]}), rank=0, world=2, generation=11)
        assert r.moc_groups._pending is not None
        thread = r.moc_groups._pending[0]
        time.sleep(1.0)
        assert thread.is_alive(), "moc's groups formed without their second rank"
        old_client = r.stores.client
        r.moc_groups.drop(step=7, generation=11)   # what apply() does when the plan fails

        # generation 12 on the same store: its rendezvous' first operation answers at once
        # (before the fix it queued behind the thread's store wait: ~rendezvous_s)
        t0 = time.monotonic()
        client = r.stores.client_for(spec, 12)
        assert client.add("lazarus/gen12/arrived", 1) == 1
        took = time.monotonic() - t0
        assert took < rendezvous_s / 4, f"the next rendezvous waited {took:.1f} s on the dropped thread's client"
        assert client is not old_client
        # and the thread, its store wait failed, ends instead of holding its sockets
        thread.join(rendezvous_s / 2)
        assert not thread.is_alive()
        assert not any(th.name.startswith("lazarus-moc-groups-11") for th in threading.enumerate())
    finally:
        dist.destroy_process_group()
