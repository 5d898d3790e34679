"""Validated configuration of the simulator: model, performance model, checkpointing.

Every time is in seconds and every field holding one says so (``*_s``); bandwidths are
in GB/s (10^9 bytes per second, ``*_gbps``). Invalid values raise ``ValueError`` naming the
field and the allowed range at construction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

SYSTEMS = ("ds", "dsft", "lazarus")
CHECKPOINT_MODES = ("full", "pec", "two-level", "exact")


def _positive(obj: object, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{type(obj).__name__}.{name} must be a finite number, got {v!r}")
        if v < 0 or (v == 0 and not allow_zero):
            lo = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{type(obj).__name__}.{name} must be {lo}, got {v!r}")


def _integer(obj: object, name: str, lo: int) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{type(obj).__name__}.{name} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True)
class ModelSpec:
    """An MoE model and how one node runs it.

    ``step_s`` is the time of one training step on ``ref_nodes`` nodes with perfectly
    balanced experts; each node processes ``samples_per_node_step`` samples per step (weak
    scaling: the global batch grows with the nodes in use).
    """

    name: str
    num_experts: int
    moe_layers: int
    expert_params: float  # parameters of ONE expert of one layer
    non_expert_params: float  # all non-expert parameters of the model
    bytes_per_param: float  # weights + optimizer state (B_w + B_o)
    gpus_per_node: int
    slots_per_node: int  # expert replica slots per node (c)
    samples_per_node_step: float
    step_s: float
    ref_nodes: int
    expert_fraction: float  # share of a balanced step spent in expert FFNs (scales with skew)
    comm_per_doubling: float = 0.0  # extra step time per doubling of nodes over ref_nodes
    top_k: int = 1
    sim_layers: int = 0  # MoE layers simulated for placement/skew (0 = all)
    # True: the global batch is samples_per_node_step * ref_nodes whatever the nodes in use
    # (strong scaling, as a job with a fixed global batch); False: each node adds its share
    fixed_batch: bool = False
    # measured step time (seconds, balanced experts) at these node counts, as [[nodes, s], ...]:
    # used instead of step_s scaled by comm_per_doubling where the node count is listed
    step_s_by_nodes: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name, lo in (("num_experts", 1), ("moe_layers", 1), ("gpus_per_node", 1),
                         ("slots_per_node", 1), ("ref_nodes", 1), ("top_k", 1), ("sim_layers", 0)):
            _integer(self, name, lo)
        _positive(self, "expert_params", "bytes_per_param", "samples_per_node_step", "step_s")
        _positive(self, "non_expert_params", "comm_per_doubling", allow_zero=True)
        if not 0.0 <= self.expert_fraction <= 1.0:
            raise ValueError(f"ModelSpec.expert_fraction must be in [0, 1], got {self.expert_fraction!r}")
        if not isinstance(self.fixed_batch, bool):
            raise ValueError(f"ModelSpec.fixed_batch must be true or false, got {self.fixed_batch!r}")
        try:
            table = tuple((int(n), float(t)) for n, t in self.step_s_by_nodes)
        except (TypeError, ValueError):
            raise ValueError(f"ModelSpec.step_s_by_nodes must be a list of [nodes, seconds] pairs, "
                             f"got {self.step_s_by_nodes!r}") from None
        for n, t in table:
            if n < 1 or not math.isfinite(t) or t <= 0:
                raise ValueError(f"ModelSpec.step_s_by_nodes: nodes must be >= 1 and seconds > 0, got [{n}, {t}]")
        object.__setattr__(self, "step_s_by_nodes", table)

    @property
    def layers_simulated(self) -> int:
        return self.moe_layers if self.sim_layers == 0 else min(self.sim_layers, self.moe_layers)

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert's weights + optimizer state (one layer)."""
        return self.expert_params * self.bytes_per_param

    def state_bytes(self, k: int | None = None) -> float:
        """(P_ne + P_e*K/E) * (B_w + B_o): the MoC checkpoint size formula (K=None: full)."""
        k = self.num_experts if k is None else k
        p_e = self.expert_params * self.num_experts * self.moe_layers
        return (self.non_expert_params + p_e * k / self.num_experts) * self.bytes_per_param

    def exact_step_bytes(self, window: int, weight_bytes: float) -> list[float]:
        """Bytes exact mode (``MoCConfig(exact=True)``) captures at each step of a window of
        ``window`` steps (docs/exact.md): at step i the full state (``bytes_per_param``) of
        the units of slot i and the compute weights (``weight_bytes`` per parameter) of the
        units of the later slots; every slot holds 1/W of the experts of each layer and of
        the non-expert parameters: ``P/W * (B + (W - 1 - i) * B_w)``."""
        p = self.non_expert_params + self.expert_params * self.num_experts * self.moe_layers
        return [p / window * (self.bytes_per_param + (window - 1 - i) * weight_bytes) for i in range(window)]


