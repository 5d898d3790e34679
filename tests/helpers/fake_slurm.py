"""A stand-in for SLURM's ``srun`` and ``scontrol``, enough to run a batch script on one machine.

``tests/test_launch_recipes.py`` runs ``examples/launch/slurm/lazarus.sbatch`` under bash
with ``tests/helpers/fake_slurm_bin`` first on ``PATH`` and the variables ``sbatch`` gives a
batch step (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_NUM_NODES``...). What it
enforces, as SLURM would:

* ``scontrol show hostnames LIST``: a hostlist (``node[1-3,7]``, ``127.0.0.[1-3]``, commas)
  expanded one name a line; ``scontrol requeue JOBID`` recorded in ``$FAKE_SLURM_DIR/requeue``;
  anything else is refused.
* ``srun``: only the options below (an unknown one is an error, exit 2); at most the
  allocation's nodes; one process per task, each with the task's own ``SLURM_PROCID``,
  ``SLURM_NODEID``, ``SLURM_LOCALID``, ``SLURMD_NODENAME``, ``SLURM_NTASKS``,
  ``SLURM_NNODES``, ``SLURM_STEP_ID``, ``SLURM_STEP_NODELIST``...; every task in a session
  of its own; its pid in ``$FAKE_SLURM_DIR/step<N>/task<I>.pid``. With
  ``FAKE_SLURM_NETNS=node=namespace,...`` a node's tasks run in that network namespace
  (``ip netns exec``, which execs: the pid is the task's), so each node is a host of its own.
* Signals: a SIGTERM (or SIGINT) to ``srun`` is delivered to *every process of every task*
  (the agent and its workers: SLURM's proctrack plugin signals the whole step, not just the
  task's first process), then SIGKILL after ``$FAKE_SLURM_KILL_WAIT`` s (SLURM's
  ``KillWait``, default 30). :func:`signal_task` does the same to one task.
* Exit: when every task has ended (``--wait=0``) or, with ``--wait=S``, S s after the first
  ended; ``--kill-on-bad-exit=1`` kills the step when a task exits non-zero. The status is
  the largest task status (a signal N as 128 + N).

Runs under any Python 3 (stdlib only); no SLURM is needed or touched.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["expand_hostlist", "signal_tree", "signal_task", "descendants"]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's hostlist syntax: ``a[1-3,5],b07,c[01-02]`` -> names, in order."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", text):
        if not part:
            continue
        pieces = re.split(r"(\[[^\]]*\])", part)
        names = [""]
        for piece in pieces:
            if piece.startswith("["):
                choices = []
                for rng in piece[1:-1].split(","):
                    lo, _, hi = rng.partition("-")
                    if not lo.isdigit() or (hi and not hi.isdigit()):
                        raise ValueError(f"bad hostlist range {rng!r} in {text!r}")
                    width = len(lo)
                    choices += [str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1)]
                names = [n + c for n in names for c in choices]
            else:
                names = [n + piece for n in names]
        out += names
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and all its descendants (what proctrack does to a step)."""
    hit = []
    for p in descendants(pid):
        try:
            os.kill(p, sig)
            hit.append(p)
        except ProcessLookupError:
            pass
    return hit


def signal_task(slurm_dir: str | os.PathLike, task: int, sig: int, step: int = 0) -> list[int]:
    """Signal every process of task ``task`` of step ``step`` (its pid file)."""
    pid = int((Path(slurm_dir) / f"step{step}" / f"task{task}.pid").read_text())
    return signal_tree(pid, sig)


def _die(prog: str, msg: str) -> None:
    print(f"{prog}: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        text = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        if not text:
            _die("scontrol", "show hostnames: no hostlist given and SLURM_JOB_NODELIST is not set")
        for name in expand_hostlist(text):
            print(name)
        return 0
    if argv[:1] == ["requeue"] and len(argv) == 2:
        if argv[1] != os.environ.get("SLURM_JOB_ID"):
            _die("scontrol", f"requeue: invalid job id {argv[1]!r}")
        with open(Path(os.environ["FAKE_SLURM_DIR"]) / "requeue", "a") as f:
            f.write(argv[1] + "\n")
        return 0
    _die("scontrol", f"unsupported here: {' '.join(argv)!r} (the fake knows show hostnames and requeue)")
    return 2


_SRUN_VALUED = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
                "--ntasks-per-node": "ntasks_per_node", "--kill-on-bad-exit": "kill_on_bad_exit",
                "-K": "kill_on_bad_exit", "--wait": "wait", "-W": "wait", "--export": "export",
                "-w": "nodelist", "--nodelist": "nodelist", "--cpu-bind": "cpu_bind", "--gpus-per-node": "gpus"}
