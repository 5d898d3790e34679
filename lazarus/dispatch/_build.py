"""Build and load the C++ (and, where CUDA is usable, CUDA) dispatcher ops on first use.

The extension is compiled with ``torch.utils.cpp_extension.load`` into a cache directory
keyed by the torch version, the source directory and a hash of the sources, and for the
CUDA build by the CUDA version torch was built with and the GPU's compute capability
(``sm_90``, or ``TORCH_CUDA_ARCH_LIST`` when set): a later process (or a spawned rank) on
the same kind of GPU only loads the shared object, a build made for another GPU is never
picked up, and editing ``csrc/`` rebuilds. Nothing is ever downloaded.

A loaded build is probed once (a tiny dispatch checked against the torch
implementation). Any failure (no compiler, no ninja, a compile error, a build that loads
but cannot run on this device, or an op that raises at its first real use) logs ONE
warning and leaves the pure-torch implementation in charge, which gives the same numbers.

Environment:
    LAZARUS_DISPATCH_BACKEND  ``auto`` (default), ``cpp`` (C++ op; warn and fall back if it
                              cannot be built) or ``torch`` (never build).
    LAZARUS_EXT_DIR           cache root (default ``~/.cache/lazarus/ext``).
    LAZARUS_CSRC              directory holding the sources (default ``<repo>/csrc``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ._log import get_logger

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: torch's own lock only
    fcntl = None

log = get_logger("lazarus.dispatch")

BACKENDS = ("auto", "cpp", "torch")
CPU_SOURCES = ("dispatch.cpp",)
CUDA_SOURCES = ("dispatch_cuda.cpp", "dispatch_kernels.cu")
HEADERS = ("dispatch_core.h", "dispatch_msg.h", "dispatch_kernels.h")   # CPU needs the first two


@dataclass
class OpsState:
    """What this process ended up with: ``cpp`` ops loaded, CUDA kernels registered."""

    cpp: bool = False
    cuda: bool = False
    reason: str = ""


_lock = threading.Lock()
_state: OpsState | None = None


def requested_backend() -> str:
    value = os.environ.get("LAZARUS_DISPATCH_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"LAZARUS_DISPATCH_BACKEND must be one of {list(BACKENDS)}, got {value!r}")
    return value


def csrc_dir() -> Path:
    env = os.environ.get("LAZARUS_CSRC")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "csrc"


def cache_root() -> Path:
    env = os.environ.get("LAZARUS_EXT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lazarus" / "ext"


def _cuda_usable() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return bool(torch.cuda.is_available() and torch.version.cuda and CUDA_HOME)


def cuda_build_key(capability: tuple[int, int] | None = None, cuda_version: str | None = None,
                   arch_list: str | None = None) -> str:
    """What a CUDA build is only valid for: ``sm<major><minor>-cu<version>`` of the
    current GPU and torch's CUDA (``TORCH_CUDA_ARCH_LIST``, which the build honours,
    replaces the capability when set), e.g. ``sm90-cu12.8``."""
    if arch_list is None:
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if arch_list:
        arch = "arch" + "".join(c if c.isalnum() else "_" for c in arch_list.replace(".", ""))
    else:
        if capability is None:
            capability = torch.cuda.get_device_capability(torch.cuda.current_device())
        arch = f"sm{capability[0]}{capability[1]}"
    cuda_version = cuda_version if cuda_version is not None else (torch.version.cuda or "none")
    return f"{arch}-cu{cuda_version}"


def build_name(src: Path, with_cuda: bool, cuda_key: str | None = None) -> str:
    """The cache directory (and library) name of a build: ``lazarus_dispatch_cpu_<hash>``
    or ``lazarus_dispatch_cuda_<sm..>_<hash>``; the hash covers everything the build
    depends on (:func:`_tag`)."""
    if not with_cuda:
        return f"lazarus_dispatch_cpu_{_tag(src, False)}"
    key = cuda_key if cuda_key is not None else cuda_build_key()
    arch = key.split("-")[0]
    return f"lazarus_dispatch_cuda_{arch}_{_tag(src, True, key)}"


def _tag(src: Path, with_cuda: bool, cuda_key: str | None = None) -> str:
    h = hashlib.sha1()
    h.update(torch.__version__.encode())
    h.update(b"cuda" if with_cuda else b"cpu")
    if with_cuda:
        h.update((cuda_key if cuda_key is not None else cuda_build_key()).encode())
    # The build file names the sources by path: checkouts sharing one cache (worktrees)
    # would rewrite it in turn, rebuilding while every other process waits on torch's lock.
    h.update(str(src.resolve()).encode())
    for name in CPU_SOURCES + HEADERS + (CUDA_SOURCES if with_cuda else ()):
        path = src / name
        if path.exists():
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _compile(src: Path, with_cuda: bool) -> None:
    from torch.utils import cpp_extension

    name = build_name(src, with_cuda)
    build_dir = cache_root() / name
    built = build_dir / f"{name}.so"
    if built.exists():
        # The name hashes the sources: an existing library is current. Load it without
        # cpp_extension.load, whose build lock (a file) stays behind when a process is
        # killed while holding it, and then makes every later process wait forever.
        try:
            torch.ops.load_library(str(built))
            return
        except OSError as exc:  # a truncated build: rebuild below
            log.warning("lazarus dispatch: could not load %s (%s); rebuilding", built, exc)
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(src / s) for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())]
    # torch serialises builders with a lock FILE (O_CREAT | O_EXCL, no timeout): a process
    # killed while inside load() -- a node SIGKILLed during its first step -- leaves it
    # behind and every later load() in this build directory waits forever. Loaders take an
    # flock first (the kernel drops it when its holder dies); whoever holds it is the only
    # process inside load(), so a lock file found then is stale and is removed.
    with open(build_dir / ".lazarus.flock", "a+") as guard:
        if fcntl is not None:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if fcntl is not None and stale.exists():
            log.warning("lazarus dispatch: removing a stale build lock %s (its process died mid-build)", stale)
            stale.unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"] if with_cuda else None,
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=False,
        )


def _missing_tools(src: Path, with_cuda: bool) -> str:
    from torch.utils import cpp_extension

    needed = CPU_SOURCES + HEADERS[:2] + (CUDA_SOURCES + HEADERS[2:] if with_cuda else ())
    absent = [n for n in needed if not (src / n).exists()]
    if absent:
        return f"sources {absent} not found in {src} (set LAZARUS_CSRC)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return ""


def load_ops() -> OpsState:
    """Load (building on first use) the compiled ops once per process; never raises."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is not None:
            return _state
        state = OpsState()
        if requested_backend() == "torch":
            state.reason = "LAZARUS_DISPATCH_BACKEND=torch"
            _state = state
            return state
        src = csrc_dir()
        attempts = [True, False] if _cuda_usable() else [False]
        for with_cuda in attempts:
            problem = _missing_tools(src, with_cuda)
            if problem:
                state.reason = problem
                continue
            try:
                _compile(src, with_cuda)
            except Exception as exc:  # a broken toolchain must never stop training
                state.reason = f"build failed: {type(exc).__name__}: {str(exc).strip()[-400:]}"
                if with_cuda:
                    log.warning("CUDA dispatcher build failed, trying the CPU-only op: %s", state.reason)
                continue
            state.cpp = hasattr(torch.ops.lazarus, "dispatch_rank")
            state.reason = "" if state.cpp else "ops not registered after load"
            if state.cpp:
                problem = _probe("cpu")
                if problem:
                    state.cpp, state.reason = False, f"the CPU op loaded but does not run: {problem}"
            if state.cpp and with_cuda:
                problem = _probe("cuda")
                if problem:
                    # One warning: the CPU op stays, CUDA tensors dispatch on the host.
                    state.reason = f"the CUDA build loaded but does not run on this GPU: {problem}"
                    log.warning("lazarus dispatch: %s; dispatching CUDA tensors with the torch implementation on "
                                "the host (same results)", state.reason)
                else:
                    state.cuda = True
            break
        if not state.cpp:
            log.warning("lazarus dispatch: using the pure-torch fallback (same results, slower): %s",
                        state.reason)
        _state = state
        return state


