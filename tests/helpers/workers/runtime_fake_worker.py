"""A stand-in worker for control-plane tests: it obeys plans and reports, it does not train.

Started by ``lazarus agent ... -- python tests/helpers/workers/runtime_fake_worker.py``. It says hello with
a small model (``FAKE_LAYERS`` layers x ``FAKE_EXPERTS`` experts; once the file
``FAKE_HELLO_WHEN`` exists when set: a worker slow to start), then every
``FAKE_STEP_S`` seconds counts a step and reports ``progress`` (rank 0 also ``routing``).
On a new plan it replies ``reconfigured``; if it is in the plan's ``leaving`` list it reports
``left`` and exits 0 (held up at exit for ``FAKE_LEFT_STUCK_S`` seconds by a non-daemon
thread, as by a checkpoint write stuck on hung storage). After ``FAKE_STEPS`` steps (0 =
never) it reports ``done`` and waits for ``stop``. With ``FAKE_CRASH_AT_STEP`` it raises at
that step of every incarnation (a deterministic crash loop); with ``FAKE_CRASH_LOCAL_RANK``
as well, only the worker of that ``LOCAL_RANK`` does (one rank of a node with
``--nproc-per-node`` > 1). Writing ``collective_error`` into the file
``$FAKE_CONTROL_DIR/<node>`` makes it report a collective error once. After ``stop`` it
lingers ``FAKE_LINGER_S`` seconds (user code after ``trainer.run()``: an export, an
evaluation), writes ``$FAKE_CONTROL_DIR/<node>.finished`` and exits ``FAKE_EXIT_CODE``
(default 0). With ``FAKE_STARTED_FILE`` set it first appends its start time (``time.time()``)
to that file, one line per start (when the agent started it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lazarus.runtime import AgentChannel  # noqa: E402


def main() -> int:
    started = os.environ.get("FAKE_STARTED_FILE")
    if started:
        with open(started, "a", encoding="utf-8") as fh:
            fh.write(f"{time.time()}\n")
    ch = AgentChannel.from_env()
    if ch is None:
        print("runtime_fake_worker: LAZARUS_AGENT_FD is not set", file=sys.stderr)
        return 2
    layers = int(os.environ.get("FAKE_LAYERS", "2"))
    experts = int(os.environ.get("FAKE_EXPERTS", "4"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.05"))
    total = int(os.environ.get("FAKE_STEPS", "0"))
    control = os.environ.get("FAKE_CONTROL_DIR")
    crash_at = int(os.environ.get("FAKE_CRASH_AT_STEP", "0"))
    crash_rank = os.environ.get("FAKE_CRASH_LOCAL_RANK")
    if crash_rank is not None and crash_rank != os.environ.get("LOCAL_RANK", "0"):
        crash_at = 0
    names = [f"layers.{i}.moe" for i in range(layers)]
    hello_when = os.environ.get("FAKE_HELLO_WHEN")   # a worker slow to import and build
    while hello_when and not os.path.exists(hello_when):
        time.sleep(0.02)
    ch.hello({"layers": {n: experts for n in names}, "top_k": 2})
    gen, step, done_sent = 0, 0, False
    while not ch.stop_requested:
        plan = ch.latest_plan()
        if plan is not None and plan["generation"] > gen:
            gen = plan["generation"]
            leaving = ch.node_id in plan.get("leaving", [])
            ch.send({"type": "reconfigured", "generation": gen, "t_resumed": time.time(),
                     "timings": {"fake": 0.0}, "moved": 0,
                     "sources": {"peer": 0, "memory": 0, "storage": 0}, "plt": 0.0,
                     "lost_experts": [], "node": ch.node_id})
            if leaving:
                ch.send({"type": "left", "step": step, "generation": gen})
                stuck = float(os.environ.get("FAKE_LEFT_STUCK_S", "0"))
                if stuck:   # background work that cannot end holds the exit up, as a
                    # non-daemon thread blocked in a write to hung storage does
                    threading.Thread(target=time.sleep, args=(stuck,), name="fake-stuck-persist").start()
                return 0
        members = plan["members"] if plan is not None else []
        if ch.node_id in members:
            step += 1
            if members[0] == ch.node_id:
                ch.send({"type": "progress", "step": step, "generation": gen, "loss": 1.0 / step,
                         "world_size": len(members), "t": time.time()})
                skew = [[(e + 1) ** 3 * 10 for e in range(experts)] for _ in names]
                ch.send({"type": "routing", "step": step, "layers": dict(zip(names, skew))})
            if crash_at and step >= crash_at:
                raise RuntimeError(f"injected crash at step {step} on node {ch.node_id}")
            if total and step >= total and not done_sent:
                ch.send({"type": "done", "step": step})
                done_sent = True
        if control:
            f = Path(control) / ch.node_id
            if f.exists() and f.read_text().strip() == "collective_error":
                f.unlink()
                ch.send({"type": "collective_error", "generation": gen, "error": "fake: peer gone"})
        time.sleep(step_s)
    time.sleep(float(os.environ.get("FAKE_LINGER_S", "0")))
    if control:
        (Path(control) / f"{ch.node_id}.finished").write_text(str(time.time()))
    return int(os.environ.get("FAKE_EXIT_CODE", "0"))


if __name__ == "__main__":
    sys.exit(main())