_SRUN_FLAGS = {"--label": "label", "-l": "label", "--overlap": "overlap", "--exact": "exact"}


def _srun(argv: list[str]) -> int:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _SRUN_VALUED:
            if not eq:
                i += 1
                if i >= len(argv):
                    _die("srun", f"option {name} needs a value")
                value = argv[i]
            opts[_SRUN_VALUED[name]] = value
        elif arg in _SRUN_FLAGS:
            opts[_SRUN_FLAGS[arg]] = "1"
        else:
            _die("srun", f"unrecognized option '{arg}'")
        i += 1
    command = argv[i:]
    if not command:
        _die("srun", "no command given")
    alloc = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    if not alloc or "SLURM_JOB_ID" not in os.environ:
        _die("srun", "not inside an allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST unset)")
    nodes = int(opts.get("nodes", len(alloc)))
    if nodes > len(alloc):
        _die("srun", f"--nodes={nodes}: the allocation has {len(alloc)} nodes")
    per_node = int(opts.get("ntasks_per_node", 1))
    ntasks = int(opts.get("ntasks", nodes * per_node))
    if ntasks != nodes * per_node:
        _die("srun", f"--ntasks={ntasks} with --nodes={nodes} --ntasks-per-node={per_node}: this fake lays "
                     "out exactly ntasks-per-node tasks on every node")
    wait_s = float(opts.get("wait", "0"))
    kill_bad = opts.get("kill_on_bad_exit", "0") not in ("0", "")
    kill_wait = float(os.environ.get("FAKE_SLURM_KILL_WAIT", "30"))
    run_dir = Path(os.environ["FAKE_SLURM_DIR"])
    step = 0
    while True:
        try:
            (run_dir / f"step{step}").mkdir(parents=True)
            break
        except FileExistsError:
            step += 1
    step_dir = run_dir / f"step{step}"
    used = alloc[:nodes]
    netns = dict(item.split("=", 1) for item in os.environ.get("FAKE_SLURM_NETNS", "").split(",") if item)
    procs: list[subprocess.Popen] = []
    for t in range(ntasks):
        node = t // per_node
        env = dict(os.environ, SLURM_STEP_ID=str(step), SLURM_STEPID=str(step), SLURM_PROCID=str(t),
                   SLURM_NODEID=str(node), SLURM_LOCALID=str(t % per_node), SLURMD_NODENAME=used[node],
                   SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks), SLURM_NNODES=str(nodes),
                   SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NUM_TASKS=str(ntasks),
                   SLURM_STEP_NODELIST=",".join(used), SLURM_NTASKS_PER_NODE=str(per_node),
                   SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})", SLURM_TOPOLOGY_ADDR=used[node])
        argv = command
        if used[node] in netns:   # the task runs on that "host": its network namespace
            argv = ["ip", "netns", "exec", netns[used[node]], *command]
        p = subprocess.Popen(argv, env=env, start_new_session=True)
        (step_dir / f"task{t}.pid").write_text(str(p.pid))
        procs.append(p)

    signalled: list[float] = []

    def forward(sig: int, _frame: object) -> None:
        signalled.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                signal_tree(p.pid, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    first_end: float | None = None
    killed = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        ended = [p for p in procs if p.returncode is not None]
        if ended and first_end is None:
            first_end = now
        bad = kill_bad and any(p.returncode for p in ended)
        late = (first_end is not None and wait_s > 0 and now - first_end > wait_s) or \
               (signalled and now - signalled[0] > kill_wait)
        if (bad or late) and not killed:
            killed = True
            for p in procs:
                if p.poll() is None:
                    signal_tree(p.pid, signal.SIGKILL)
        time.sleep(0.05)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    (step_dir / "exit").write_text(" ".join(map(str, codes)))
    return max(codes)


def main() -> int:
    prog = sys.argv[1] if len(sys.argv) > 1 else ""
    if prog == "srun":
        return _srun(sys.argv[2:])
    if prog == "scontrol":
        return _scontrol(sys.argv[2:])
    _die("fake_slurm", f"run as srun or scontrol, not {prog!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
