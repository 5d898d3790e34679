"""What the three arms of ``benchmarks/peers`` share: the model, the seeded data, the
metrics lines every worker writes, and the analysis of a run (time lost per fault, steps
redone or discarded, throughput before and after, goodput).

Every arm trains the same byte-level MoE GPT (:mod:`examples.moe_gpt`) on the same
global batch per step (``ByteCorpus.batch(step, rank, world, ...)``: the batch of a step
depends only on the seed and the step; each rank takes its ``rank::world`` slice), so a
step is the same work whichever system runs it and however many nodes share it.

A metrics line is JSON: ``{"kind": "step", "t": commit time, "step": index, "world": n,
"node": who}`` for a committed step (the optimizer applied it), ``"discarded"`` for a step
computed and thrown away (torchft's ``should_commit()`` False), ``"start"`` when a worker
process starts and ``"ready"`` when it has built its model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

__all__ = ["ModelSpec", "Fault", "MetricsWriter", "read_jsonl", "analyse", "young_daly_interval"]


@dataclass(frozen=True)
class ModelSpec:
    """The model and data every arm trains (the MoE GPT of ``make demo`` by default)."""

    layers: int = 4
    d_model: int = 64
    d_hidden: int = 128
    experts: int = 8
    top_k: int = 1
    batch_size: int = 16     # global: sequences per step, split over the live ranks
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "d_hidden", "experts", "top_k", "batch_size", "seq_len", "corpus_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelSpec.{name} must be an integer >= 1, got {v!r}")
        if not self.top_k <= self.experts:
            raise ValueError(f"ModelSpec.top_k must be in [1, experts={self.experts}], got {self.top_k}")
        if not self.lr > 0:
            raise ValueError(f"ModelSpec.lr must be > 0, got {self.lr!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def worker_args(self) -> list[str]:
        """The flags of ``examples.train_elastic`` (and of our workers) for this spec."""
        return ["--layers", str(self.layers), "--d-model", str(self.d_model), "--d-hidden", str(self.d_hidden),
                "--experts", str(self.experts), "--top-k", str(self.top_k), "--batch-size", str(self.batch_size),
                "--seq-len", str(self.seq_len), "--lr", str(self.lr), "--seed", str(self.seed),
                "--corpus-bytes", str(self.corpus_bytes)]

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        d = ModelSpec()
        for f, v in asdict(d).items():
            p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelSpec":
        return cls(**{f: getattr(args, f) for f in asdict(cls())})

    def build(self) -> tuple[Any, Any, Any]:
        """``(model, optimizer, corpus)``: the full model on this process (every expert),
        AdamW as the Lazarus example builds it, the seeded byte corpus."""
        from examples.corpus import ByteCorpus
        from examples.moe_gpt import GPTConfig, MoEGPT, make_optimizer, single_process_placement

        gpt = GPTConfig(d_model=self.d_model, n_layers=self.layers, num_experts=self.experts, top_k=self.top_k,
                        d_hidden=self.d_hidden, seq_len=self.seq_len, tie_head=False, seed=self.seed)
        model = MoEGPT(gpt, single_process_placement(self.experts), group=_SoloGroup.get())
        return model, make_optimizer(model, lr=self.lr), ByteCorpus(self.corpus_bytes)


class _SoloGroup:
    """A one-rank process group for the MoE layers of a full replica inside a data-parallel
    job (the default group spans every replica; the experts must not)."""

    _group: Any = None

    @classmethod
    def get(cls) -> Any:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if cls._group is None:
            cls._group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return cls._group


@dataclass(frozen=True)
class Fault:
    """One injected event: ``kind`` is ``kill`` (SIGKILL), ``join`` (a replacement node
    starts) or ``term`` (SIGTERM, a spot notice); ``t`` is when it was injected."""

    kind: str
    node: str
    t: float
    step: int

    def __post_init__(self) -> None:
        if self.kind not in ("kill", "join", "term"):
            raise ValueError(f"Fault.kind must be one of kill, join, term; got {self.kind!r}")


class MetricsWriter:
    """Appends metrics lines (one ``write`` + flush each, so a reader never sees half of
    one unless the writer is killed mid-line; readers skip such a line)."""

    def __init__(self, path: str | os.PathLike, node: str) -> None:
        self.node = node
        self._f = open(path, "a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        self._f.write(json.dumps({"kind": kind, "t": time.time(), "node": self.node, **fields}) + "\n")
        self._f.flush()


def read_jsonl(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            continue
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def young_daly_interval(save_s: float, step_s: float, mtbf_s: float) -> int:
    """Steps between checkpoints by Young/Daly: ``sqrt(2 * save cost * MTBF)`` seconds,
    as steps (at least 1)."""
    for name, v in (("save_s", save_s), ("step_s", step_s), ("mtbf_s", mtbf_s)):
        if not v > 0:
            raise ValueError(f"young_daly_interval: {name} must be > 0, got {v!r}")
    return max(1, round((2.0 * save_s * mtbf_s) ** 0.5 / step_s))


def _commits(records: list[dict[str, Any]]) -> list[tuple[float, int, int, int]]:
    """``(t, step, world, run)`` of every commit, the earliest of each (step, incarnation of
    the run) kept: several replicas commit the same step at about the same time."""
    seen: dict[tuple[int, int], tuple[float, int, int, int]] = {}
    for r in records:
        if r.get("kind") != "step":
            continue
        key = (int(r["step"]), int(r.get("run", 0)))
        c = (float(r["t"]), int(r["step"]), int(r.get("world", 0)), int(r.get("run", 0)))
        if key not in seen or c[0] < seen[key][0]:
            seen[key] = c
    return sorted(seen.values())


def _rate(commits: list[tuple[float, int, int, int]], lo: float, hi: float) -> float | None:
    """Committed steps per second between ``lo`` and ``hi`` (None with under 3 commits)."""
    inside = [c for c in commits if lo <= c[0] <= hi]
    if len(inside) < 3 or inside[-1][0] <= inside[0][0]:
        return None
    return (len(inside) - 1) / (inside[-1][0] - inside[0][0])


def analyse(system: str, records: list[dict[str, Any]], faults: list[Fault], tokens_per_step: int,
            window: int = 10) -> dict[str, Any]:
    """The figures of one run.

    For each fault: ``time_lost_s`` = from the fault to the first commit of a step never
    committed before it (new progress: a restart that redoes steps is not back until it has
    redone them); ``steps_lost`` = steps committed before the fault and committed again
    after it (redone), plus steps computed and discarded (torchft) between the fault and
    that commit; throughput (steps/s) over ``window`` steps before the fault and after that
    commit. ``goodput`` = distinct committed steps x tokens per step / seconds from the first
    commit to the last.
    """
    commits = _commits(records)
    if not commits:
        raise RuntimeError(f"{system}: no committed step recorded")
    step_times = [b[0] - a[0] for a, b in zip(commits, commits[1:]) if b[1] == a[1] + 1]
    typical = statistics.median(step_times) if step_times else float("nan")
    rows = []
    for f in faults:
        before = [c for c in commits if c[0] < f.t]
        after = [c for c in commits if c[0] >= f.t]
        run = before[-1][3] if before else 0
        if any(c[3] > run for c in after):
            # The job restarted: what its old incarnation still committed after the fault
            # (a step in flight when the node died, its gradients already exchanged) is
            # redone too, and is no recovery.
            before = [c for c in commits if c[0] < f.t or c[3] == run]
            after = [c for c in after if c[3] != run]
        high = max((c[1] for c in before), default=-1)
        nxt = next((c for c in after if c[1] > high), None)
        t_back = nxt[0] if nxt else None
        redone = len({c[1] for c in after if c[1] <= high and (t_back is None or c[0] <= t_back)})
        discarded = len({int(r["step"]) for r in records if r.get("kind") == "discarded" and r["t"] >= f.t
                         and (t_back is None or r["t"] <= t_back)})
        pre = [c for c in before][-window:]
        rate_before = _rate(pre, pre[0][0], pre[-1][0]) if len(pre) >= 3 else None
        post = [c for c in after if t_back is not None and c[0] >= t_back][:window]
        rate_after = _rate(post, post[0][0], post[-1][0]) if len(post) >= 3 else None
        rows.append({"system": system, "fault": f"{f.kind} {f.node}", "kind": f.kind, "step": f.step,
                     "time_lost_s": None if t_back is None else round(t_back - f.t, 3),
                     "steps_lost": redone + discarded, "redone": redone, "discarded": discarded,
                     "tokens_lost": (redone + discarded) * tokens_per_step,
                     "steps_per_s_before": rate_before, "steps_per_s_after": rate_after,
                     "world_after": nxt[2] if nxt else None})
    distinct = len({c[1] for c in commits})
    span = commits[-1][0] - commits[0][0]
    return {"system": system, "rows": rows, "goodput": distinct * tokens_per_step / span if span > 0 else None,
            "steps": max(c[1] for c in commits) + 1, "seconds": span, "step_s": typical,
            "commits": [list(c) for c in commits]}
