"""Units, what moc saves and restores: how a model stores its experts (:mod:`.layouts`),
a unit's state captured from and applied to the model and optimizer (:mod:`.capture`),
per-unit serialisation plans reused between checkpoints (:mod:`.plans`), and the routing
counts read from the model's own routers (:mod:`.routing`) and its top-k (:mod:`.top_k`)."""

from .capture import (apply_partial, apply_units, capture_rng, capture_unit, expert_unit_name, local_box,
                      optimizer_groups, own_tree, restore_rng)
from .layouts import (DEFAULT_EXPERT_PATTERN, LAYOUT_NAMES, ExpertLayout, UnitLayout, UnitSpec, discover_units,
                      local_tensor, parse_expert, unit_base)
from .plans import UnitPlans
from .routing import RouterTaps, routing_reporters
from .top_k import model_top_k, resolve_top_k

__all__ = ["DEFAULT_EXPERT_PATTERN", "LAYOUT_NAMES", "ExpertLayout", "UnitLayout", "UnitSpec", "discover_units",
           "local_tensor", "apply_partial", "apply_units", "capture_rng", "capture_unit", "expert_unit_name",
           "local_box", "optimizer_groups", "own_tree", "parse_expert", "restore_rng", "unit_base", "UnitPlans",
           "RouterTaps", "routing_reporters", "model_top_k", "resolve_top_k"]
