"""The three systems of ``benchmarks/peers``, each behind the same small interface the
driver uses: ``start(nodes)``, ``step()`` (highest committed step so far), ``kill(node)``
(SIGKILL), ``join(node)`` (a replacement node starts), ``term(node)`` (SIGTERM),
``finish(timeout)`` and ``records()`` (the metrics lines of :mod:`_common`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from _common import ModelSpec, read_jsonl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

__all__ = ["LazarusArm", "TorchftArm", "CkptRestartArm", "TORCHFT_SETTINGS", "TORCHFT_PG_TIMEOUT_S"]

#: torchft Lighthouse settings compared: its README's command, and tuned (1 s heartbeat timeout).
#: Each with the replica groups' ProcessGroupGloo timeout in TORCHFT_PG_TIMEOUT_S.
TORCHFT_SETTINGS = {
    "readme": ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"],
    "tuned": ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
              "--heartbeat_timeout_ms", "1000"],
}
#: The groups' process-group timeout (seconds), what a killed peer costs the survivors: the
#: README's (torchft's train_ddp.py: 5 s), and tuned: the shortest this model's steps allow
#: (1 s: a step is ~0.1 s and a healing joiner's longest collective wait ~0.4 s on 2 loaded
#: cores; shorter ones fail healthy steps under load).
TORCHFT_PG_TIMEOUT_S = {"readme": 5.0, "tuned": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def _step_of(records: list[dict[str, Any]]) -> int:
    return max((int(r["step"]) for r in records if r.get("kind") == "step"), default=-1)


class _Arm:
    name = ""

    def __init__(self, work: Path, spec: ModelSpec, steps: int) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.steps = steps
        self.metrics = self.work / "metrics.jsonl"
        self.starts: dict[str, float] = {}     # node -> when its (latest) process was started

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl([self.metrics])

    def step(self) -> int:
        return _step_of(self.records())


class LazarusArm(_Arm):
    """Controller + 4 agents + ``ElasticTrainer`` as ``make demo`` runs them
    (:class:`examples.local_cluster.LocalCluster`, the example worker). The replacement
    node ``spare`` is a hot spare (``lazarus agent --standby``) started with the others and
    called in at the join (None: its agent starts cold at the join, like the others')."""

    name = "lazarus"

    def __init__(self, work: Path, spec: ModelSpec, steps: int, spare: str | None = None,
                 controller: Sequence[str] | None = None) -> None:
        super().__init__(work, spec, steps)
        self.spare = spare
        if spare is None:
            self.name = "lazarus (cold join)"
        from examples.local_cluster import LocalCluster

        worker = ["--steps", str(steps), "--storage", str(self.work / "store"), "--interval", "10",
                  "--k-snapshot", "2", "--k-persist", "1", "--persist-every", "2", "--collective-timeout", "5s",
                  "--report-every", "10", *spec.worker_args()]
        controller = list(controller) if controller is not None else [
            "--slots", "4", "--min-replicas", "2", "--expected-nodes", "4", "--heartbeat-timeout", "2s",
            "--join-window", "1s"]
        self.cluster = LocalCluster(self.work / "job", worker_args=worker, controller_args=controller,
                                    agent_args=["--heartbeat-interval", "250ms"])
        self.metrics = self.cluster.metrics_path

    def start(self, nodes: Sequence[str]) -> None:
        self.cluster.start_controller()
        for n in nodes:
            self.starts[n] = time.time()
            self.cluster.add_node(n)
        if self.spare is not None:
            self.cluster.add_node(self.spare, standby=True)

    def kill(self, node: str) -> float:
        return self.cluster.kill_node(node)

    def join(self, node: str) -> float:
        if node == self.spare:
            t = self.cluster.activate(node)
        else:
            t = time.time()
            self.cluster.add_node(node)
        self.starts[node] = t
        return t

    def term(self, node: str) -> float:
        return self.cluster.leave(node)

    def finish(self, timeout: float) -> None:
        try:
            rc = self.cluster.wait(timeout)
            if rc != 0:
                raise RuntimeError(f"lazarus: controller exited {rc}; see {self.cluster.dir}")
        finally:
            self.cluster.stop()

    def stop(self) -> None:
        self.cluster.stop()

    def events(self) -> list[dict[str, Any]]:
        return self.cluster.events()


class TorchftArm(_Arm):
    """torchft's Lighthouse (``torchft_lighthouse``, on loopback) and one replica group of
    one process per node (:mod:`_torchft_worker`). A killed group is not restarted in place:
    the replacement node's group is the restart (``join``), as torchelastic would start it."""

    def __init__(self, work: Path, spec: ModelSpec, steps: int, setting: str,
                 pg_timeout_s: float | None = None) -> None:
        super().__init__(work, spec, steps)
        if setting not in TORCHFT_SETTINGS:
            raise ValueError(f"torchft setting must be one of {sorted(TORCHFT_SETTINGS)}, got {setting!r}")
        self.name = f"torchft ({setting})"
        self.setting = setting
        self.pg_timeout_s = TORCHFT_PG_TIMEOUT_S[setting] if pg_timeout_s is None else float(pg_timeout_s)
        if not self.pg_timeout_s > 0:
            raise ValueError(f"torchft pg_timeout_s must be > 0 seconds, got {pg_timeout_s!r}")
        self.procs: dict[str, subprocess.Popen] = {}
        self.lighthouse: subprocess.Popen | None = None
        self.address = ""

    def _lighthouse_bin(self) -> str:
        cand = Path(sys.executable).with_name("torchft_lighthouse")
        return str(cand) if cand.exists() else "torchft_lighthouse"

    def start(self, nodes: Sequence[str]) -> None:
        port = _free_port()
        self.address = f"http://127.0.0.1:{port}"
        log = open(self.work / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen([self._lighthouse_bin(), "--bind", f"127.0.0.1:{port}",
                                            *TORCHFT_SETTINGS[self.setting]], stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError as exc:
                if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"torchft lighthouse did not start; see {self.work}/lighthouse.log") from exc
                time.sleep(0.05)
        # The first groups start together, as the other systems' first nodes do (Lazarus waits
        # for --expected-nodes, torchrun for --nnodes): with --min_replicas 1 the first group
        # up would otherwise train alone until the others have imported torch.
        go = self.work / "go"
        for n in nodes:
            self._spawn(n, start_when=go)
        deadline = time.monotonic() + 300
        while {r["node"] for r in self.records() if r.get("kind") == "built"} < set(nodes):
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: groups {dead or 'some'} did not start; see {self.work}")
            time.sleep(0.05)
        go.touch()

    def _spawn(self, node: str, start_when: Path | None = None) -> None:
        log = open(self.work / f"{node}.log", "ab")
        self.starts[node] = time.time()
        self.procs[node] = subprocess.Popen(
            [sys.executable, str(HERE / "_torchft_worker.py"), "--replica-id", node, "--lighthouse", self.address,
             "--steps", str(self.steps), "--metrics", str(self.metrics), "--pg-timeout", str(self.pg_timeout_s),
             *self.spec.worker_args(),
             *(["--start-when", str(start_when)] if start_when else [])],
            stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)

    def kill(self, node: str) -> float:
        t = time.time()
        try:
            os.killpg(self.procs[node].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass    # the group had died already
        self.procs[node].wait(10)
        return t

    def join(self, node: str) -> float:
        self._spawn(node)
        return self.starts[node]

    def term(self, node: str) -> float:
        t = time.time()
        self.procs[node].send_signal(signal.SIGTERM)   # torchft has no graceful leave: the group dies
        return t

    def finish(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            for node, p in self.procs.items():
                rc = p.wait(max(0.1, deadline - time.monotonic()))
                if rc not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    raise RuntimeError(f"{self.name}: replica group {node} exited {rc}; see {self.work}/{node}.log")
        finally:
            self.stop()

    def stop(self) -> None:
        for p in [*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


class CkptRestartArm(_Arm):
    """torchrun-style checkpoint-restart: one worker per node (:mod:`_ckpt_worker`) in one
    gloo job; when a worker dies, or the membership changes (a node joins), every worker is
    stopped (SIGTERM, then SIGKILL) and the job is started again on the nodes there are,
    from the newest DCP checkpoint, as torchrun's elastic agent does. Failure detection is
    a watcher polling the workers every 0.1 s (torchrun's ``monitor_interval``); a real
    multi-node torchrun adds its rendezvous on top, so these restart times are a floor."""

    name = "checkpoint-restart"

    def __init__(self, work: Path, spec: ModelSpec, steps: int, mtbf_steps: float | None,
                 mtbf_s: float | None = None, max_restarts: int = 20) -> None:
        super().__init__(work, spec, steps)
        if (mtbf_steps is None) == (mtbf_s is None):
            raise ValueError("CkptRestartArm: give exactly one of mtbf_steps or mtbf_s")
        self.mtbf_steps = mtbf_steps
        self.mtbf_s = mtbf_s
        self.max_restarts = max_restarts
        self.nodes: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.run = -1
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._error: str | None = None
        self._watcher: threading.Thread | None = None
        self.restarts: list[dict[str, Any]] = []

    def _launch(self) -> None:
        self.run += 1
        port = _free_port()
        ckpt = self.work / "ckpt"
        ckpt.mkdir(exist_ok=True)
        self.procs = {}
        for rank, node in enumerate(self.nodes):
            env = dict(_env(), RANK=str(rank), WORLD_SIZE=str(len(self.nodes)), LOCAL_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_ID=node)
            log = open(self.work / f"{node}.log", "ab")
            self.starts[node] = time.time()
            self.procs[node] = subprocess.Popen(
                [sys.executable, str(HERE / "_ckpt_worker.py"), "--ckpt", str(ckpt), "--steps", str(self.steps),
                 "--metrics", str(self.metrics), "--run", str(self.run),
                 *(["--mtbf-steps", str(self.mtbf_steps)] if self.mtbf_s is None else ["--mtbf-s", str(self.mtbf_s)]),
                 *self.spec.worker_args()], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def _restart(self, reason: str, drop: Sequence[str] = (), add: Sequence[str] = ()) -> None:
        with self._lock:
            t = time.time()
            self._stop_all()
            self.nodes = [n for n in self.nodes if n not in drop] + list(add)
            self.restarts.append({"t": t, "reason": reason, "nodes": list(self.nodes)})
            self._launch()

    def _watch(self) -> None:
        while not self._done.is_set():
            time.sleep(0.1)
            with self._lock:
                exited = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
                if not exited:
                    continue
                if all(rc == 0 for rc in exited.values()) and len(exited) == len(self.procs):
                    self._done.set()
                    return
                failed = [n for n, rc in exited.items() if rc != 0]
                if not failed:
                    continue      # some finished, the others are finishing
                if len(self.restarts) > self.max_restarts:
                    self._error = f"{len(self.restarts)} restarts; last failure of {failed}"
                    self._done.set()
                    return
                # the nodes that went away (killed, or stopped by a spot notice) leave the job;
                # a worker that failed because its peer vanished (a broken collective) is
                # restarted on its node, as torchrun's agent on that node would
                gone = [n for n in failed if exited[n] in (-signal.SIGKILL, -signal.SIGTERM, 143)]
                self._restart(f"worker of {failed} exited {[exited[n] for n in failed]}", drop=gone)

    def start(self, nodes: Sequence[str]) -> None:
        self.nodes = list(nodes)
        self._launch()
        self._watcher = threading.Thread(target=self._watch, name="ckpt-restart-watch", daemon=True)
        self._watcher.start()

    def kill(self, node: str) -> float:
        with self._lock:
            t = time.time()
            try:
                os.killpg(self.procs[node].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass    # its worker had exited already (the watcher restarts without it)
            return t

    def join(self, node: str) -> float:
        t = time.time()
        self._restart(f"node {node} joins", add=[node])
        return t

    def term(self, node: str) -> float:
        with self._lock:
            t = time.time()
            try:
                os.killpg(self.procs[node].pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            return t

    def finish(self, timeout: float) -> None:
        try:
            if not self._done.wait(timeout):
                raise TimeoutError(f"{self.name}: not done within {timeout:.0f} s; see {self.work}")
            if self._error:
                raise RuntimeError(f"{self.name}: {self._error}; see {self.work}")
        finally:
            self.stop()

    def stop(self) -> None:
        self._done.set()
        with self._lock:
            for p in self.procs.values():
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait(10)

    def interval(self) -> dict[str, Any] | None:
        return next((r for r in self.records() if r.get("kind") == "interval"), None)
