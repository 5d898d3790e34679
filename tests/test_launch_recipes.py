"""The launch recipes of ``examples/launch`` (issue 43 item 7), run or checked as far as
this machine allows.

SLURM: the real ``lazarus.sbatch`` runs under bash with ``tests/helpers/fake_slurm_bin``
(a fake ``srun`` / ``scontrol`` that lays out one task per node with that node's SLURM
variables and signals every process of a task, as SLURM does) first on ``PATH``; the
"nodes" are loopback addresses ``127.0.0.1``-``127.0.0.3`` of this machine or, where root
and ``ip netns`` exist, hosts of their own in network namespaces on a bridge
(``examples.netns_cluster``); the controller, agents and workers are real processes.
Kubernetes: the manifests are parsed with PyYAML and every ``lazarus`` command line in them
with the real CLI's parser; nothing is deployed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from examples.local_cluster import LocalCluster
from tests.helpers import fake_slurm

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "launch" / "slurm" / "lazarus.sbatch"
FAKE_BIN = ROOT / "tests" / "helpers" / "fake_slurm_bin"

# a tiny model: 2 MoE layers of 4 experts; 4 slots per node, 2 replicas
TRAIN = [sys.executable, "-m", "examples.train_elastic", "--layers", "2", "--experts", "4", "--d-model", "16",
         "--d-hidden", "32", "--seq-len", "16", "--batch-size", "6", "--corpus-bytes", "65536", "--interval", "5"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _secret(path: Path, mode: int = 0o600) -> Path:
    path.write_text(os.urandom(32).hex())
    os.chmod(path, mode)
    return path


def _env(tmp: Path, nodelist: str, nodes: int, **extra: str) -> dict[str, str]:
    port, store_port = _free_ports(2)
    env = dict(os.environ, PATH=f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and p != str(ROOT)]]),
               FAKE_SLURM_PYTHON=sys.executable, FAKE_SLURM_DIR=str(tmp / "slurm"), FAKE_SLURM_KILL_WAIT="30",
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="recipe", SLURM_JOB_NODELIST=nodelist,
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_GPUS_ON_NODE="1",
               LAZARUS=f"{sys.executable} -m lazarus.cli", LAZARUS_RUN_DIR=str(tmp / "run"),
               LAZARUS_PORT=str(port), LAZARUS_STORE_PORT=str(store_port))
    env.pop("LAZARUS_CONTROLLER_ADDR", None)
    env.update(extra)
    return env


def _events(run: Path) -> list[dict[str, Any]]:
    return LocalCluster._jsonl(run / "events.jsonl")


def _wait(pred: Any, timeout: float, what: str, job: subprocess.Popen, logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if job.poll() is not None:
            raise AssertionError(f"the batch script exited ({job.returncode}) while waiting for {what}; see {logs}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; see {logs}")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.fixture(params=["loopback", "netns"])
def three_hosts(request):
    """``(nodelist, node names, extra env, wrap)``: three loopback addresses of this machine,
    or three hosts each in its own network namespace on a bridge (root and ``ip netns``
    needed; skipped elsewhere, saying why), the batch step on the first."""
    if request.param == "loopback":
        yield "127.0.0.[1-3]", ["127.0.0.1", "127.0.0.2", "127.0.0.3"], {"LAZARUS_CONTROLLER_ADDR": "127.0.0.1"}, list
        return
    from examples.netns_cluster import NetnsNetwork, unavailable

    why = unavailable(need_nft=False)
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    with NetnsNetwork() as net:
        addrs = [net.add_host(f"h{i}") for i in range(3)]
        last = [a.rsplit(".", 1) for a in addrs]
        assert [int(x[1]) for x in last] == list(range(int(last[0][1]), int(last[0][1]) + 3))
        nodelist = f"{last[0][0]}.[{last[0][1]}-{last[-1][1]}]"
        netns = ",".join(f"{a}={net.namespace(f'h{i}')}" for i, a in enumerate(addrs))
        # the controller's address comes from the first node's name (here its address)
        yield nodelist, addrs, {"FAKE_SLURM_NETNS": netns}, lambda cmd: net.wrap("h0", cmd)


@pytest.mark.timeout(300)
def test_sbatch_forms_trains_survives_a_leave_and_ends(tmp_path, three_hosts):
    """Three "nodes": the controller on the first, one agent each through srun; one task's
    SIGTERM (every process of it, as SLURM signals a step) is a graceful leave, not a
    crash; the other two finish the run, identical, and every process is gone."""
    nodelist, names, extra, wrap = three_hosts
    steps = 30
    slow = tmp_path / "slow"
    slow.touch()
    run = tmp_path / "run"
    env = _env(tmp_path, nodelist, 3, LAZARUS_SECRET_FILE=str(_secret(tmp_path / "secret")), **extra)
    cmd = wrap(["bash", str(SBATCH), "--", *TRAIN, "--storage", str(run / "ckpt"), "--steps", str(steps),
                "--metrics", str(run / "metrics.jsonl"), "--slow-while", str(slow),
                "--digests", str(run / "digest-{node}.json")])
    out = open(tmp_path / "sbatch.out", "w+")
    job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: set[int] = set()
    try:
        def step() -> int:
            return max((m["step"] for m in LocalCluster._jsonl(run / "metrics.jsonl") if m.get("kind") == "step"),
                       default=-1)

        _wait(lambda: step() >= 3, 180, "step 3", job, run)
        seen.update(fake_slurm.descendants(job.pid))
        plans = [e for e in _events(run) if e["event"] == "plan"]
        assert plans and plans[-1]["members"] == names
        # each task has its node's identity: the agents registered under the node names
        assert {e["node"] for e in _events(run) if e["event"] == "node_registered"} == \
            set(names)
        if "FAKE_SLURM_NETNS" in extra:   # each node its own host: it advertises its own address
            ready = [e for e in _events(run) if e["event"] == "worker_ready"]
            assert ready and all(e["store"]["host"] == e["node"] for e in ready), ready

        hit = fake_slurm.signal_task(tmp_path / "slurm", 2, signal.SIGTERM)
        assert len(hit) >= 2, f"expected the agent and its worker, signalled {hit}"
        _wait(lambda: (tmp_path / "slurm" / "step0" / "task2.pid").exists() and not _alive(hit), 60,
              "the leaving node's processes to exit", job, run)
        evs = _events(run)
        leave_plans = [e for e in evs if e["event"] == "plan" and e.get("reason") == "leave"]
        assert leave_plans and leave_plans[0]["members"] == names[:2], evs
        exits = [e for e in evs if e["event"] == "worker_exit"]
        # a graceful leave: the leaving worker handed over and exited 0; nobody crashed
        assert [e["returncode"] for e in exits if e["node"] == names[2]] == [0], exits
        assert not [e for e in evs if e["event"] == "node_failed"], [e for e in evs if e["event"] == "node_failed"]
        assert not [e for e in exits if e["node"] != names[2]], exits
        slow.unlink()
        rc = job.wait(timeout=120)
        out.seek(0)
        text = out.read()
        assert rc == 0, text
        assert "agents exited 0, controller 0, training done: 1" in text, text
        assert (tmp_path / "slurm" / "step0" / "exit").read_text().split() == ["0", "0", "0"]
        digests = LocalCluster.read_digests(str(run / "digest-{node}.json"), names[:2])
        assert LocalCluster.final_state_problems(digests, names[:2], steps, 8) == []
        assert not (run / f"digest-{names[2]}.json").exists()   # it left: no final state of its own
        worlds = {m["world"] for m in LocalCluster._jsonl(run / "metrics.jsonl") if m.get("kind") == "step"}
        assert worlds == {2, 3}
        # the controller kept its state on the run dir (a requeued job resumes it)
        assert (run / "state").is_dir() and any((run / "state").iterdir())
        assert not (tmp_path / "slurm" / "requeue").exists()
        time.sleep(0.5)
        assert _alive(sorted(seen)) == [], "processes of the job outlived it"
    finally:
        _end_job(job, seen, out)


def _end_job(job: subprocess.Popen, seen: set[int], out) -> None:
    """Kill whatever of the job is left (every process it ever had), reap it, close its log."""
    for pid in _alive(sorted(seen | set(fake_slurm.descendants(job.pid)))):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(timeout=30)
    out.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("problem", ["missing", "mode", "short"])
def test_sbatch_refuses_a_bad_secret_file_before_starting_anything(tmp_path, problem):
    secret = tmp_path / "secret"
    if problem == "mode":
        _secret(secret, 0o644)
    elif problem == "short":
        secret.write_text("tooshort")
        os.chmod(secret, 0o600)
    env = _env(tmp_path, "127.0.0.[1-2]", 2, LAZARUS_SECRET_FILE=str(secret), LAZARUS_CONTROLLER_ADDR="127.0.0.1")
    proc = subprocess.run(["bash", str(SBATCH), "--", *TRAIN, "--storage", str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=45)
    err = proc.stderr
    if problem == "missing":
        assert proc.returncode == 2 and f"LAZARUS_SECRET_FILE={secret} does not exist" in err and "openssl rand" in err
    elif problem == "mode":
        assert proc.returncode == 2 and "has mode 644" in err and f"chmod 600 {secret}" in err
    else:
        # the script's checks pass; the controller refuses it, and the script says so and ends
        assert proc.returncode != 0
        log = (tmp_path / "run" / "logs" / "controller.log").read_text()
        assert "the secret must be at least 16 bytes, got 8" in log
    if problem != "short":
        assert not (tmp_path / "slurm").exists() and not (tmp_path / "run").exists(), "something was started"


@pytest.mark.timeout(60)
def test_sbatch_refuses_a_loopback_controller_address_for_several_nodes(tmp_path):
    """The head node's name resolving to loopback (127.0.1.1 on stock Debian/Ubuntu) would
    send every other node to its own loopback: refused, naming the knob."""
    env = _env(tmp_path, "localhost,127.0.0.2", 2, LAZARUS_SECRET_FILE=str(_secret(tmp_path / "secret")))
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=45)
    assert proc.returncode == 2, proc.stderr
    assert "localhost resolves to 127.0.0.1 (loopback)" in proc.stderr and "LAZARUS_CONTROLLER_ADDR" in proc.stderr
    assert not (tmp_path / "slurm").exists()


@pytest.mark.timeout(300)
def test_sbatch_preempted_requeues_and_the_requeued_job_resumes(tmp_path):
    """SLURM's preemption: SIGTERM to every process of the job (the batch shell, the
    controller, every task), SIGKILL after KillWait. The script asks for a requeue; run
    again as the requeued job (SLURM_RESTART_COUNT=1), it resumes the controller's state
    and the checkpoint from the shared run dir and finishes the steps."""
    steps = 25
    slow = tmp_path / "slow"
    slow.touch()
    run = tmp_path / "run"
    env = _env(tmp_path, "127.0.0.[1-2]", 2, LAZARUS_SECRET_FILE=str(_secret(tmp_path / "secret")),
               LAZARUS_CONTROLLER_ADDR="127.0.0.1", LAZARUS_AGENT_ARGS="--leave-timeout 5s --stop-timeout 3s")
    cmd = ["bash", str(SBATCH), "--", *TRAIN, "--storage", str(run / "ckpt"), "--steps", str(steps),
           "--metrics", str(run / "metrics.jsonl"), "--slow-while", str(slow),
           "--digests", str(run / "digest-{node}.json")]

    def steps_seen() -> list[int]:
        return [m["step"] for m in LocalCluster._jsonl(run / "metrics.jsonl") if m.get("kind") == "step"]

    out = open(tmp_path / "sbatch.out", "w+")
    job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: set[int] = set()
    try:
        _wait(lambda: max(steps_seen(), default=-1) >= 7, 180, "step 7", job, run)   # step 5 committed
        seen.update(fake_slurm.descendants(job.pid))
        t0 = time.monotonic()
        fake_slurm.signal_tree(job.pid, signal.SIGTERM)
        rc = job.wait(timeout=60)
        took = time.monotonic() - t0
        out.seek(0)
        text = out.read()
        assert rc != 0, text
        assert "requeueing job 4242" in text and (tmp_path / "slurm" / "requeue").read_text() == "4242\n", text
        assert took < 30, f"the preempted job took {took:.1f} s to end (SLURM's KillWait is 30 s)"
        time.sleep(0.5)
        assert _alive(sorted(seen)) == [], "processes of the preempted job outlived it"
        print(f"preempted job ended in {took:.1f} s")
        first_run_last = max(steps_seen())
        assert first_run_last < steps - 1

        slow.unlink()
        env["SLURM_RESTART_COUNT"] = "1"
        before = len(steps_seen())
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        t1 = time.monotonic()
        rc = job.wait(timeout=180)
        print(f"requeued job ran {time.monotonic() - t1:.1f} s")
        out.seek(0)
        text = out.read()
        assert rc == 0, text
        assert "(restart 1)" in text and "training done: 1" in text, text
        second = steps_seen()[before:]
        assert second and 0 < min(second) <= first_run_last + 1, (first_run_last, second[:5])
        digests = LocalCluster.read_digests(str(run / "digest-{node}.json"), ["127.0.0.1", "127.0.0.2"])
        assert LocalCluster.final_state_problems(digests, ["127.0.0.1", "127.0.0.2"], steps, 8) == []
    finally:
        _end_job(job, seen, out)


# ----------------------------------------------------------------------------- Kubernetes

K8S = ROOT / "examples" / "launch" / "k8s"
API = {"Secret": "v1", "PersistentVolumeClaim": "v1", "Service": "v1", "Deployment": "apps/v1", "Job": "batch/v1"}


def _manifests() -> dict[tuple[str, str], dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra) parses the manifests")
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            for key in ("apiVersion", "kind", "metadata"):
                assert key in doc, f"{path.name}: a document without {key}"
            kind, name = doc["kind"], doc["metadata"].get("name")
            assert name, f"{path.name}: a {kind} without metadata.name"
            assert API.get(kind) == doc["apiVersion"], f"{path.name}: {kind} {name} has apiVersion {doc['apiVersion']}"
            assert (kind, name) not in out, f"{kind} {name} defined twice"
            out[(kind, name)] = doc
    return out


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _lazarus_args(container: dict[str, Any]) -> tuple[Any, list[str]]:
    """The container's ``lazarus`` command line parsed with the real CLI's parser
    (``$(VAR)`` references replaced by samples; each must be a variable of the container)."""
    import re

    from lazarus.cli import build_parser

    env = {e["name"] for e in container.get("env", [])}
    cmd = list(container["command"]) + list(container.get("args", []))
    assert cmd[0] == "lazarus", cmd
    for word in cmd:
        for var in re.findall(r"\$\((\w+)\)", word):
            assert var in env, f"container {container['name']}: $({var}) is not one of its env variables {sorted(env)}"
    sample = {"POD_NAME": "lazarus-agents-0-abcde", "POD_IP": "10.1.2.3"}
    cmd = [re.sub(r"\$\((\w+)\)", lambda m: sample.get(m.group(1), "x"), w) for w in cmd]
    return build_parser(only=cmd[1]).parse_args(cmd[1:]), cmd


def test_k8s_manifests_parse_and_hold_every_part():
    docs = _manifests()
    assert set(docs) == {("Secret", "lazarus-secret"), ("PersistentVolumeClaim", "lazarus-controller-state"),
                         ("Deployment", "lazarus-controller"), ("Service", "lazarus-controller"),
                         ("Job", "lazarus-agents")}
    for (kind, name), doc in docs.items():
        if kind in ("Deployment", "Job"):
            pod = _pod(doc)
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod["containers"]:
                assert c.get("image"), f"{name}: container {c['name']} has no image"
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, f"{name}: mount {m['name']} names no volume of the pod"
            for v in volumes.values():
                if "secret" in v:
                    secret = docs.get(("Secret", v["secret"]["secretName"]))
                    assert secret is not None, f"{name}: volume {v['name']} uses an undefined Secret"
                    assert v["secret"].get("defaultMode") == 0o400, f"{name}: the secret file must be private"
                if "persistentVolumeClaim" in v:
                    assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in docs
            if "selector" in doc["spec"]:
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


def _mount_of(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume mounted where ``path`` lies."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    best = max((m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")),
               key=lambda m: len(m["mountPath"]), default=None)
    assert best is not None, f"{path} is on no volume of container {container['name']}"
    return volumes[best["name"]]


def test_k8s_controller_ports_state_and_secret_agree():
    docs = _manifests()
    dep, svc = docs[("Deployment", "lazarus-controller")], docs[("Service", "lazarus-controller")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = _pod(dep)
    (c,) = pod["containers"]
    args, _ = _lazarus_args(c)
    assert args.command == "controller"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"control": args.port, "store": args.store_port}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    for p in svc["spec"]["ports"]:
        target = ports[p["targetPort"]] if isinstance(p["targetPort"], str) else p["targetPort"]
        assert p["port"] == target == {"control": args.port, "store": args.store_port}[p["name"]]
    assert args.host == "0.0.0.0" and args.advertise_host == svc["metadata"]["name"]
    # its state on the claim; the secret a key of the Secret
    for path in (args.state_dir, args.events):
        assert "persistentVolumeClaim" in _mount_of(pod, c, path), f"{path} is not on the claim"
    vol = _mount_of(pod, c, args.secret_file)
    secret = docs[("Secret", vol["secret"]["secretName"])]
    key = Path(args.secret_file).name
    assert key in {**secret.get("data", {}), **secret.get("stringData", {})}


def test_k8s_agents_reach_the_controller_and_leave_within_the_grace():
    docs = _manifests()
    job, svc = docs[("Job", "lazarus-agents")], docs[("Service", "lazarus-controller")]
    ctl_args, _ = _lazarus_args(_pod(docs[("Deployment", "lazarus-controller")])["containers"][0])
    spec, pod = job["spec"], _pod(job)
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == ctl_args.expected_nodes
    assert pod["restartPolicy"] == "Never"   # podFailurePolicy requires it
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
               for r in spec["podFailurePolicy"]["rules"])
    (c,) = pod["containers"]
    args, cmd = _lazarus_args(c)
    assert args.command == "agent"
    host, _, port = args.controller.rpartition(":")
    assert host == svc["metadata"]["name"]
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "control") == ctl_args.port
    env = {e["name"]: e for e in c["env"]}
    assert "$(POD_IP)" in c["command"] and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args.advertise_host == "10.1.2.3" and args.node_id == "lazarus-agents-0-abcde"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == args.nproc_per_node
    grace = pod["terminationGracePeriodSeconds"]
    need = (args.leave_timeout + args.stop_timeout).total_seconds()
    assert grace >= need + 5, f"terminationGracePeriodSeconds {grace} < --leave-timeout + --stop-timeout ({need} s) + 5"
    assert _mount_of(pod, c, args.snapshot_dir + "/x")["emptyDir"]["medium"] == "Memory"
    vol = _mount_of(pod, c, args.secret_file)
    assert ("Secret", vol["secret"]["secretName"]) in docs
    # the training command after -- parses with the example's own parser
    worker = list(args.worker_command)
    worker = worker[1:] if worker[:1] == ["--"] else worker
    assert worker[:3] == ["python", "-m", "examples.train_elastic"], worker
    from examples.train_elastic import build_parser as worker_parser

    wargs = worker_parser().parse_args(worker[3:])
    assert wargs.storage.startswith("s3://") and wargs.device == "auto"


def test_k8s_placeholder_secret_is_refused_by_the_real_controller(tmp_path, capsys):
    """Applied unchanged, the Secret's placeholder stops the controller with a clear error."""
    from lazarus.cli import main

    secret = _manifests()[("Secret", "lazarus-secret")]["stringData"]["secret"]
    path = tmp_path / "secret"
    path.write_text(secret)
    assert main(["controller", "--secret-file", str(path), "--port", "0", "--store-port", "0"]) == 2
    assert f"the secret must be at least 16 bytes, got {len(secret)}" in capsys.readouterr().err
