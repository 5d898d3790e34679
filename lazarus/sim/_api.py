"""Programmatic entry point: build the routing, run the systems, collect the results."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ._config import ModelSpec, PerfParams, SimConfig, SkewSpec
from ._engine import SystemRun
from ._routing import Routing, TraceRouting, ZipfRouting
from ._systems import make_system
from ._traces import Scenario

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)?\s*$", re.IGNORECASE)
_UNIT = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float, option: str = "duration") -> float:
    """Seconds from ``30m``, ``5m``, ``2h``, ``90s``, ``250ms`` or plain seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise ValueError(f"{option} must look like 30m, 2h, 90s or plain seconds, got {text!r}")
        value = float(m.group(1)) * _UNIT[m.group(2).lower() if m.group(2) else None]
    if value <= 0:
        raise ValueError(f"{option} must be > 0, got {text!r}")
    return value


def load_overrides(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read ``--config``: JSON or TOML; either flat performance parameters or sections
    ``perf``, ``model`` and ``skew``. Returns ``{"perf": {...}, "model": {...}, "skew": {...}}``."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"--config: cannot read {p}: {exc.strerror}") from None
    if p.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # pragma: no cover - Python 3.10
            raise ValueError("--config: TOML needs Python 3.11+; use a .json file") from None
        try:
            data = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--config: invalid TOML in {p}: {exc}") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--config: invalid JSON in {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {p} must hold an object / table")
    sections = {"perf", "model", "skew", "systems"}
    if set(data) & sections:
        bad = sorted(set(data) - sections)
        if bad:
            raise ValueError(f"--config: unknown section(s) {bad}; allowed: {sorted(sections)}")
        out = {k: data.get(k, {}) for k in sections}
    else:
        out = {"perf": data, "model": {}, "skew": {}, "systems": {}}
    for k, v in out.items():
        if not isinstance(v, dict):
            raise ValueError(f"--config: section {k!r} must be a table of name = value")
    for name, v in out["systems"].items():
        if not isinstance(v, dict) or not all(isinstance(x, (dict, str)) for x in v.values()):
            raise ValueError(f"--config: systems.{name} must be a table with perf / model tables "
                             f"and a checkpoint mode, got {v!r}")
    return out


def apply_overrides(model: ModelSpec, perf: PerfParams, skew: SkewSpec,
                    over: dict[str, dict[str, Any]]) -> tuple[ModelSpec, PerfParams, SkewSpec]:
    for obj_name, obj, values in (("model", model, over.get("model", {})), ("skew", skew, over.get("skew", {}))):
        known = set(obj.__dataclass_fields__)
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"--config: unknown {obj_name} parameter(s) {bad}; allowed: {sorted(known)}")
    model = replace(model, **over.get("model", {}))
    skew = replace(skew, **over.get("skew", {}))
    return model, perf.with_overrides(over.get("perf", {})), skew


@dataclass
class SimResult:
    config: SimConfig
    scenario: Scenario
    runs: dict[str, SystemRun] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        systems = {name: run.result() for name, run in self.runs.items()}
        return {
            "systems": systems,
            "scenario": {"name": self.scenario.name, "initial_nodes": len(self.scenario.initial),
                         "events": len(self.scenario.events), "max_nodes": self.scenario.max_nodes()},
            "model": self.config.model.name,
            "checkpoint": self.config.checkpoint,
            "seed": self.config.seed,
        }

    def timelines(self) -> dict[str, list[tuple[float, float, str, int]]]:
        return {name: run.timeline() for name, run in self.runs.items()}


def simulate(cfg: SimConfig, scenario: Scenario, *, routing_trace: str | Path | None = None) -> SimResult:
    """Run every system in ``cfg.systems`` over ``scenario`` (same events for all)."""
    m = cfg.model

    def routing(c: SimConfig) -> Routing:
        mm, epoch = c.model, c.perf.skew_epoch_steps
        if routing_trace is not None:
            return TraceRouting(routing_trace, mm.num_experts, mm.layers_simulated, epoch)
        return ZipfRouting(mm.num_experts, mm.layers_simulated, epoch, c.skew, c.seed)

    if scenario.max_nodes() * m.slots_per_node < m.num_experts:
        raise ValueError(
            f"the scenario never has more than {scenario.max_nodes()} nodes; {m.name} needs "
            f"nodes * slots >= {m.num_experts} experts"
        )
    result = SimResult(cfg, scenario)
    for name in cfg.systems:
        sc = cfg.for_system(name)
        run = SystemRun(sc, make_system(name, sc.model, sc.perf, routing(sc)), scenario)
        run.run()
        result.runs[name] = run
    return result
