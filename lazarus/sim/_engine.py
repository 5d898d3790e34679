"""Event loop and time accounting of one simulated system.

Every simulated second lands in exactly one bucket of :data:`BUCKETS`; compute that a
later roll back discards is moved from ``compute`` to ``lost`` (the timeline segments are
relabelled, so the PNG shows it too). ``SystemRun.result`` asserts that the buckets sum
to the simulated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._config import SimConfig
from ._systems import Decision, System, step_seconds
from ._traces import Scenario

BUCKETS = ("compute", "checkpoint", "restart", "reconfiguration", "lost", "idle")
_EPS = 1e-9


@dataclass
class Seg:
    t0: float
    t1: float
    bucket: str
    nodes: int
    step0: float = 0.0
    step1: float = 0.0
    samples: float = 0.0


class SystemRun:
    """Runs one system over one scenario under one checkpoint mode."""

    def __init__(self, cfg: SimConfig, system: System, scenario: Scenario) -> None:
        self.cfg, self.sys, self.sc = cfg, system, scenario
        self.m, self.p = cfg.model, cfg.perf
        self.mode = cfg.checkpoint
        self.t = 0.0
        self.step = 0.0
        self.samples = 0.0
        self.segs: list[Seg] = []
        self.queue: list[list[Any]] = []  # [bucket, seconds left, callback or None]
        self.persists: list[tuple[int, float]] = [(0, 0.0)]  # (step, time it is durable)
        self.snap_step = 0
        self.n_snap = 0
        self.k = self.m.num_experts if self.mode == "full" else self.p.k_persist
        self.plt_steps = 0.0
        self.pending_restore = 0.0
        self.jct: float | None = None
        self.counts = {"failures_seen": 0, "reconfigs": 0, "restarts": 0, "fallbacks": 0,
                       "rebalances": 0, "checkpoints": 0, "idle_periods": 0}
        base = system.interval_steps()
        self.interval = base if self.mode == "full" else max(1, base // self.p.moc_interval_divisor)
        self.replay_until = -1  # exact: the window being replayed ends here (no capture before)
        self.windows = 0        # exact: complete windows
        if self.mode == "exact":
            # exact mode captures every step; a window of W steps is booked at its end
            self.interval = self.p.exact_window_steps
            self.exact_bytes = self.m.exact_step_bytes(self.interval, self.p.exact_weight_bytes)

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, bucket: str, dt: float, **kw: float) -> None:
        if dt <= 0:
            return
        n = len(self.sys.active)
        last = self.segs[-1] if self.segs else None
        if (bucket != "compute" and last and last.bucket == bucket and last.nodes == n
                and abs(last.t1 - self.t) < _EPS):
            last.t1 = self.t + dt
        else:
            self.segs.append(Seg(self.t, self.t + dt, bucket, n, **kw))
        self.t += dt

    def _rollback(self, to_step: float) -> None:
        """Relabel compute after ``to_step`` as lost and rewind progress."""
        i = len(self.segs) - 1
        while i >= 0:
            s = self.segs[i]
            if s.bucket == "compute":
                if s.step1 <= to_step + _EPS:
                    break
                if s.step0 >= to_step - _EPS:
                    s.bucket = "lost"
                    self.samples -= s.samples
                    s.samples = 0.0
                else:
                    f = (to_step - s.step0) / (s.step1 - s.step0)
                    cut = s.t0 + f * (s.t1 - s.t0)
                    tail = Seg(cut, s.t1, "lost", s.nodes)
                    self.samples -= s.samples * (1 - f)
                    s.t1, s.step1, s.samples = cut, to_step, s.samples * f
                    self.segs.insert(i + 1, tail)
                    break
            i -= 1
        self.step = float(to_step)
        self.samples = max(0.0, self.samples)

    def _floor(self) -> int:
        s = math.floor(self.step + 1e-7)
        if self.step - s > _EPS:
            self._rollback(s)
        return s

    def durable_step(self) -> int:
        return max(s for s, done in self.persists if done <= self.t + _EPS)

    # ------------------------------------------------------------------ checkpoints
    def _tau(self) -> float:
        n = len(self.sys.active)
        return step_seconds(self.m, self.p, n, self.sys.imbalance(int(self.step)), self.sys.dispatcher)

    def _exact_window(self, s: int) -> None:
        """The window ending at step ``s``: every step's capture (snapshot copy beyond what
        the step's forward + backward hides, + the call), booked at the window's end; the
        window is persisted if due (the first, then every ``persist_every``-th) and no
        persist is still writing (moc skips it then, it does not wait)."""
        if s <= self.replay_until:
            return  # replayed steps capture nothing; the window in memory still holds them
        n = len(self.sys.active)
        tau = self._tau()
        stall = sum(self.p.ckpt_call_s + max(0.0, b / n / (self.p.snapshot_gbps * 1e9) - self.p.fb_fraction * tau)
                    for b in self.exact_bytes)
        self.counts["checkpoints"] += 1
        window = sum(self.exact_bytes)
        due = self.windows % self.p.persist_every == 0
        free = max(done for _, done in self.persists) <= self.t + stall + _EPS

        def done() -> None:
            self.windows += 1
            self.snap_step = s
            if due and free:
                self.persists.append((s, self.t + window / (self.p.storage_write_gbps * 1e9)))

        self.queue.append(["checkpoint", stall, done])

    def _checkpoint(self, s: int) -> None:
        if self.mode == "exact":
            self._exact_window(s)
            return
        n = len(self.sys.active)
        wb = self.p.storage_write_gbps * 1e9
        self.counts["checkpoints"] += 1
        if self.mode == "full":
            stall = self.p.ckpt_call_s + self.m.state_bytes() / wb
            self.queue.append(["checkpoint", stall, lambda: self.persists.append((s, self.t))])
            return
        persist = self.mode == "pec" or (self.n_snap + 1) % self.p.persist_every == 0
        snap_k = self.k if self.mode == "pec" else self.m.num_experts
        copy_s = self.m.state_bytes(snap_k) / n / (self.p.snapshot_gbps * 1e9)
        stall = self.p.ckpt_call_s + max(0.0, copy_s - self.p.fb_fraction * self._tau())
        last_done = max(done for _, done in self.persists)
        if persist and last_done > self.t:  # the previous persist still writes
            stall += last_done - self.t

        def done() -> None:
            self.n_snap += 1
            self.snap_step = s
            if persist:
                self.persists.append((s, self.t + self.m.state_bytes(self.k) / wb))

        self.queue.append(["checkpoint", stall, done])

    def _age_of_stored_experts(self, at_step: int) -> float:
        """Mean steps an expert's newest stored version lags ``at_step`` (sequential PEC)."""
        per = self.interval * (1 if self.mode == "pec" else self.p.persist_every)
        lag = per * (self.m.num_experts / self.k - 1) / 2
        return min(float(at_step), (at_step - self.durable_step()) + lag)

    def _restore(self, failed_frac: float) -> tuple[int, float]:
        """(step to roll back to, seconds to load it) for a checkpoint restart."""
        full = self.m.state_bytes()
        rb = self.p.storage_read_gbps * 1e9
        if self.mode == "exact":
            return self._restore_window(failed_frac)
        if self.mode == "two-level" and failed_frac < 1.0 and self.snap_step > 0:
            to = self.snap_step
            n = max(1, len(self.sys.active))
            secs = (1 - failed_frac) * full / n / (self.p.memory_read_gbps * 1e9) + failed_frac * full / rb
            self._plt(failed_frac, to)
        else:
            to = self.durable_step()
            secs = full / rb if to > 0 else 0.0
            if self.mode != "full":
                self._plt(1.0, to)
        self.persists = [(s, d) for s, d in self.persists if d <= self.t + _EPS]
        self.snap_step = to
        return to, secs

    def _restore_window(self, failed_frac: float) -> tuple[int, float]:
        """Exact mode: load the newest complete window (survivors from memory, the failed
        nodes' share from storage; all from storage when every node failed) and roll back to
        its first step; its other W - 1 steps are trained again (the replay). No PLT."""
        w = self.p.exact_window_steps
        window = sum(self.exact_bytes)
        rb = self.p.storage_read_gbps * 1e9
        if failed_frac < 1.0 and self.snap_step > 0:
            end = self.snap_step
            n = max(1, len(self.sys.active))
            secs = (1 - failed_frac) * window / n / (self.p.memory_read_gbps * 1e9) + failed_frac * window / rb
        else:
            end = self.durable_step()
            secs = window / rb if end > 0 else 0.0
        to = max(0, end - w + 1) if end > 0 else 0
        self.persists = [(s, d) for s, d in self.persists if d <= self.t + _EPS]
        self.snap_step = end
        self.replay_until = end
        return to, secs

    def _plt(self, share: float, at_step: int) -> None:
        if self.mode == "full" or share <= 0:
            return
        self.plt_steps += share * self._age_of_stored_experts(at_step)
        if self.p.dynamic_k and self.plt() > self.p.plt_threshold:
            self.k = min(self.m.num_experts, 2 * self.k)

    def plt(self) -> float:
        return self.plt_steps / max(self.step, 1.0)

    # ------------------------------------------------------------------ membership
    def on_remove(self, gone: set[str], alive: list[str], notice: bool = False) -> None:
        """``gone`` left; ``notice``: every one of them announced it (a spot notice), so the
        job pays ``notice_detect_s`` instead of ``detect_s`` to learn of it."""
        detect = self.p.notice_detect_s if notice else self.p.detect_s
        old = list(self.sys.active)
        restarting = any(q[0] == "restart" for q in self.queue)
        d = self.sys.on_remove(gone, alive, math.floor(self.step + 1e-7))
        if d.kind == "none":
            return
        self._floor()
        self.counts["failures_seen"] += 1
        failed = len(gone & set(old)) / max(1, len(old))
        if (d.kind == "fallback" and self.mode == "full") or (restarting and d.kind in ("reconfig", "fallback")):
            self.sys.configure(alive, int(self.step))
            d = Decision("restart" if self.sys.active else "idle")
        self.queue = []
        if d.kind == "fallback" and self.mode == "exact":
            # every replica of some expert is gone: reconfigure, then every node rolls back to
            # the window's first step and replays it (no stale expert, no PLT)
            self.counts["fallbacks"] += 1
            to, secs = self._restore(failed)
            self._rollback(to)
            self.queue += [["reconfiguration", detect + d.seconds, None], ["restart", secs, None]]
            return
        if d.kind in ("restart", "idle"):
            to, secs = self._restore(failed)
            self._rollback(to)
            if d.kind == "idle":
                self.counts["idle_periods"] += 1
                self.pending_restore = secs
                return
            self.counts["restarts"] += 1
            self.queue.append(["restart", detect + self.p.restart_s + secs, None])
            return
        self.queue.append(["reconfiguration", detect + d.seconds, None])
        if d.kind == "fallback":
            self.counts["fallbacks"] += 1
            self._plt(d.missing_share, int(self.step))
            self.queue.append(["restart", d.missing_bytes / (self.p.storage_read_gbps * 1e9), None])
        else:
            self.counts["reconfigs"] += 1

    def on_join(self, alive: list[str]) -> None:
        d = self.sys.on_join(alive, math.floor(self.step + 1e-7))
        if d.kind == "none":
            return
        s = self._floor()
        if any(q[0] == "restart" for q in self.queue):
            if d.kind == "scale" and not self.p.save_before_scale:
                # torchrun: the workers being started are stopped and started again with the
                # new member; the restart begins anew (its roll back is already booked)
                self.counts["restarts"] += 1
                for q in self.queue:
                    if q[0] == "restart":
                        q[1] = max(q[1], self.p.restart_s)
            return  # the restart in progress starts on the new nodes as well
        if d.kind == "resume":
            self.counts["restarts"] += 1
            self.queue.append(["restart", self.p.restart_s + self.pending_restore, None])
            self.pending_restore = 0.0
        elif d.kind == "scale":
            full, n = self.m.state_bytes(), len(self.sys.active)
            if self.mode in ("two-level", "exact"):
                save = self.p.ckpt_call_s + full / n / (self.p.snapshot_gbps * 1e9)
                load = full / n / (self.p.memory_read_gbps * 1e9)
            else:
                save = self.p.ckpt_call_s + full / (self.p.storage_write_gbps * 1e9)
                load = full / (self.p.storage_read_gbps * 1e9)
            self.counts["restarts"] += 1
            if not self.p.save_before_scale:
                # torchrun's elastic agent: a new member restarts the job from the newest
                # durable checkpoint; the steps since it are trained again
                to, secs = self._restore(0.0)
                self._rollback(to)
                self.queue.append(["restart", self.p.restart_s + secs, None])
                return

            def saved() -> None:
                self.snap_step = s
                self.persists.append((s, self.t))

            self.queue += [["checkpoint", save, saved], ["restart", self.p.restart_s + load, None]]
        else:
            self.counts["reconfigs"] += 1
            self.queue.append(["reconfiguration", d.seconds, None])

    # ------------------------------------------------------------------ time
    def advance(self, until: float) -> None:
        target = self.cfg.target_samples
        while self.t < until - _EPS and self.jct is None:
            if self.queue:
                item = self.queue[0]
                dt = min(item[1], until - self.t)
                self._add(item[0], dt)
                item[1] -= dt
                if item[1] <= _EPS:
                    self.queue.pop(0)
                    if item[2] is not None:
                        item[2]()
                continue
            if not self.sys.active:
                if math.isinf(until):
                    return
                self._add("idle", until - self.t)
                continue
            tau = self._tau()
            per_step = (self.m.ref_nodes if self.m.fixed_batch else len(self.sys.active)) * self.m.samples_per_node_step
            cur = self.step
            marks = [self.interval, self.p.skew_epoch_steps]
            if self.sys.dispatcher:
                marks.append(self.p.rebalance_every_steps)
            nb = min((math.floor(cur / k + 1e-9) + 1) * k for k in marks)
            steps = nb - cur
            if target is not None:
                steps = min(steps, (target - self.samples) / per_step)
            dt = min(steps * tau, until - self.t)
            adv = dt / tau
            self._add("compute", dt, step0=cur, step1=cur + adv, samples=adv * per_step)
            self.step += adv
            self.samples += adv * per_step
            if target is not None and self.samples >= target - 1e-6:
                self.jct = self.t
                return
            if abs(self.step - nb) < 1e-7:
                self.step = float(nb)
                self._boundary(nb)

    def _boundary(self, s: int) -> None:
        if s % self.interval == 0:
            self._checkpoint(s)
        secs = self.sys.rebalance(s)
        if secs > 0:
            self.counts["rebalances"] += 1
            self.queue.append(["reconfiguration", secs, None])

    def run(self) -> None:
        end = self.cfg.end_s
        alive = list(self.sc.initial)
        self.sys.configure(alive, 0)
        groups: dict[float, list] = {}
        for ev in self.sc.events:
            groups.setdefault(ev.time_s, []).append(ev)
        times = sorted(groups)
        join_at = math.inf
        # nodes that gave notice and stay until the joiners arrive, to hand their state over
        deferred: set[str] = set()
        # nodes that arrived and are still starting (until the join window ends): a restart
        # in the meantime cannot use them. A node that arrives at the same instant as a removal
        # is a spare taking the removed one's place (``fail_every(replace=True)``): it is up.
        starting: set[str] = set()
        i = 0
        while self.t < end and self.jct is None:
            nxt = min(times[i] if i < len(times) else math.inf, join_at)
            self.advance(min(nxt, end))
            if self.jct is not None or self.t >= end - _EPS or nxt == math.inf:
                break  # done, out of time, or idle with no event left to wake it
            if join_at <= nxt and (i >= len(times) or join_at <= times[i]):
                join_at = math.inf
                starting = set()
                self.on_join(alive + sorted(deferred))
                if deferred:
                    left, deferred = deferred, set()
                    self.on_remove(left, alive, True)
                continue
            gone: set[str] = set()
            added = False
            notice = True
            for ev in groups[times[i]]:
                if ev.kind == "remove":
                    gone |= set(ev.nodes)
                    notice = notice and ev.notice
                    alive = [n for n in alive if n not in ev.nodes]
                    starting -= set(ev.nodes)
                else:
                    starting |= {n for n in ev.nodes if n not in alive}
                    alive += [n for n in ev.nodes if n not in alive]
                    added = True
            i += 1
            if added and join_at == math.inf:
                join_at = self.t + self.p.join_window_s
            if (gone and notice and self.sys.hands_over and join_at - self.t <= self.p.notice_period_s
                    and not set(self.sys.active) - gone - deferred):
                # the last members got a spot notice while nodes are joining: they train on and
                # hand their state to the joiners (Lazarus's SIGTERM), no roll back
                deferred |= gone & set(self.sys.active)
                gone -= deferred
            if gone:
                starting -= {n for ev in groups[times[i - 1]] if ev.kind == "add" for n in ev.nodes}
                self.on_remove(gone, [n for n in alive if n not in starting], notice)

    # ------------------------------------------------------------------ output
    def totals(self) -> dict[str, float]:
        """Seconds per bucket (unrounded); they sum to the simulated time (asserted)."""
        total = {b: 0.0 for b in BUCKETS}
        for s in self.segs:
            total[s.bucket] += s.t1 - s.t0
        assert abs(math.fsum(total.values()) - self.t) <= 1e-6 * max(1.0, self.t), (total, self.t)
        return total

    def result(self) -> dict[str, Any]:
        total = self.totals()
        elapsed = self.t
        busy = [s for s in self.segs if s.bucket == "compute"]
        node_s = sum((s.t1 - s.t0) * s.nodes for s in busy)
        comp = sum(s.t1 - s.t0 for s in busy)
        out: dict[str, Any] = {
            "samples": round(self.samples, 3),
            "steps": round(self.step, 3),
            "jct_s": None if self.jct is None else round(self.jct, 3),
            "sim_time_s": round(elapsed, 3),
            "breakdown": {b: round(v, 3) for b, v in total.items()},
            "mean_nodes_computing": round(node_s / comp, 3) if comp else 0.0,
            # effective training time ratio: time spent on steps that count / simulated time
            "ettr": round(total["compute"] / elapsed, 6) if elapsed > 0 else 0.0,
            "counts": dict(self.counts),
        }
        if self.mode != "full":
            out["plt"] = round(self.plt(), 6)
            out["final_k"] = self.k
        return out

    def timeline(self) -> list[tuple[float, float, str, int]]:
        return [(s.t0, s.t1, s.bucket, s.nodes) for s in self.segs]


