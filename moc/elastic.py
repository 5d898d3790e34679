"""What an elastic runtime (``lazarus.runtime``) needs from moc, as public names.

An elastic trainer moves units (an expert of a layer, a non-expert module) between
ranks when the membership changes, and hands a live :class:`~moc.CheckpointManager`
over to the one it builds for the next process group. These are the parts of moc it
uses for that; everything else in moc stays internal:

* units: :func:`discover_units` (the model's units), :func:`capture_unit` (one unit's
  tensors and optimizer state as a tree), :func:`apply_partial` (load captured trees,
  whole units or pieces of them, into a model and its optimizer);
* wire encoding of a unit tree without pickle: :func:`plan_tree` (how a tree lays out in
  one flat byte buffer), :func:`unit_buffer` (an aligned buffer of that size),
  :func:`decode_tree` and :class:`TensorMeta` (the per-tensor description);
* :class:`Comm`: moc's communicator (its own gloo groups for agreement and inventory),
  including private groups formed on a store of the runtime's choosing;
* :class:`Handover`: what :meth:`CheckpointManager.detach` returns and the next manager
  adopts (its buffers, counters and store), and :func:`import_optional`.
"""

from __future__ import annotations

from ._dist import Comm
from ._manager import Handover
from ._optional import import_optional
from ._store import TensorMeta, decode_tree, plan_tree, unit_buffer
from ._units import apply_partial, capture_unit, discover_units

__all__ = [
    "Comm",
    "Handover",
    "TensorMeta",
    "apply_partial",
    "capture_unit",
    "decode_tree",
    "discover_units",
    "import_optional",
    "plan_tree",
    "unit_buffer",
]
