"""Measurement code shared by the checkpoint-overhead scenarios (``moc_overhead``, ``moc_hf``).

A *trainer* is anything with ``model``, ``opt``, ``step() -> int`` (one forward + backward
+ ``optimizer.step()``, returning the step number) and an ``on_step`` attribute (a
callable run after each step, or None). A :class:`Method` takes checkpoints of it;
:func:`measure` runs the ABBA windows and returns one table row.

Under ``torch.distributed`` with several ranks (an FSDP2 job) every rank runs the same
windows in the same order (the collectives of training and of the checkpoint methods line
up); files are counted and removed by rank 0 only.
"""

from __future__ import annotations

import datetime as _dt
import gc
import math
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from moc import CheckpointManager, MoCConfig

__all__ = [
    "MB", "GB", "Trainer", "Method", "TorchSave", "DCPAsync", "TorchSnapshot", "MoC",
    "dir_bytes", "evict", "io_read_bytes", "machine", "loadavg", "fmt_ms", "verdict",
    "run_window", "measure",
]

MB = 1e6
GB = 1e9


class Trainer(Protocol):
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    on_step: Callable[[int], None] | None

    def step(self) -> int: ...


# --------------------------------------------------------------------------------------
# helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    """A barrier when several ranks run the windows; nothing in a 1-process job."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def dir_bytes(path: str | Path) -> int:
    total = 0
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def evict(path: str | Path) -> None:
    """Drop ``path``'s (clean) pages from the page cache; no root needed."""
    files = [Path(path)] if Path(path).is_file() else [Path(r) / f for r, _, fs in os.walk(path) for f in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def io_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = "?"
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            ram = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torchsnapshot
        ts = getattr(torchsnapshot, "__version__", "installed")
    except Exception as exc:  # noqa: BLE001
        ts = f"not available ({type(exc).__name__})"
    return {"cpu": cpu, "cores": str(os.cpu_count()), "ram": ram, "python": platform.python_version(),
            "torch": torch.__version__, "torchsnapshot": ts, "date": _dt.date.today().isoformat(),
            "threads": str(torch.get_num_threads())}


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def fmt_ms(x: float) -> str:
    return f"{x*1e3:,.0f}" if abs(x) >= 0.0995 else f"{x*1e3:,.1f}"


def verdict(value: float, lim: float, se: float) -> str:
    """"yes"/"no" for ``value <= lim``, flagged when the two are within 2 standard errors."""
    v = "yes" if value <= lim else "no"
    return v + (" (within noise)" if math.isfinite(se) and abs(value - lim) < 2 * se else "")


def stall_target_rows(save: dict | None, k1: list[dict], best_async: dict | None) -> list[str]:
    """Markdown rows of the two single-process stall targets (K=1 <= 2% of ``torch.save``
    and <= half of the best async baseline), one per MoC K=1 row in ``k1``."""
    rows: list[str] = []
    if save and k1:
        lim = 0.02 * save["stall"]
        for r in k1:
            rows.append(f"| {r['name']} stall <= 2% of torch.save ({fmt_ms(lim)} ms) | {fmt_ms(r['stall'])} ms = "
                        f"{100*r['stall']/save['stall']:.1f}% (window mean {fmt_ms(r['stall_mean'])} +- "
                        f"{fmt_ms(r['stall_se'])} ms); loop blocked {fmt_ms(r['blocked'])} ms = "
                        f"{100*r['blocked']/save['blocked']:.2f}% of torch.save's blocking call "
                        f"({fmt_ms(save['blocked'])} ms) | {verdict(r['stall'], lim, r['stall_se'])} |")
    if best_async and k1:
        lim = 0.5 * best_async["stall"]
        for r in k1:
            rows.append(f"| {r['name']} stall <= half of the best async baseline ({best_async['name']}: "
                        f"{fmt_ms(best_async['stall'])} ms) | {fmt_ms(r['stall'])} ms | "
                        f"{verdict(r['stall'], lim, r['stall_se'])} |")
    return rows


def report_footer(errors: list[str], plot: str) -> list[str]:
    """The last lines of a results.md: this run's notes (when any), then where the plot is."""
    rows: list[str] = []
    if errors:
        rows += ["## Notes from this run", ""] + [f"- {e}" for e in errors] + [""]
    return rows + [f"Plot: `{plot}`.", ""]


# --------------------------------------------------------------------------------------
# checkpoint methods: checkpoint(step) -> seconds the call blocked; drain() waits for the
# background work; after() is untimed housekeeping between windows.
class Method:
    name = ""
    note = ""
    syncs_ranks = False   # the checkpoint call itself waits for every rank (a collective)

    def __init__(self, tr: Trainer, root: Path) -> None:
        self.tr, self.root = tr, root
        self.sizes: list[int] = []
        self.extra_blocked: list[float] = []  # per checkpoint: waits inside later steps
        self.entered: list[float] = []        # per measured checkpoint: time.monotonic() at the call

    def setup(self) -> None: ...
    def checkpoint(self, step: int) -> None: ...
    def drain(self) -> None: ...
    def after(self) -> None: ...
    def teardown(self) -> None: ...

    def rotate(self) -> None:
        """Record the size of the checkpoint directory just written and delete the one
        before it (``cur``/``prev`` are set by methods that write one directory each)."""
        os.sync()  # written-back dirty pages must not spill into the next (baseline) window
        if _rank() == 0:
            self.sizes.append(dir_bytes(self.cur))
            if self.prev is not None:
                shutil.rmtree(self.prev, ignore_errors=True)
        self.prev = self.cur


class TorchSave(Method):
    name = "torch.save (blocking)"
    note = "model + optimizer state_dict, one file, no fsync"

    def setup(self) -> None:
        self.prev: Path | None = None
        self.cur: Path | None = None

    def checkpoint(self, step: int) -> None:
        self.cur = self.root / f"ts-{step}.pt"
        torch.save({"model": self.tr.model.state_dict(), "optim": self.tr.opt.state_dict()}, self.cur)

    def after(self) -> None:
        os.sync()
        self.sizes.append(dir_bytes(self.cur))
        if self.prev is not None:
            self.prev.unlink(missing_ok=True)
        self.prev = self.cur

    def teardown(self) -> None:
        pass  # the last file is kept for the torch.load restore reference


def _dcp_process_checkpointer() -> Any:
    """``AsyncCheckpointerType.PROCESS`` where this torch has it, else None."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return None
    return getattr(AsyncCheckpointerType, "PROCESS", None)


class DCPAsync(Method):
    """``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, optimizer)``:
    on an FSDP2 model that is its native, sharded path (each rank writes its shards).

    ``process_group``: the group DCP's background save coordinates on (default: the
    world). With several ranks, pass a group of its own (``dist.new_group(backend="gloo")``,
    as torchtitan does): the save's collectives run in a background thread and must not
    interleave with training's collectives on the default group."""

    def __init__(self, tr: Trainer, root: Path, cached: bool, process_group: Any = None, best: bool = False) -> None:
        super().__init__(tr, root)
        self.cached = cached or best
        self.best = best and _dcp_process_checkpointer() is not None
        self.process_group = process_group
        if self.best:
            self.name = "DCP async_save (DefaultStager, every StagingOptions on, process)"
            self.note = ("DCP at its best: DefaultStager(StagingOptions(pinned, shared memory, async staging, "
                         "non-blocking copy)) (pinned memory and the non-blocking copy need an accelerator: off on "
                         "CPU), AsyncCheckpointerType.PROCESS (the save runs in a checkpoint process of its own); "
                         "optimizer pre-hook waits for the staging")
        else:
            self.name = "DCP async_save" + (" (DefaultStager)" if cached else "")
            self.note = ("DefaultStager: cached staging buffers, staging in a background thread, optimizer pre-hook "
                         "waits for it (pinned/shared memory and non-blocking copy off: CPU only)" if cached
                         else "FileSystemWriter defaults: stages into new CPU memory in the call")

    def setup(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter  # noqa: F401
        self.fut = None
        self.staging = None
        self.prev: Path | None = None
        self.cur: Path | None = None
        self.writer = None
        self.stager = None
        self.hook = None
        self.waited = 0.0
        if self.cached:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            accel = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=self.best and accel,
                                                       use_shared_memory=self.best, use_async_staging=True,
                                                       use_non_blocking_copy=self.best and accel))

            def pre_hook(*_: Any) -> None:  # the next optimizer step must not race the staging copy
                if self.staging is not None:
                    t0 = time.perf_counter()
                    self.staging.result()
                    self.waited += time.perf_counter() - t0
                    self.staging = None
            self.hook = self.tr.opt.register_step_pre_hook(pre_hook)

    def checkpoint(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_state_dict
        self.cur = self.root / f"dcp{int(self.cached)}{int(self.best)}-{step}"
        self.waited = 0.0
        msd, osd = get_state_dict(self.tr.model, self.tr.opt)
        if self.writer is None:
            self.writer = FileSystemWriter(str(self.cur))
        kind = {"async_checkpointer_type": _dcp_process_checkpointer()} if self.best else {}
        res = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(self.cur), storage_writer=self.writer,
                             process_group=dist.group.WORLD if self.process_group is None else self.process_group,
                             async_stager=self.stager, **kind)
        self.staging = getattr(res, "staging_completion", None)
        self.fut = getattr(res, "upload_completion", res)

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        if self.fut is not None:
            self.fut.result()
            self.fut = None
        self.extra_blocked.append(self.waited)

    def after(self) -> None:
        self.rotate()

    def teardown(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        if self.stager is not None:
            self.stager.close()
        _barrier()  # every rank's last checkpoint is complete before rank 0 removes it
        if self.prev is not None and _rank() == 0:
            shutil.rmtree(self.prev, ignore_errors=True)
        self.writer = self.stager = None


class TorchSnapshot(Method):
    name = "torchsnapshot async_take"
    note = "app_state={model, optimizer}"

    def setup(self) -> None:
        import torchsnapshot  # noqa: F401
        self.pending = None
        self.prev: Path | None = None
        self.cur: Path | None = None

    def checkpoint(self, step: int) -> None:
        from torchsnapshot import Snapshot
        self.cur = self.root / f"tsnap-{step}"
        self.pending = Snapshot.async_take(str(self.cur), app_state={"model": self.tr.model, "optim": self.tr.opt})

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def after(self) -> None:
        self.rotate()

    def teardown(self) -> None:
        if self.prev is not None:
            shutil.rmtree(self.prev, ignore_errors=True)


class MoC(Method):
    """``moc.CheckpointManager``. Routing counts come from the model's ``routing_counts()``
    when it has one (``examples.toy_moe.ToyMoE``), else from the manager's own router hooks
    (transformers models). ``cfg_extra`` goes to :class:`moc.MoCConfig` (``top_k``...)."""

    syncs_ranks = True    # step() holds one all-reduce over the ranks

    def __init__(self, tr: Trainer, root: Path, shm: Path, label: str, k_snapshot: int | None,
                 k_persist: int | None, persist_every: int, **cfg_extra: Any) -> None:
        super().__init__(tr, root)
        self.shm = shm
        self.k_snapshot, self.k_persist, self.persist_every = k_snapshot, k_persist, persist_every
        self.cfg_extra = cfg_extra
        self.name = f"MoC {label}"
        ks = "all" if k_snapshot is None else k_snapshot
        kp = "all" if k_persist is None else k_persist
        self.note = f"k_snapshot={ks}, k_persist={kp}, persist_every={persist_every}"
        self.tag = label.replace(" ", "_").replace(",", "").replace("=", "").replace("/", "-")
        self.persisted: dict[int, int] = {}

    def setup(self) -> None:
        self.storage = self.root / f"moc-{self.tag}"
        cfg = MoCConfig(storage=str(self.storage), interval=1, k_snapshot=self.k_snapshot, k_persist=self.k_persist,
                        persist_every=self.persist_every, snapshot_dir=str(self.shm / self.tag), keep_last=3,
                        dynamic_k=False, **self.cfg_extra)
        self.ckpt = CheckpointManager(cfg, model=self.tr.model, optimizer=self.tr.opt)
        counts = getattr(self.tr.model, "routing_counts", None)
        if callable(counts):
            def record(step: int) -> None:
                for layer, c in counts().items():
                    self.ckpt.record_routing(layer, c)
            self.tr.on_step = record
        self.last = None
        self.stall_before = 0.0
        self.bytes_first: int | None = None
        # Warm-up (not measured): the first, full checkpoint, then enough partial ones that
        # all three snapshot buffers exist and their pages are touched; it also lines up
        # persist_every so the measured checkpoints hold whole persist cycles.
        n_warm = max(3, self.persist_every)
        for i in range(n_warm):
            step = self.tr.step()
            self.checkpoint(step)
            self.drain()
            self.after()
            if i == 0:
                self.bytes_first = self.persisted.get(step)
        self.persisted.clear()
        self.sizes.clear()

    def checkpoint(self, step: int) -> None:
        self.stall_before = self.ckpt.status()["stall_seconds_total"]
        self.ckpt.step(step)
        self.last = step

    def drain(self) -> None:
        # Public API only: the snapshot of `last` is published and no persist is running.
        while True:
            st = self.ckpt.status()
            if st["last_snapshot_step"] == self.last and not st["persist_in_flight"]:
                break
            time.sleep(0.002)
        self.extra_blocked.append(self.ckpt.status()["stall_seconds_total"] - self.stall_before)

    def after(self) -> None:
        os.sync()
        st = self.ckpt.status()
        if st["last_error"]:
            raise RuntimeError(f"{self.name}: {st['last_error']}")
        if st["last_persisted_step"] == self.last:
            n = dir_bytes(self.storage / "data" / f"{self.last:012d}")
            self.persisted[self.last] = n
            self.sizes.append(n)
        self.buffer_bytes = st["buffer_bytes"]

    def teardown(self) -> None:
        self.tr.on_step = None
        self.ckpt.close()
        _barrier()
        if _rank() == 0:
            shutil.rmtree(self.storage, ignore_errors=True)


# --------------------------------------------------------------------------------------
def run_window(tr: Trainer, steps: int, method: Method | None) -> tuple[list[float], float, float, float]:
    """(per-step seconds, seconds the checkpoint call blocked, seconds waiting for completion
    at the end, CPU seconds of the whole process, all threads).

    Step 0's time includes the checkpoint call (taken right after its optimizer step)."""
    call = drain = 0.0
    times = []
    cpu0 = time.process_time()
    for i in range(steps):
        t0 = time.perf_counter()
        s = tr.step()
        if method is not None and i == 0:
            method.entered.append(time.monotonic())   # one clock for every process of the host
            c0 = time.perf_counter()
            method.checkpoint(s)
            call = time.perf_counter() - c0
        times.append(time.perf_counter() - t0)
    if method is not None:
        d0 = time.perf_counter()
        method.drain()
        drain = time.perf_counter() - d0
    return times, call, drain, time.process_time() - cpu0


def measure(tr: Trainer, m: Method, window: int, reps: int, log: Callable[[str], None],
            before_teardown: Callable[[Method], None] | None = None) -> dict[str, Any]:
    """One table row for ``m``: ABBA pairs of windows of ``window`` steps, ``reps`` pairs.
    ``before_teardown(m)`` runs after the measured windows (untimed extras, e.g. profiling)."""
    t_setup = time.perf_counter()
    m.setup()
    # one unmeasured checkpoint window warms allocators and page cache paths
    if not isinstance(m, MoC):
        run_window(tr, 2, m)
        m.after()
        m.extra_blocked.clear()
        m.sizes.clear()
    ck, base, calls, drains, diffs, cpu_ck, cpu_base = [], [], [], [], [], [], []
    for r in range(reps):
        # ABBA order (checkpoint window first in even pairs, baseline first in odd ones)
        # cancels drift and any effect of what ran just before a window.
        if r % 2:
            t_base, _, _, c_base = run_window(tr, window, None)
        t_ck, call, drain, c_ck = run_window(tr, window, m)
        m.after()
        gc.collect()
        if not r % 2:
            t_base, _, _, c_base = run_window(tr, window, None)
        cpu_ck.append(c_ck)
        cpu_base.append(c_base)
        ck.append(t_ck)
        base.append(t_base)
        calls.append(call)
        drains.append(drain)
        diffs.append(sum(t_ck) + drain - sum(t_base))
    # Robust estimate: per step position, median over the pairs (a burst of outside load
    # hits a few steps, not the same position in most pairs).
    med = lambda xs: statistics.median(xs)  # noqa: E731
    robust = sum(med([c[i] for c in ck]) - med([b[i] for b in base]) for i in range(window)) + med(drains)
    extra = m.extra_blocked[-reps:] if m.extra_blocked else [0.0] * reps
    out = {
        "name": m.name, "note": m.note, "stall": robust, "stall_mean": statistics.mean(diffs),
        "stall_se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan"),
        "call": statistics.mean(calls), "calls": calls, "entered": m.entered[-reps:], "syncs_ranks": m.syncs_ranks,
        "drain": med(drains), "cpu": med(cpu_ck) - med(cpu_base),
        "blocked": statistics.mean(c + e for c, e in zip(calls, extra)),
        "step": med([x for b in base for x in b]), "size": statistics.median(m.sizes) if m.sizes else 0,
        "diffs": diffs, "spread": max(sum(b) for b in base) / max(1e-9, min(sum(b) for b in base)),
    }
    if isinstance(m, MoC):
        out.update(bytes_first=m.bytes_first, buffer_bytes=m.buffer_bytes, k=m.k_snapshot, kp=m.k_persist,
                   pe=m.persist_every, persisted_sizes=sorted(set(m.sizes)))
    if before_teardown is not None:
        before_teardown(m)
    m.teardown()
    log(f"  {m.name:<32} stall {out['stall']*1e3:7.0f} ms (mean {out['stall_mean']*1e3:6.0f} +-"
        f"{out['stall_se']*1e3:4.0f}), call {out['call']*1e3:6.1f} ms, blocked {out['blocked']*1e3:6.1f} ms, "
        f"drain {out['drain']*1e3:5.0f} ms, cpu {out['cpu']:5.2f} s, {out['size']/MB:7.1f} MB, "
        f"{time.perf_counter() - t_setup:4.0f} s, "
        f"load {loadavg()}")
    return out
