"""``make demo``: train a small MoE on CPU with partial-expert checkpoints, SIGKILL it
part-way, resume from the store and report what was restored.

    python -m moc.demo --dir runs/demo

This exercises the persistent level (store format, partial checkpoints that compose over
steps, PLT accounting, crash consistency) with a simple synchronous save loop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from ._ckpt_store import CheckpointStore
from ._plt import PLTTracker
from ._selection import sequential_selection
from ._toy import BigramTask, ToyMoE
from ._units import apply_units, capture_rng, capture_unit, discover_units, optimizer_groups, restore_rng

LAYERS, EXPERTS, TOP_K = 2, 8, 1


class Trainer:
    """A model, its optimizer and a synchronous partial-expert checkpoint loop."""

    def __init__(self, store_dir: str, *, k: int, interval: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = ToyMoE(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.task = BigramTask(seed=seed)
        self.layout = discover_units(self.model)
        self.ckpt = CheckpointStore(store_dir, keep_last=4)
        self.plt = PLTTracker({layer: len(ex) for layer, ex in self.layout.layers.items()}, top_k=TOP_K)
        self.k, self.interval = k, interval
        self.checkpoints = 0
        self.base = None

    def train_step(self, step: int) -> float:
        x, y = self.task.batch(step)
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        for layer, counts in self.model.routing_counts().items():
            self.plt.record(layer, counts)
        self.plt.add_tokens(x.numel())
        return loss.item()

    def save(self, step: int) -> dict[str, list[int]]:
        """Save non-expert modules, extra state and K experts per layer (all, the first time)."""
        writer = self.ckpt.writer(step)
        records, chosen = [], {}
        state = self.model.state_dict(keep_vars=True)
        for li, layer in enumerate(sorted(self.layout.layers)):
            experts = self.layout.layers[layer]
            pick = experts if self.base is None else [
                experts[i] for i in sequential_selection(self.checkpoints, li, self.k, len(experts))]
            chosen[layer] = pick
            for spec in self.layout.experts(layer):
                if spec.expert in pick:
                    tree = capture_unit(spec, self.model, self.opt, state=state)
                    records.append(writer.add_unit(spec.name, tree, kind="expert", layer=layer, expert=spec.expert))
        for spec in self.layout.modules():
            records.append(writer.add_unit(spec.name, capture_unit(spec, self.model, self.opt, state=state), kind="module"))
        extra = {"extra": {"step": step, "rng": capture_rng(),
                           "optimizer_groups": optimizer_groups(self.model, self.opt),
                           "checkpoints": self.checkpoints}}
        records.append(writer.add_unit("extra", extra, kind="extra"))
        writer.finish()
        for layer, pick in chosen.items():
            self.plt.mark_saved("persist", layer, pick)
        self.base = self.ckpt.commit(step, records, base=self.base, plt=self.plt.state())
        self.checkpoints += 1
        return chosen

    def restore(self) -> dict[str, Any] | None:
        result = self.ckpt.load() if self.ckpt.latest_step() is not None else None
        if result is None:
            return None
        extra = result.units["extra"]["extra"]
        trees = [t for name, t in result.units.items() if name != "extra"]
        apply_units(self.model, self.opt, trees, extra["optimizer_groups"])
        restore_rng(extra["rng"])
        manifest = result.manifest
        stale = {layer: [e for e, rec in recs.items() if result.versions[rec.name] < manifest.step]
                 for layer, recs in manifest.layers().items()}
        self.plt.load_state(manifest.plt)
        lost = 0
        for layer, experts in stale.items():
            for e in experts:  # tokens the expert saw after its saved version are lost
                n = self.plt.cum[layer][e] - self.plt.saved["persist"][layer][e]
                self.plt.book_loss("persist", layer, n)
                self.plt.cum[layer][e] = self.plt.saved["persist"][layer][e]
                lost += n
        self.base = manifest
        self.checkpoints = int(extra["checkpoints"]) + 1
        return {"step": manifest.step, "manifest": manifest, "versions": result.versions,
                "stale": stale, "lost": lost, "fallbacks": result.fallbacks}


def run_training(store_dir: str, steps: int, k: int, interval: int) -> None:
    """Child process: train from scratch or from the newest checkpoint, printing progress."""
    t = Trainer(store_dir, k=k, interval=interval)
    info = t.restore()
    start = 0 if info is None else info["step"] + 1
    for step in range(start, steps):
        loss = t.train_step(step)
        if step % interval == 0:
            chosen = t.save(step)
            picked = "; ".join(f"{layer}: {v}" for layer, v in chosen.items())
            print(f"step {step:3d} loss {loss:.3f}  checkpoint (experts saved: {picked})", flush=True)
        else:
            print(f"step {step:3d} loss {loss:.3f}", flush=True)
        time.sleep(0.02)  # pace the demo so the kill lands mid-run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moc.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="runs/demo", help="checkpoint directory (wiped first)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-at", type=int, default=47, help="SIGKILL the trainer once it reaches this step")
    ap.add_argument("--k", type=int, default=2, help="experts saved per layer per checkpoint")
    ap.add_argument("--interval", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_training(args.dir, args.steps, args.k, args.interval)
        return 0

    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"moc demo: ToyMoE with {LAYERS} MoE layers x {EXPERTS} experts, K={args.k} experts per layer "
          f"per checkpoint, every {args.interval} steps, store {os.path.abspath(args.dir)}\n")
    cmd = [sys.executable, "-m", "moc.demo", "--child", "--dir", args.dir, "--steps", str(args.steps),
           "--k", str(args.k), "--interval", str(args.interval)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    reached = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  [run 1] " + line.rstrip())
        reached = int(line.split()[1])
        if reached >= args.kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"\n  [run 1] SIGKILL at step {reached} (exit code {proc.returncode})\n")

    probe = Trainer(args.dir, k=args.k, interval=args.interval)
    info = probe.restore()
    assert info is not None, "no checkpoint was committed before the kill"
    m = info["manifest"]
    print(f"restored step {info['step']} from {probe.ckpt.store.url} (committed steps: {probe.ckpt.steps()})")
    print(f"{'layer':<14}{'expert':>7}{'version':>9}{'age':>6}{'lost tokens':>13}")
    for layer, recs in m.layers().items():
        for e, rec in recs.items():
            lost = m.plt["unsaved"][layer][e] if e in info["stale"][layer] else 0
            print(f"{layer:<14}{e:>7}{rec.step:>9}{m.step - rec.step:>6}{lost:>13}")
    modules = [r for r in m.units.values() if r.kind == "module"]
    print(f"non-expert units: {len(modules)}, all from step {m.step}")
    print(f"lost tokens this fault: {info['lost']}; PLT = {probe.plt.value():.4%} (threshold 3.75%)\n")

    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    lines = proc.stdout.strip().splitlines()
    for line in lines[:3] + ["..."] + lines[-2:]:
        print("  [run 2] " + line)
    print(f"\nresumed at step {info['step'] + 1} and finished step {args.steps - 1}. "
          f"Inspect the store with: moc inspect {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