@dataclass(frozen=True)
class PerfParams:
    """Costs of the fault-tolerance machinery (sources: ``_params.DEFAULT_PERF``)."""

    detect_s: float = 15.0
    restart_s: float = 60.0
    reconfig_s: float = 10.0
    rebalance_s: float = 2.0
    transfer_gbps: float = 2.36
    storage_write_gbps: float = 1.25
    storage_read_gbps: float = 1.25
    memory_read_gbps: float = 2.14
    snapshot_gbps: float = 12.0
    fb_fraction: float = 0.66
    ckpt_call_s: float = 0.010
    dispatch_overhead: float = 0.03
    join_window_s: float = 120.0
    ds_interval_steps: int = 50
    ft_interval_steps: int = 250
    lazarus_interval_steps: int = 250
    moc_interval_divisor: int = 5
    rebalance_every_steps: int = 200
    skew_epoch_steps: int = 200
    min_replicas: int = 2
    k_persist: int = 1
    persist_every: int = 4
    plt_threshold: float = 0.0375
    dynamic_k: bool = True
    exact_window_steps: int = 8
    exact_weight_bytes: float = 4.0
    notice_detect_s: float = 0.0
    save_before_scale: bool = True
    # what a join costs the members (None: reconfig_s, the paper's single regroup cost); apart
    # from reconfig_s, which a failure's recovery pays after its detection
    join_reconfig_s: float | None = None
    notice_period_s: float = 120.0  # AWS spot: the interruption notice comes 2 minutes ahead

    def __post_init__(self) -> None:
        _positive(self, "transfer_gbps", "storage_write_gbps", "storage_read_gbps",
                  "memory_read_gbps", "snapshot_gbps", "exact_weight_bytes")
        _positive(self, "detect_s", "restart_s", "reconfig_s", "rebalance_s", "ckpt_call_s",
                  "dispatch_overhead", "join_window_s", "plt_threshold", "notice_detect_s",
                  "notice_period_s", allow_zero=True)
        for name in ("ds_interval_steps", "ft_interval_steps", "lazarus_interval_steps",
                     "moc_interval_divisor", "rebalance_every_steps", "skew_epoch_steps",
                     "min_replicas", "k_persist", "persist_every", "exact_window_steps"):
            _integer(self, name, 1)
        if not 0.0 <= self.fb_fraction <= 1.0:
            raise ValueError(f"PerfParams.fb_fraction must be in [0, 1], got {self.fb_fraction!r}")
        if self.join_reconfig_s is not None:
            _positive(self, "join_reconfig_s", allow_zero=True)
        for name in ("dynamic_k", "save_before_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PerfParams.{name} must be true or false, got {getattr(self, name)!r}")

    def with_overrides(self, values: dict[str, Any]) -> PerfParams:
        """A copy with ``values`` applied; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"unknown performance parameter(s) {bad}; allowed: {sorted(known)}")
        return replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SkewSpec:
    """Synthetic routing skew: Zipf(``zipf_s``) over a seeded per-layer expert ranking,
    re-drawn every ``PerfParams.skew_epoch_steps`` steps with log-normal noise ``drift``."""

    zipf_s: float = 1.0
    drift: float = 0.3

    def __post_init__(self) -> None:
        _positive(self, "zipf_s", "drift", allow_zero=True)


@dataclass(frozen=True)
class SimConfig:
    """One scenario: a model on up to ``nodes`` nodes, systems to compare, stop rule."""

    model: ModelSpec
    nodes: int
    perf: PerfParams = field(default_factory=PerfParams)
    systems: tuple[str, ...] = SYSTEMS
    checkpoint: str = "full"
    duration_s: float | None = None
    target_samples: float | None = None
    horizon_s: float | None = None
    seed: int = 0
    skew: SkewSpec = field(default_factory=SkewSpec)
    # per system: {"perf": {...}, "model": {...}, "checkpoint": mode} applied over the shared
    # settings for that system only (its own detection, restart, step time, checkpoints)
    system_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _integer(self, "nodes", 1)
        for name, over in self.system_overrides.items():
            if name not in SYSTEMS:
                raise ValueError(f"SimConfig.system_overrides: system must be one of {list(SYSTEMS)}, got {name!r}")
            bad = sorted(set(over) - {"perf", "model", "checkpoint"})
            if bad:
                raise ValueError(f"SimConfig.system_overrides[{name!r}]: unknown key(s) {bad}; "
                                 f"allowed: ['checkpoint', 'model', 'perf']")
        _integer(self, "seed", 0)
        if not self.systems or any(s not in SYSTEMS for s in self.systems):
            raise ValueError(f"SimConfig.systems must be a non-empty subset of {list(SYSTEMS)}, "
                             f"got {list(self.systems)}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"SimConfig.checkpoint must be one of {list(CHECKPOINT_MODES)}, got {self.checkpoint!r}")
        if (self.duration_s is None) == (self.target_samples is None):
            raise ValueError("SimConfig: give exactly one of duration_s or target_samples")
        for name in ("duration_s", "target_samples", "horizon_s"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.perf.min_replicas > self.nodes:
            raise ValueError(f"PerfParams.min_replicas must be <= nodes ({self.nodes}), got {self.perf.min_replicas}")
        if self.checkpoint == "exact" and self.perf.exact_weight_bytes > self.model.bytes_per_param:
            raise ValueError(f"PerfParams.exact_weight_bytes must be <= ModelSpec.bytes_per_param "
                             f"({self.model.bytes_per_param}: weights are part of the full state), "
                             f"got {self.perf.exact_weight_bytes}")
        if self.perf.k_persist > self.model.num_experts:
            raise ValueError(f"PerfParams.k_persist must be in [1, {self.model.num_experts}] (num_experts), "
                             f"got {self.perf.k_persist}")

    def for_system(self, name: str) -> SimConfig:
        """This config as system ``name`` runs it: its ``system_overrides`` applied (and
        validated: a bad value raises ``ValueError`` naming the system and the field)."""
        over = self.system_overrides.get(name)
        if not over:
            return self
        try:
            model = self.model
            if over.get("model"):
                known = set(ModelSpec.__dataclass_fields__)
                bad = sorted(set(over["model"]) - known)
                if bad:
                    raise ValueError(f"unknown model parameter(s) {bad}; allowed: {sorted(known)}")
                model = replace(model, **over["model"])
            perf = self.perf.with_overrides(over.get("perf", {}))
            return replace(self, model=model, perf=perf, checkpoint=over.get("checkpoint", self.checkpoint),
                           systems=(name,), system_overrides={})
        except ValueError as exc:
            raise ValueError(f"system {name!r}: {exc}") from None

    @property
    def end_s(self) -> float:
        """Simulated time after which the run stops (duration, or the JCT horizon)."""
        if self.duration_s is not None:
            return float(self.duration_s)
        return float(self.horizon_s) if self.horizon_s is not None else math.inf