def _probe(device: str) -> str:
    """Run the loaded ops once on a tiny problem on ``device`` and compare with the torch
    implementation; ``""`` when they agree, else what went wrong."""
    from . import _torch_impl

    try:
        R = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.int64)
        T = torch.tensor([[5, 0, 2], [1, 3, 0], [0, 4, 4]], dtype=torch.int64)
        want_send, want_recv = _torch_impl.dispatch_rank(R, T, 1)
        experts = torch.repeat_interleave(torch.arange(3), T[:, 1])
        want_perm = _torch_impl.dispatch_permutation(experts, want_send)
        send, recv = torch.ops.lazarus.dispatch_rank(R.to(device), T.to(device), 1)
        perm = torch.ops.lazarus.dispatch_permutation(experts.to(device), send)
        if device == "cuda":
            torch.cuda.synchronize()
        if not (torch.equal(send.cpu(), want_send) and torch.equal(recv.cpu(), want_recv)
                and torch.equal(perm.cpu(), want_perm)):
            return "its counts differ from the torch implementation's"
    except Exception as exc:  # noqa: BLE001 - e.g. "no kernel image is available for execution"
        return f"{type(exc).__name__}: {str(exc).strip()[-300:]}"
    return ""


_disabled_warned: set[str] = set()


def disable(kind: str, reason: str) -> OpsState:
    """A compiled op raised at use (not at the probe): stop using the ``kind`` (``"cuda"``
    or ``"cpu"``) ops for the rest of the process, with one warning. A failing CPU op
    disables the CUDA ops too (one library)."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"kind must be 'cpu' or 'cuda', got {kind!r}")
    state = load_ops()
    with _lock:
        state.cuda = False
        if kind == "cpu":
            state.cpp = False
        state.reason = f"the compiled {kind} op failed at use: {reason[-300:]}"
        if kind not in _disabled_warned:
            _disabled_warned.add(kind)
            log.warning("lazarus dispatch: %s; using the torch implementation from now on (same results)",
                        state.reason)
    return state
