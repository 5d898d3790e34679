"""Discrete-event simulator of MoE training under node failures and joins (``lazarus simulate``).

Three systems run over the same membership events (a controlled failure schedule, a
Bamboo-style preemption/allocation process, or a replayed spot trace):

- ``ds``: checkpoint-restart with classic expert parallelism. It uses a multiple of the
  nodes one full set of experts needs (EP size); any failure of a node in use rolls back
  to the last checkpoint and restarts on what is left.
- ``dsft``: the same layout with experts replicated across the data-parallel groups; it
  reconfigures in place while every EP position survives somewhere (never reusing nodes it
  dropped until a join or restart), and falls back to a checkpoint restart otherwise.
- ``lazarus``: ``allocate_replicas`` + ``place_mro`` per layer from the current loads,
  ``plan_migration`` to count the expert states to move, in-place reconfiguration when
  every expert keeps a replica, periodic rebalancing, and a checkpoint fallback.

Each checkpoints ``full`` (blocking save of everything), ``pec`` (MoC partial experts,
K per layer, asynchronous persist) or ``two-level`` (MoC: all experts snapshotted to CPU
memory, K persisted every few snapshots; survivors restore from memory, the lost nodes'
share from storage). With MoC, Lazarus's fallback reloads only the experts no survivor
holds (no roll back) and the older versions show up as PLT.

Time lands in exactly one of ``compute``, ``checkpoint``, ``restart``,
``reconfiguration``, ``lost`` (compute later rolled back) and ``idle``; the engine asserts
that they sum to the simulated time.

What is measured and what is assumed (each default cites its source in ``_params.py``):

- From this project's benchmarks (benchmarks/README.md): the share of a step that scales
  with expert-load imbalance (0.3, dispatcher benchmark), MoC's per-checkpoint call cost
  (10 ms) and restore rate from the shared-memory snapshot (2.14 GB/s), the checkpoint
  size formula (matched to 1.0000 by the MoC benchmark).
- From the Lazarus paper: model shapes (Table 1), bytes per expert (Table 2), step times
  (section 6.2 step counts), NCCL timeout and regroup times (6.3), state transfer rate
  (Table 2), NFS bandwidth (6.1), checkpoint intervals, f = 2 and the rebalance period
  (6.1), the 2-minute join window (6.4).
- Assumed: process restart (60 s; 180 s at DeepSeek scale), GPU->CPU snapshot bandwidth,
  dispatcher overhead (3%), drift of the routing loads, every DeepSeek-V3 cluster
  bandwidth, and that step time is ``step_s * ((1 - phi) + phi * imbalance)`` with
  imbalance = the most loaded GPU over the mean, averaged over layers (weak scaling: the
  global batch grows with the nodes in use).

The DeepSeek-V3 preset simulates placement and skew on 8 representative layers and scales
transfer sizes to all 58.
"""

from ._api import SimResult, apply_overrides, load_overrides, parse_duration, simulate
from ._config import CHECKPOINT_MODES, SYSTEMS, ModelSpec, PerfParams, SimConfig, SkewSpec
from ._engine import BUCKETS, SystemRun
from ._params import DEFAULT_PERF, PRESETS, preset
from ._traces import Event, Scenario, bamboo, compress, fail_every, load_trace, segment, spot_kills

__all__ = [
    "BUCKETS",
    "CHECKPOINT_MODES",
    "DEFAULT_PERF",
    "Event",
    "ModelSpec",
    "PRESETS",
    "PerfParams",
    "SYSTEMS",
    "Scenario",
    "SimConfig",
    "SimResult",
    "SkewSpec",
    "SystemRun",
    "apply_overrides",
    "bamboo",
    "compress",
    "fail_every",
    "load_overrides",
    "load_trace",
    "parse_duration",
    "preset",
    "segment",
    "simulate",
    "spot_kills",
]
