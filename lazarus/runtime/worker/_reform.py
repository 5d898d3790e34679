"""How an NCCL trainer re-forms its group for a plan: shrink the current communicator or
abort it and form a new one.

NCCL 2.27 added ``ncclCommShrink`` (torch: ``dist.shrink_group``, and the NCCL backend's
``shrink``): the surviving ranks of a communicator make a smaller one from it, excluding
the ranks named, without a new bootstrap (``ncclCommInitRank``'s all-to-all of addresses
and topology discovery). Its constraints, from torch's ``shrink_group``:

* the backend must say ``supports_shrinking`` (an NCCL build >= 2.27; gloo never does);
* only the ranks that stay call it, all of them; an excluded rank must not;
* the parent group must have at least 2 ranks and at least 1 must remain;
* the survivors keep their relative order: new rank = position among the survivors;
* the parent communicator must still exist: one already aborted (``ncclCommAbort``, what
  the trainer does to interrupt a collective blocked on a dead or frozen peer) cannot be
  shrunk.

So a shrink can replace abort + ``init_process_group`` only when the new members are a
subset of the old group, in the same order, with no joiner (a joiner was never part of the
old communicator: a join needs a new one), and the old communicator is intact.
:func:`choose_reform` makes that decision from plain values (the versions, the two member
lists, whether the parent is intact) so that it is tested without a GPU;
``ElasticConfig.reform`` chooses the policy (:data:`REFORM_MODES`).

Where a shrink is chosen and fails (an exception, a rank of the group whose shrink failed)
every member falls back to abort + init, logged with the rank and the step (see
``_reconfigure``). The GPU timings of both ways are measured by ``tests/gpu`` (the
``mp_nccl_shrink.py`` ranks) and recorded by ``make gpu-check``; NOT YET MEASURED: no GPU
has run this code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["REFORM_MODES", "SHRINK_MIN_NCCL", "ReformChoice", "abort_quietly", "agree_on_shrink", "attach_nccl",
           "check_reform_spec", "choose_reform", "local_shrink_available", "reform_for_plan", "shrink_available",
           "shrink_default_nccl", "shrink_for_plan", "trainer_shrink_available"]

log = logging.getLogger("lazarus.reconfigure")

#: the values of ``ElasticConfig.reform``: ``"auto"`` shrinks where torch, NCCL and the plan
#: allow it and re-initialises otherwise; ``"shrink"`` is the same but refuses to start
#: where torch or NCCL cannot shrink at all; ``"reinit"`` always aborts and forms anew.
REFORM_MODES = ("auto", "shrink", "reinit")
#: the first NCCL with ``ncclCommShrink``
SHRINK_MIN_NCCL = (2, 27, 0)


def check_reform_spec(value: object, field: str = "ElasticConfig.reform") -> None:
    """ValueError unless ``value`` is one of :data:`REFORM_MODES`."""
    if not isinstance(value, str) or value not in REFORM_MODES:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, REFORM_MODES))}, got {value!r}")


def shrink_available(torch_has_shrink: bool, nccl_version: Sequence[int] | None) -> tuple[bool, str]:
    """``(available, why)``: can this torch and NCCL shrink a communicator at all?

    ``torch_has_shrink``: ``torch.distributed`` has ``shrink_group`` (torch >= 2.10);
    ``nccl_version``: ``torch.cuda.nccl.version()`` (None: no NCCL in this build)."""
    if not torch_has_shrink:
        return False, "this torch has no torch.distributed.shrink_group"
    if nccl_version is None:
        return False, "this torch build has no NCCL"
    have = tuple(int(v) for v in nccl_version)
    if have < SHRINK_MIN_NCCL:
        return False, (f"NCCL {'.'.join(map(str, have))} has no ncclCommShrink "
                       f"(needs >= {'.'.join(map(str, SHRINK_MIN_NCCL))})")
    return True, f"NCCL {'.'.join(map(str, have))} with ncclCommShrink"


@dataclass(frozen=True)
class ReformChoice:
    """The decision for one plan on one rank.

    Attributes:
        how: ``"shrink"`` or ``"reinit"``.
        why: the reason, for the log line.
        exclude: ranks of the current group to exclude (a shrink's argument; empty for reinit).
    """

    how: str
    why: str
    exclude: list[int] = field(default_factory=list)

    @property
    def shrink(self) -> bool:
        return self.how == "shrink"


def _ranks(members: Sequence[str], gpus_per_node: int) -> list[tuple[str, int]]:
    """(node, local rank) of each rank, in rank order (a plan's ranks: node-major)."""
    return [(node, local) for node in members for local in range(gpus_per_node)]


def choose_reform(mode: str, *, backend: str, available: tuple[bool, str], old_members: Sequence[str],
                  new_members: Sequence[str], old_gpus_per_node: int, new_gpus_per_node: int,
                  parent_intact: bool) -> ReformChoice:
    """Shrink the current communicator, or abort it and form a new one?

    Args:
        mode: ``ElasticConfig.reform`` (:data:`REFORM_MODES`).
        backend: the trainer's, ``"nccl"`` or ``"gloo"``.
        available: :func:`shrink_available`'s answer for this process.
        old_members / new_members: the nodes of the current group and of the plan, in rank
            order (each node holds ``*_gpus_per_node`` consecutive ranks).
        parent_intact: the current group's NCCL communicator exists and was not aborted.

    Shrink only when every condition of the module docstring holds: the plan's ranks are
    the current ranks minus some, in the same order (no joiner, no node reordered, the
    same GPUs per node), at least one rank excluded, and the parent intact.
    """
    check_reform_spec(mode)
    if mode == "reinit":
        return ReformChoice("reinit", "ElasticConfig.reform='reinit'")
    if backend != "nccl":
        return ReformChoice("reinit", f"the {backend} backend cannot shrink (NCCL only)")
    ok, why = available
    if not ok:
        return ReformChoice("reinit", why)
    if not parent_intact:
        return ReformChoice("reinit", "the current NCCL communicator was aborted (or never formed): "
                                      "an aborted communicator cannot be shrunk")
    joiners = [n for n in new_members if n not in set(old_members)]
    if joiners:
        return ReformChoice("reinit", f"{len(joiners)} joiner(s) ({', '.join(joiners[:3])}) were not in the "
                                      "current communicator: a join needs a new one")
    if old_gpus_per_node != new_gpus_per_node:
        return ReformChoice("reinit", f"GPUs per node change ({old_gpus_per_node} -> {new_gpus_per_node})")
    old_ranks = _ranks(old_members, old_gpus_per_node)
    new_ranks = _ranks(new_members, new_gpus_per_node)
    if not new_ranks:
        return ReformChoice("reinit", "no rank remains")
    kept = [r for r in old_ranks if r in set(new_ranks)]
    if kept != new_ranks:
        return ReformChoice("reinit", "the plan reorders the surviving nodes (a shrink keeps their order)")
    exclude = [i for i, r in enumerate(old_ranks) if r not in set(new_ranks)]
    if not exclude:
        return ReformChoice("reinit", "no rank leaves the group")
    return ReformChoice("shrink", f"{why}; excluding rank(s) {exclude} of {len(old_ranks)}", exclude)


# -- the torch side (needs a live NCCL group; run on a GPU only) --------------------------------
def local_shrink_available() -> tuple[bool, str]:
    """:func:`shrink_available` for this process's torch and NCCL."""
    import torch
    import torch.distributed as dist

    has = dist.is_available() and hasattr(dist, "shrink_group")
    version: tuple[int, ...] | None = None
    try:
        if dist.is_available() and dist.is_nccl_available():
            raw = torch.cuda.nccl.version()
            version = tuple(raw) if isinstance(raw, tuple) else (raw // 10000, raw // 100 % 100, raw % 100)
    except Exception:  # noqa: BLE001 - a build without NCCL
        version = None
    return shrink_available(has, version)


def shrink_default_nccl(exclude: Sequence[int], *, abort_parent: bool) -> Any:
    """Shrink the default group's NCCL communicator, excluding the ranks ``exclude``; returns
    the new NCCL backend, registered nowhere yet (:func:`attach_nccl` puts it on the next
    group). Called by every rank that stays, none that leaves. ``abort_parent``: torch's
    ``SHRINK_ABORT`` (the parent's outstanding operations are aborted first: after a
    failure) instead of ``SHRINK_DEFAULT`` (a quiet parent: a planned leave, after a barrier).

    The backend's ``shrink`` rather than ``dist.shrink_group``: the latter destroys the old
    default group (a destroy of an NCCL communicator whose peer is gone can hang; Lazarus
    aborts it instead) and every other group, and returns a group with the NCCL backend
    only, without the ``cpu:gloo`` half that the trainer's host-side agreements use."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    nccl: Any = pg._get_backend(torch.device("cuda"))   # ProcessGroupNCCL (its shrink is not in the stubs)
    if not bool(getattr(nccl, "supports_shrinking", False)):
        raise RuntimeError(f"the default group's CUDA backend ({type(nccl).__name__}) does not support shrinking")
    flags = c10d.SHRINK_ABORT if abort_parent else c10d.SHRINK_DEFAULT
    return nccl.shrink(sorted(int(r) for r in exclude), flags, None)


def attach_nccl(backend: Any, device: Any, init_backend: str) -> None:
    """Make ``backend`` (a shrunk NCCL backend) the CUDA backend of the default group, which
    was just formed with ``cpu:gloo`` only: CUDA tensors then go over it, host tensors over
    gloo, as in a group formed with ``cpu:gloo,cuda:nccl`` (``init_backend``)."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    pg._register_backend(torch.device("cuda"), c10d.ProcessGroup.BackendType.NCCL, backend)
    pg.bound_device_id = device
    _, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (init_backend, store)
    c10d._world.pg_backend_config[pg] = init_backend


def trainer_shrink_available(reform: str, backend: str) -> tuple[bool, str]:
    """:func:`shrink_available` for a trainer on ``backend``; ``ElasticConfig.reform="shrink"``
    where it is not is a ValueError naming the field and the reason."""
    available = local_shrink_available() if backend == "nccl" else (False, f"the {backend} backend cannot shrink "
                                                                          "(NCCL only)")
    if reform == "shrink" and not available[0]:
        raise ValueError(f"ElasticConfig.reform='shrink' needs the NCCL backend with NCCL >= 2.27 and "
                         f"torch.distributed.shrink_group, but {available[1]}; use reform='auto' "
                         "(shrink where possible) or 'reinit'")
    return available


def reform_for_plan(mode: str, *, backend: str, available: tuple[bool, str], members: Sequence[str], world: int,
                    plan_members: Sequence[str], plan_gpus_per_node: int, intact: bool, where: str) -> ReformChoice:
    """:func:`choose_reform` for a rank of a group of ``world`` ranks over ``members`` and
    a plan, logged with ``where`` (node, rank, step, generations)."""
    choice = choose_reform(mode, backend=backend, available=available, old_members=members,
                           new_members=plan_members, old_gpus_per_node=world // len(members) if members else 0,
                           new_gpus_per_node=plan_gpus_per_node, parent_intact=intact and bool(members))
    log.info("%s: re-forming the group by %s (%s)", where, choice.how, choice.why)
    return choice


def abort_quietly(backend: Any) -> None:
    """Abort a shrunk NCCL backend that will not be used (an error is ignored: it may be gone)."""
    try:
        backend.abort()
    except Exception as exc:  # noqa: BLE001
        log.debug("abort of an unused shrunk communicator: %s", exc)


def shrink_for_plan(choice: ReformChoice, rank: int, world: int, *, device: Any, where: str) -> Any:
    """This rank's shrunk NCCL communicator for a plan that gives it ``rank`` of ``world``
    (a planned change: the parent is quiet once this rank's work on it is done), or None
    when the shrink failed, logged with ``where`` (node, rank, step, generations); the
    members then agree to form a new communicator (:func:`agree_on_shrink`)."""
    import torch

    try:
        torch.cuda.current_stream(device).synchronize()
        new = shrink_default_nccl(choice.exclude, abort_parent=False)
        got = (int(new.rank()), int(new.size()))
        if got != (rank, world):
            abort_quietly(new)
            raise RuntimeError(f"the shrunk communicator has rank {got[0]} of {got[1]}, the plan says "
                               f"{rank} of {world}")
        return new
    except Exception as exc:  # noqa: BLE001 - the fallback is a new communicator
        log.warning("%s: shrinking the NCCL communicator failed (%s); falling back to abort + init", where,
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None


def agree_on_shrink(outcomes: Sequence[str], shrunk: Any, *, where: str) -> Any:
    """Every member's shrink outcome (``"1"``: succeeded), read from the plan's store once
    all arrived, in rank order: ``shrunk`` (this rank's, or None) when all succeeded;
    otherwise None, this rank's own aborted, and the fallback logged with ``where``."""
    failed = [r for r, v in enumerate(outcomes) if v != "1"]
    if not failed:
        return shrunk
    if shrunk is not None:
        abort_quietly(shrunk)
    log.warning("%s: the shrink of the NCCL communicator failed on rank(s) %s; falling back to a new communicator "
                "(abort + init)", where, failed)
    return None
