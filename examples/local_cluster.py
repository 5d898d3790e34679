"""A Lazarus job on one machine: a controller and N agents as real processes.

Used by ``make demo`` (:mod:`examples.lazarus_demo`) and the fault-injection tests. Each "node" is
an agent process started in its own session, so ``kill_node`` takes down the agent and
its worker together (SIGKILL to the process group), like a machine that vanishes;
``freeze_node`` stops them (SIGSTOP), like a hung host; ``freeze_worker`` stops only the
training processes (or one), like a worker hung under a live agent; ``kill_worker`` kills only the
training processes (or one of them: with ``nproc_per_node`` > 1 an agent runs several, and
one's death takes the node's others down); ``leave`` sends the agent SIGTERM, like a spot-preemption notice;
``kill_controller`` / ``restart_controller`` take the controller down and bring it back
with the same command line (it resumes from its state directory).

With ``network=`` (a :class:`examples.netns_cluster.NetnsNetwork`) the controller and every
node run on hosts of their own, each in its network namespace with its own address on a
bridge (the controller bound to its address), and the network's faults apply to them:
``c.network.partition("n2")``, ``c.network.cut("n1", "controller")``...
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["LocalCluster"]

#: the repository root (the directory holding ``examples``)
ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _catches(pid: int, sig: int) -> bool:
    """Has process ``pid`` a handler for ``sig`` (``SigCgt`` in /proc/PID/status)?"""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class LocalCluster:
    """Controller + agents on 127.0.0.1 with ephemeral ports.

    Args:
        workdir: logs, events, metrics, secret and node memory go here.
        worker_args: arguments after ``python -m examples.train_elastic`` (or a
            full command via ``worker_command``).
        controller_args: extra ``lazarus controller`` options (``--slots 4`` ...).
        agent_args: extra ``lazarus agent`` options.
        nproc_per_node: workers per agent (``--nproc-per-node``).
        network: run each process on a host of this :class:`~examples.netns_cluster.NetnsNetwork`
            (the controller on host ``controller``, node ``n`` on host ``n``); None: all
            on this machine's loopback.
    """

    def __init__(self, workdir: str | os.PathLike, *, worker_args: Sequence[str] = (),
                 worker_command: Sequence[str] | None = None, controller_args: Sequence[str] = (),
                 agent_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 nproc_per_node: int = 1, network: Any = None) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.dir / "events.jsonl"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.secret_path = self.dir / "secret"
        self.secret_path.write_text(secrets.token_hex(32))
        os.chmod(self.secret_path, 0o600)
        self.worker_command = list(worker_command) if worker_command else [
            sys.executable, "-m", "examples.train_elastic", "--metrics", str(self.metrics_path),
            *worker_args]
        self.controller_args = list(controller_args)
        self.nproc_per_node = int(nproc_per_node)
        self.agent_args = list(agent_args) + (["--nproc-per-node", str(self.nproc_per_node)]
                                              if self.nproc_per_node != 1 else [])
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        # The example workers (``python -m examples...``) import from the repository root,
        # whatever the agents' working directory.
        path = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in path if p != str(ROOT)]])
        self.controller: subprocess.Popen | None = None
        self.address = ""
        self.agents: dict[str, subprocess.Popen] = {}
        self.kill_times: dict[str, float] = {}
        self.controller_down = False   # killed on purpose (kill_controller) and not started again
        self.network = network

    # -- processes -------------------------------------------------------------------------
    def start_controller(self, timeout: float = 60.0) -> str:
        """Start ``lazarus controller`` (again: the same command line, so a restarted
        controller finds its state beside the events file and its old ports)."""
        self.controller_down = False
        log = open(self.dir / "controller.log", "a")
        cmd = [sys.executable, "-m", "lazarus.cli", "controller", "--port", "0", "--store-port", "0",
               "--secret-file", str(self.secret_path), "--events", str(self.events_path), *self.controller_args]
        if self.network is not None:
            cmd = self.network.wrap("controller", [*cmd, "--host", self.network.add_host("controller")])
        self.controller = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, env=self.env, start_new_session=True, text=True)
        deadline = time.monotonic() + timeout
        assert self.controller.stdout is not None
        while time.monotonic() < deadline:
            line = self.controller.stdout.readline()
            if not line:
                if self.controller.poll() is not None:
                    raise RuntimeError(f"controller exited ({self.controller.returncode}); "
                                       f"see {self.dir}/controller.log")
                continue
            if "listening on" in line:
                self.address = line.split("listening on", 1)[1].split(",")[0].strip()
                return self.address
        raise TimeoutError("controller did not start")

    def add_node(self, node: str, *, extra_worker_args: Sequence[str] = (), standby: bool = False) -> subprocess.Popen:
        """Start node ``node``'s agent (``standby``: as a hot spare, warm but not registered
        until :meth:`activate`)."""
        mem = self.dir / "memory" / node
        log = open(self.dir / f"node-{node}.log", "a")
        cmd = [sys.executable, "-m", "lazarus.cli", "agent", "--controller", self.address,
               "--secret-file", str(self.secret_path), "--node-id", node, "--snapshot-dir", str(mem),
               *self.agent_args, *(["--standby"] if standby else []), "--", *self.worker_command, *extra_worker_args]
        if self.network is not None:
            self.network.add_host(node)
            cmd = self.network.wrap(node, cmd)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.agents[node] = proc
        return proc

    def activate(self, node: str, timeout: float = 60.0) -> float:
        """Call standby node ``node`` in (SIGUSR1: it registers and joins); returns when.
        Waits (up to ``timeout``) for the agent's handler first: SIGUSR1 before it would
        kill the agent."""
        agent = self.agents[node]
        self.wait_for(lambda: agent.poll() is not None or _catches(agent.pid, signal.SIGUSR1), timeout,
                      f"node {node}'s agent to handle SIGUSR1")
        if agent.poll() is not None:
            raise RuntimeError(f"standby node {node}'s agent exited ({agent.returncode}); see {self.dir}")
        t = time.time()
        agent.send_signal(signal.SIGUSR1)
        return t

    def start(self, nodes: Sequence[str]) -> None:
        self.start_controller()
        for n in nodes:
            self.add_node(n)

    def kill_controller(self) -> float:
        """SIGKILL the controller (and the rendezvous store it hosts)."""
        assert self.controller is not None
        t = time.time()
        self.controller_down = True
        os.killpg(self.controller.pid, signal.SIGKILL)
        self.controller.wait(timeout=10)
        return t

    def restart_controller(self, timeout: float = 60.0) -> str:
        """Start the controller again with the same command line; it resumes the job."""
        return self.start_controller(timeout)

    def kill_node(self, node: str) -> float:
        """SIGKILL the agent and its worker (the whole node)."""
        t = time.time()
        self.kill_times[node] = t
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        self.agents[node].wait(timeout=10)
        return t

    def worker_pids(self, node: str) -> dict[int, int]:
        """``local rank -> pid`` of the node's running workers."""
        out = {}
        for pid in _children(self.agents[node].pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            out[int(env.get(b"LOCAL_RANK", b"0"))] = pid
        return out

    def kill_worker(self, node: str, local_rank: int | None = None) -> float:
        """SIGKILL only the node's training processes, or only its worker ``local_rank``
        (the agent stays; it stops the node's other workers and restarts them all)."""
        if local_rank is None:
            kids = _children(self.agents[node].pid)
        else:
            kids = [pid for lr, pid in self.worker_pids(node).items() if lr == local_rank]
        if not kids:
            raise RuntimeError(f"node {node} has no worker process" +
                               (f" of local rank {local_rank}" if local_rank is not None else ""))
        t = time.time()
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        return t

    def freeze_node(self, node: str) -> float:
        t = time.time()
        os.killpg(self.agents[node].pid, signal.SIGSTOP)
        return t

    def thaw_node(self, node: str) -> None:
        os.killpg(self.agents[node].pid, signal.SIGCONT)

    def freeze_worker(self, node: str, local_rank: int | None = None) -> tuple[float, list[int]]:
        """SIGSTOP only the node's training processes, or only its worker ``local_rank``
        (its agent keeps running, like a worker hung on its host); returns when, and their
        pids."""
        pids = [pid for lr, pid in self.worker_pids(node).items() if local_rank is None or lr == local_rank]
        if not pids:
            raise RuntimeError(f"node {node} has no worker process" +
                               (f" of local rank {local_rank}" if local_rank is not None else ""))
        t = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return t, pids

    @staticmethod
    def thaw(pids: Sequence[int]) -> list[int]:
        """SIGCONT ``pids``; returns those that still existed."""
        woke = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                woke.append(pid)
            except ProcessLookupError:
                pass
        return woke

    def leave(self, node: str) -> float:
        t = time.time()
        self.agents[node].send_signal(signal.SIGTERM)
        return t

    def wait(self, timeout: float) -> int:
        """Wait for the controller to exit (it does when the job is done)."""
        assert self.controller is not None
        return self.controller.wait(timeout=timeout)

    def stop(self) -> None:
        procs = list(self.agents.values()) + ([self.controller] if self.controller else [])
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- observations --------------------------------------------------------------------
    @staticmethod
    def _jsonl(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return out

    def events(self) -> list[dict[str, Any]]:
        return self._jsonl(self.events_path)

    def metrics(self) -> list[dict[str, Any]]:
        return self._jsonl(self.metrics_path)

    def steps(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics() if m.get("kind") == "step"]

    def current_step(self) -> int:
        s = self.steps()
        return max((m["step"] for m in s), default=-1)

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.controller is not None and not self.controller_down and self.controller.poll() is not None:
                raise RuntimeError(f"controller exited ({self.controller.returncode}) while waiting for {what}")
            time.sleep(poll)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; see {self.dir}")

    def wait_step(self, step: int, timeout: float = 120.0) -> int:
        return self.wait_for(lambda: self.current_step() >= step and self.current_step(), timeout, f"step {step}")

    def latest_plan(self) -> dict[str, Any] | None:
        plans = [e for e in self.events() if e.get("event") == "plan"]
        return plans[-1] if plans else None

    def reconfigurations(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics() if m.get("kind") == "reconfigured"]

    # -- end-of-job checks (fault tests, make soak) -------------------------------------------
    @staticmethod
    def workers(nodes: Sequence[str], nproc_per_node: int = 1) -> list[str]:
        """Names of the workers of ``nodes``: the node itself with one worker per node,
        ``<node>/<local rank>`` with several."""
        if nproc_per_node == 1:
            return list(nodes)
        return [f"{n}/{lr}" for n in nodes for lr in range(nproc_per_node)]

    @staticmethod
    def read_digests(pattern: str, nodes: Sequence[str], nproc_per_node: int = 1) -> dict[str, dict[str, Any]]:
        """The digest files the example worker writes at the end (``--digests``, with
        ``{node}`` and, with several workers per node, ``{local_rank}`` in ``pattern``) of
        ``nodes``' workers, keyed as :meth:`workers` names them; absent files are left out."""
        out = {}
        for name in LocalCluster.workers(nodes, nproc_per_node):
            node, _, lr = name.partition("/")
            path = Path(pattern.replace("{node}", node).replace("{local_rank}", lr or "0"))
            if path.exists():
                out[name] = json.loads(path.read_text())
        return out

    @staticmethod
    def final_state_problems(digests: dict[str, dict[str, Any]], alive: Sequence[str], steps: int,
                             expert_units: int) -> list[str]:
        """What is wrong with the end of a job (empty when nothing): every live worker
        (``alive``: names as :meth:`workers` gives them) finished every step in one world
        made of exactly the live workers, every replica of every expert is identical
        (weights and optimizer state), the dense state is identical on every rank, and
        every expert is held somewhere."""
        problems = [f"node {n} wrote no digests (did not finish)" for n in alive if n not in digests]
        if problems:
            return problems
        if {d["step"] for d in digests.values()} != {steps}:
            problems.append(f"final steps {sorted({d['step'] for d in digests.values()})} != {steps}")
        if {d["world"] for d in digests.values()} != {len(alive)}:
            problems.append(f"final world sizes {sorted({d['world'] for d in digests.values()})} != {len(alive)}")
        if sorted(d["rank"] for d in digests.values()) != list(range(len(alive))):
            problems.append(f"final ranks {sorted(d['rank'] for d in digests.values())}")
        by_unit: dict[str, set[str]] = {}
        for d in digests.values():
            for unit, h in d["experts"].items():
                by_unit.setdefault(unit, set()).add(h)
        if len(by_unit) != expert_units:
            problems.append(f"{len(by_unit)} expert units held, expected {expert_units}: {sorted(by_unit)}")
        diverged = sorted(u for u, h in by_unit.items() if len(h) > 1)
        if diverged:
            problems.append(f"replicas differ for {diverged}")
        if len({d["dense"] for d in digests.values()}) != 1:
            problems.append("dense state differs across ranks")
        return problems

    def loss_drop(self, n: int = 10) -> tuple[float, float]:
        """Mean loss of the first and of the last ``n`` recorded steps."""
        losses = [m["loss"] for m in sorted(self.steps(), key=lambda m: (m["step"], m["t"]))]
        return sum(losses[:n]) / len(losses[:n]), sum(losses[-n:]) / len(losses[-n:])
