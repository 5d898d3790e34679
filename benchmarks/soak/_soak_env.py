"""What ``make soak`` runs beside the job: the S3 endpoint (moto) behind a fault-injecting
proxy, a small tmpfs for the nodes' snapshot memory with a filler file, CPU-bound load, and
a reader of the workers' log lines."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from storage_backends.testing import StorageProxy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Endpoint:
    """moto's S3 server on 127.0.0.1 with a :class:`StorageProxy` in front of it.

    The job talks to the proxy (:attr:`env`), so storage can be made slow, hung or
    unreachable while moto itself (and its data) stays up; the soak's own checks
    (``moc verify``) talk to moto directly (:attr:`direct_env`)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.direct_url = f"http://127.0.0.1:{self.port}"
        self.proxy = StorageProxy(self.port)
        creds = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak", "AWS_REGION": "us-east-1"}
        self.env = {"AWS_ENDPOINT_URL": self.proxy.url, **creds}
        self.direct_env = {"AWS_ENDPOINT_URL": self.direct_url, **creds}

    def start(self) -> "S3Endpoint":
        self.server.start()
        self.proxy.start()
        return self

    def stop(self) -> None:
        self.proxy.close()
        self.server.stop()

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.direct_url, aws_access_key_id="soak", aws_secret_access_key="soak",
                     region_name="us-east-1").create_bucket(Bucket=name)


class Tmpfs:
    """A real tmpfs of ``size`` bytes mounted at ``path`` (the nodes' snapshot memory, as a
    small ``/dev/shm``), and a filler file that takes all of its free space until
    :meth:`drain`. Mounting needs root (the soak machine and CI run as root)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = Path(path), int(size)
        self.filler = self.path / ".soak-filler"
        self.mounted = False

    def mount(self) -> "Tmpfs":
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount a {self.size}-byte tmpfs at {self.path} for the shm_full fault "
                               f"(needs root; leave shm_full out of --kinds otherwise): {r.stderr.strip()}")
        self.mounted = True
        return self

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self) -> int:
        """Take every free byte (real pages, ``posix_fallocate``); returns how many."""
        fd = os.open(self.filler, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            taken = 0
            chunk = self.free()
            while chunk >= 4096:   # tmpfs rounds to pages: take what is left in smaller pieces
                try:
                    os.posix_fallocate(fd, taken, chunk)
                    taken += chunk
                except OSError:
                    chunk //= 2
                chunk = min(chunk, self.free())
            return taken
        finally:
            os.close(fd)

    def drain(self) -> None:
        try:
            self.filler.unlink()
        except FileNotFoundError:
            pass

    def unmount(self) -> None:
        if self.mounted:
            self.drain()
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


class CpuLoad:
    """``n`` CPU-bound busy processes beside the soak (a GPU node's data loaders)."""

    def __init__(self, n: int) -> None:
        self.n = int(n)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "CpuLoad":
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=10)
        self.procs = []


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def log_lines(job_dir: Path, needle: str) -> list[tuple[float, str, str]]:
    """``(wall time, node, line)`` of the nodes' log lines (``node-*.log``: the agent's
    and its workers' stderr) that contain ``needle``, oldest first."""
    out = []
    for path in sorted(job_dir.glob("node-*.log")):
        node = path.stem[len("node-"):]
        with open(path, errors="replace") as f:
            for line in f:
                if needle not in line:
                    continue
                m = _LOG_TIME.match(line)
                if m is None:
                    continue
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
                out.append((t, node, line.rstrip()))
    return sorted(out)


def wait_until(pred, timeout: float, poll: float = 0.05):
    """``pred()``'s first truthy value within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    return None
