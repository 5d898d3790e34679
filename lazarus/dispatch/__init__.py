"""Lazarus token dispatcher (Algorithm 1 of the paper) as a C++/CUDA op with a torch fallback.

Given replicas ``R[E, N]`` from the placement and all-gathered routed token counts
``T[E, N]``, every rank computes the same balanced schedule: each replica processes an
equal share of its expert's tokens (within one token), ranks serve their own tokens first,
and the rest travel in one uneven all-to-all. See ``csrc/dispatch_core.h`` for the exact
integer rule.
"""

from ._api import compiled_backend, dispatch_counts, dispatch_device, dispatch_permutation
from ._build import OpsState, load_ops

__all__ = ["OpsState", "compiled_backend", "dispatch_counts", "dispatch_device", "dispatch_permutation", "load_ops"]
