"""Recovery for :class:`moc.CheckpointManager`: the newest version of every unit from the
ranks' surviving in-memory snapshots, else storage; PLT charged for stale experts;
dynamic-K applied afterwards."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import xxhash

from ._config import MoCConfig
from ._dist import Comm
from ._errors import CheckpointError
from ._policy import CheckpointPolicy
from ._restore import (MemoryPiece, RestorePlan, manifest_inventory, module_units_of, plan_restore, plan_units,
                       restore_snapshots)
from ._run_state import RunState
from ._snapshot import Inventory, SnapshotMaps, read_headers
from ._store import CheckpointStore, Manifest, TensorMeta, decode_tree, unit_buffer
from ._units import apply_partial, apply_units, local_box, own_tree, restore_rng, unit_base

__all__ = ["Recovery"]

log = logging.getLogger("moc")


class Recovery:
    """``restore()`` (the whole job) and ``restore_units()`` (lost experts) of one rank.

    Args:
        cfg: the manager's configuration.
        model, optimizer: what is restored into.
        inventory: the job's units and their holders.
        comm: collectives (plans gathered, memory pieces moved with one all-to-all).
        run: the shared run bookkeeping (run id, flags).
        store: the persistent store.
        snapshot_dir: this process's shared-memory folder.
        policy: PLT, K and counters continue from what is restored.
        extra_state: user objects restored from the extra unit.
    """

    def __init__(self, cfg: MoCConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 inventory: Inventory, comm: Comm, run: RunState, store: CheckpointStore, snapshot_dir: str,
                 policy: CheckpointPolicy, extra_state: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.inventory = inventory
        self.comm = comm
        self.run = run
        self.store = store
        self.snapshot_dir = snapshot_dir
        self.policy = policy
        self.extra_state = extra_state
        self.last_restore: RestorePlan | None = None

    @property
    def rank(self) -> int:
        return self.run.rank

    @property
    def world(self) -> int:
        return self.comm.world

    def snapshot_headers(self) -> list[dict[str, Any]]:
        """Published snapshots in this rank's shared-memory directory (newest last).

        ``rank`` is this process's current rank: it serves these buffers now, whatever
        rank wrote them (ranks are renumbered when an elastic job reconfigures)."""
        return sorted((dict(h, rank=self.rank) for h in read_headers(self.snapshot_dir)), key=lambda h: h["step"])

    def restore_units(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """See :meth:`moc.CheckpointManager.restore_units` (the caller has waited for the
        snapshot in flight and synced routing counts)."""
        names = sorted(set(names))
        manifest = self.store.latest_manifest()
        local = [h for h in self.snapshot_headers() if h.get("run") == self.run.run_id]
        everyone = [h for hs in self.comm.gather_json(local) for h in hs]
        plan = plan_units(everyone, manifest_inventory(manifest), names)
        trees, _ = self._gather_units(plan, manifest, self.inventory.needs(self.world))
        # apply_partial copies everything it keeps (model values and optimizer state), so
        # trees that view the snapshot maps need no copy of their own here.
        mine = [t for n, t in trees.items() if n in plan.sources and n in self.inventory.layout.units]
        del trees
        apply_partial(self.model, self.optimizer, mine)
        out: dict[str, dict[str, Any]] = {}
        with self.run.lock:
            for name in names:
                src = plan.sources.get(name)
                lost = 0 if src is None else self.policy.book_restored(name, src.level, src.cum, rewind=False)
                out[name] = {"level": None if src is None else src.level,
                             "version": None if src is None else src.version, "lost_tokens": lost}
            self.policy.apply_dynamic_k()
        self.policy.recoveries += 1
        gone = [n for n, v in out.items() if v["level"] is None]
        if gone:
            log.error("rank %d: no saved version of %s anywhere; they keep their current values", self.rank, gone[:5])
        with self.run.lock:
            plt = self.policy.tracker.value()
        log.info("rank %d: restored %d lost units (%s), PLT now %.4f%%", self.rank, len(names),
                 ", ".join(f"{n}<-{v['level']}@{v['version']}" for n, v in list(out.items())[:4]), 100 * plt)
        return out

    def restore(self) -> tuple[int, Manifest | None]:
        """Load the newest consistent state (collective); return the next step to run
        (0 if none) and the manifest it is based on."""
        manifest = self.store.latest_manifest()
        if manifest is not None and manifest.meta.get("exact"):
            raise CheckpointError(f"{self.store.store.url}: step {manifest.step} was written with "
                                  "MoCConfig(exact=True) (a window to replay); open it with exact=True")
        # Snapshots of this job only; older ones than the manifest still help experts
        # whose stored version is older than the snapshot. ``moc inspect --memory`` plans
        # with the same three helpers, so what it reports is what this does.
        local = restore_snapshots(self.snapshot_headers(), manifest)
        everyone = [h for hs in self.comm.gather_json(local) for h in hs]
        plan = plan_restore(everyone, manifest_inventory(manifest),
                            module_units_of(list(self.inventory.holders), manifest))
        if plan is None:
            log.info("rank %d: nothing to restore from %s; starting at step 0", self.rank, self.store.store.url)
            return 0, manifest

        needs = self._restore_needs(plan)
        trees = self._copied_out(*self._gather_units(plan, manifest, needs))
        extras = sorted(n for n in trees if n.startswith("extra/"))
        extra = trees.pop(extras[0], {}).get("extra", {}) if extras else {}
        for name in [n for n in trees if n.startswith("extra/")]:
            trees.pop(name)
        missing = apply_units(self.model, self.optimizer, list(trees.values()), extra.get("optimizer_groups"))
        if missing:
            raise RuntimeError(f"restore step {plan.step}: no saved state for {missing[:5]}")
        if "rng" in extra:
            restore_rng(extra["rng"])
        for name, obj in self.extra_state.items():
            if name in extra.get("user", {}):
                obj.load_state_dict(extra["user"][name])
        self._after_restore(plan, manifest)
        with self.run.lock:
            plt = self.policy.tracker.value()
        log.debug("rank %d: restored step %d (%s), PLT %.4f%%, k_snapshot=%d k_persist=%d", self.rank, plan.step,
                 "memory" if plan.from_memory else "storage", 100 * plt, self.policy.k_snapshot,
                 self.policy.k_persist)
        return plan.step + 1, manifest

    # -- data movement ---------------------------------------------------------------------
    def _restore_needs(self, plan: RestorePlan) -> dict[int, list[str]]:
        """Saved units each rank reads: those of the units it holds now, and of sharded
        units (pieces, ``#`` names) only those overlapping the piece it holds; its own
        extra state, else rank 0's (a job resumed on more ranks). Gathered, so every rank
        knows every move."""
        state = self.model.state_dict(keep_vars=True)
        mine: dict[str, list[Any]] = {}
        for spec in self.inventory.layout.units.values():
            mine.setdefault(unit_base(spec.name), []).append(spec)
        wanted = []
        for name, src in plan.sources.items():
            if name.startswith("extra/"):
                continue
            specs = mine.get(unit_base(name))
            if specs and any(_overlaps(src.meta, spec, state) for spec in specs):
                wanted.append(name)
        extras = sorted(n for n in plan.sources if n.startswith("extra/"))
        own = f"extra/rank{self.rank}"
        if own in plan.sources:
            wanted.append(own)
        elif extras:
            wanted.append("extra/rank0" if "extra/rank0" in extras else extras[0])
        return dict(enumerate(self.comm.gather_json(sorted(wanted))))

    def _gather_units(self, plan: RestorePlan, manifest,
                      needs: dict[int, list[str]]) -> tuple[dict[str, Any], set[str]]:
        """Trees of the units this rank holds: memory pieces moved with one all-to-all,
        storage units read directly. Also returns the names of the trees decoded straight
        from this rank's snapshot maps: they alias the snapshot files (no staging copy)
        and go through :meth:`_copied_out` before anything keeps them."""
        # (dest, unit, piece) in one global order that every rank derives identically.
        moves: list[tuple[int, str, MemoryPiece]] = []
        for dest in range(self.world):
            for name in needs[dest]:
                src = plan.sources.get(name)
                if src is not None and src.level == "snapshot":
                    moves.extend((dest, name, p) for p in src.pieces)
        maps = SnapshotMaps(self.snapshot_dir, self.rank, [p for _, _, p in moves if p.rank == self.rank])

        send_parts, send_splits = [], [0] * self.world
        recv_splits = [0] * self.world
        for dest, _, p in moves:
            if p.rank == self.rank and dest != self.rank:
                send_parts.append(maps.piece(p))
                send_splits[dest] += p.end - p.start
            if dest == self.rank and p.rank != self.rank:
                recv_splits[p.rank] += p.end - p.start
        # ``moves`` is sorted by destination, so the send buffer is grouped by destination
        # and each source's pieces arrive in the same global order, as all_to_all_single wants.
        send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=torch.uint8)
        del send_parts
        received = self.comm.exchange(send, send_splits, recv_splits)
        del send
        recv_offsets: dict[int, int] = {}
        pos = 0
        for q in range(self.world):
            recv_offsets[q] = pos
            pos += recv_splits[q]

        trees: dict[str, Any] = {}
        borrowed: set[str] = set()
        storage_names = []
        for name in needs[self.rank]:
            src = plan.sources.get(name)
            if src is None:
                continue
            if src.level == "persist":
                storage_names.append(name)
                continue
            parts = []
            for p in src.pieces:
                if p.rank == self.rank:
                    part = maps.piece(p)
                else:
                    # Pieces from rank q arrive in the global move order.
                    lo = recv_offsets[p.rank]
                    part = received[lo: lo + (p.end - p.start)]
                    recv_offsets[p.rank] += p.end - p.start
                # ignore: numpy's stubs give ndarray __buffer__ only on Python >= 3.12
                if p.checksum and "xxh3:" + xxhash.xxh3_64_hexdigest(
                        memoryview(part.numpy())) != p.checksum:  # type: ignore[arg-type, unused-ignore]
                    raise RuntimeError(f"snapshot piece of {name} (step {p.step}, rank {p.rank}) failed its checksum")
                parts.append((p, part))
            if len(parts) == 1:
                data = parts[0][1]              # one piece: decode in place, no copy
                if parts[0][0].rank == self.rank:
                    borrowed.add(name)
            else:
                data, _ = unit_buffer(int(src.meta["unit_nbytes"]))
                for p, part in parts:
                    data[p.start: p.end].copy_(part)
            tensors = [TensorMeta.from_json(t) for t in src.meta["tensors"]]
            trees[name] = decode_tree(src.meta["skeleton"], tensors, data)
        maps.close()
        fallbacks = []
        if storage_names:
            loaded = self.store.load(manifest.step, names=storage_names)
            trees.update(loaded.units)
            for unit, bad, used in loaded.fallbacks:
                cum = self.store.version_counter(unit, used) if unit.startswith("expert/") else None
                fallbacks.append([unit, bad, used, cum])
                log.warning("rank %d: %s restored from step %d (step %d unreadable)", self.rank, unit, used, bad)
        # Every rank books PLT for every unit: a fallback read by one rank is told to all.
        for unit, bad, used, cum in (f for fs in self.comm.gather_json(fallbacks) for f in fs):
            src = plan.sources[unit]
            src.version = used
            if unit.startswith("expert/"):
                # the older version's counter: the tokens routed to it since are lost too.
                # Unknown (no kept manifest records it): all of the expert's tokens count.
                src.cum = 0 if cum is None else int(cum)
        return trees, borrowed

    def _copied_out(self, trees: dict[str, Any], borrowed: set[str]) -> dict[str, Any]:
        """``trees`` with every tree that aliases a snapshot map made independent of it
        (model tensors excepted: they are only copied from)."""
        if not borrowed & set(trees):
            return trees
        params = dict(self.model.named_parameters())
        return {n: (own_tree(t, params, self.optimizer) if n in borrowed else t) for n, t in trees.items()}

    # -- bookkeeping ---------------------------------------------------------------------
    def _after_restore(self, plan: RestorePlan, manifest: Manifest | None) -> None:
        meta = plan.meta
        self.run.run_id = meta.get("run_id", self.run.run_id)
        self.policy.load_meta(meta)
        self.run.has_base = manifest is not None
        self.run.first_done = True
        if self.rank == 0 and manifest is not None:
            for step in self.store.steps():
                if step > plan.step:  # unreadable newer manifests belong to no timeline now
                    self.store.discard_step(step)
        with self.run.lock:
            self.policy.tracker.load_state(plan.plt)
            for name, src in plan.sources.items():
                self.policy.book_restored(name, src.level, src.cum, rewind=True)
            self.policy.apply_dynamic_k()
        self.last_restore = plan


def _saved_boxes(meta: dict[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    """key -> (global offset, lengths) of each placed tensor of a saved unit (from its
    JSON skeleton; no tensor is read)."""
    skeleton = meta.get("skeleton") or {}
    place = skeleton.get("place") if isinstance(skeleton, dict) else None
    out = {}
    for key, p in (place or {}).items():
        ref = skeleton["model"][key]
        shape = list(meta["tensors"][int(ref["@t"])]["shape"])
        if p.get("expert_dim") is not None:
            shape.insert(int(p["expert_dim"]), 1)
        out[key] = (list(p["offset"]), shape)
    return out


def _overlaps(meta: dict[str, Any], spec: Any, state: dict[str, Any]) -> bool:
    """Does a saved unit hold any element of the piece ``spec`` describes here?"""
    saved = _saved_boxes(meta)
    if not saved:
        return True
    for ref in spec.refs:
        box = saved.get(ref.key)
        value: Any = state.get(ref.key)
        if box is None or not hasattr(value, "shape"):
            return True
        _, off_box, local_shape = local_box(ref.key, value)
        off, local = list(off_box), list(local_shape)
        if ref.expert_dim is not None:
            # the row's global offset (its expert id, whatever the local row number)
            off = list(ref.offset) if ref.offset is not None else [o + (ref.row if i == ref.expert_dim else 0)
                                                                    for i, o in enumerate(off)]
            local[ref.expert_dim] = 1
        elif ref.span is not None:
            d, start, n = ref.span
            off[d] += start
            local[d] = n
        if all(max(o, so) < min(o + n, so + sn) for o, n, so, sn in zip(off, local, box[0], box[1])):
            return True
    return False
