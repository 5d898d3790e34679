"""``make demo``: train a small MoE on CPU under :class:`moc.CheckpointManager`, SIGKILL it
part-way, restart it, and show what was restored from memory and from storage.

    python -m examples.moc_demo --dir runs/demo

Checkpoints: every 4 steps a shared-memory snapshot of 4 of 8 experts per layer; every
second snapshot also goes to ``runs/demo/ckpt`` with 2 experts per layer (two levels,
partial experts). The kill lands between persists, so the restart finds a snapshot in
memory newer than storage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from moc import CheckpointManager, MoCConfig

from .toy_moe import BigramTask, ToyMoE

LAYERS, EXPERTS = 2, 8


def config(directory: str) -> MoCConfig:
    return MoCConfig(storage=os.path.join(directory, "ckpt"), snapshot_dir=os.path.join(directory, "shm"),
                     interval=4, k_snapshot=4, k_persist=2, persist_every=2, keep_last=4, compression="zstd")


def train(directory: str, steps: int, report: bool) -> None:
    torch.manual_seed(0)
    model = ToyMoE(num_layers=LAYERS, num_experts=EXPERTS)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task = BigramTask(seed=0)
    with CheckpointManager(config(directory), model=model, optimizer=opt) as ckpt:
        start = ckpt.restore()
        if report and start:
            describe_restore(ckpt)
        for step in range(start, steps):
            x, y = task.batch(step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # waits here if the previous snapshot is still copying
            for layer, counts in model.routing_counts().items():
                ckpt.record_routing(layer, counts)
            ckpt.step(step)
            st = ckpt.status()
            mark = ""
            if step % ckpt.interval == 0:
                mark = f"  snapshot (persisted up to step {st['last_persisted_step']})"
            print(f"step {step:3d} loss {loss.item():.3f}{mark}", flush=True)
            time.sleep(0.03)  # pace the demo so the kill lands mid-run
        if report:
            print(f"\nfinished step {steps - 1}; PLT {ckpt.plt():.3%}; checkpointing blocked the training loop "
                  f"{1000 * st['blocked_seconds_total']:.1f} ms in all (waits at optimizer.step: {st['stalls']})",
                  flush=True)


def describe_restore(ckpt: CheckpointManager) -> None:
    plan = ckpt.last_restore
    stored = ckpt.store.latest_step()
    print(f"restored step {plan.step} from {'shared memory' if plan.from_memory else 'storage'} "
          f"(newest step in storage: {stored})")
    print(f"{'layer':<14}{'expert':>7}{'version':>9}{'age':>6}  {'from':<8}{'lost tokens':>12}")
    state = ckpt.plt_tracker.state()
    for name, src in sorted(plan.sources.items()):
        if not name.startswith("expert/"):
            continue
        layer, e = name[len("expert/"):].rsplit("/", 1)
        lost = plan.plt["cum"][layer][int(e)] - (src.cum or 0)
        origin = "memory" if src.level == "snapshot" else "storage"
        print(f"{layer:<14}{e:>7}{src.version:>9}{plan.step - src.version:>6}  {origin:<8}{lost:>12}")
    modules = [n for n in plan.sources if n.startswith("module/")]
    print(f"{len(modules)} non-expert units, all at step {plan.step}")
    print(f"PLT {ckpt.plt():.3%} (lost {sum(state['lost_tokens'].values())} of {state['total_tokens']} tokens, "
          f"threshold {ckpt.cfg.plt_threshold:.2%}); K now snapshot={ckpt.k_snapshot} persist={ckpt.k_persist}\n",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.moc_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="runs/demo", help="where checkpoints go (wiped first)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-at", type=int, default=46, help="SIGKILL the trainer once it reaches this step")
    ap.add_argument("--child", choices=("first", "second"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        train(args.dir, args.steps, report=args.child == "second")
        return 0

    shutil.rmtree(args.dir, ignore_errors=True)
    cfg = config(args.dir)
    print(f"moc demo: ToyMoE, {LAYERS} MoE layers x {EXPERTS} experts. Every {cfg.interval} steps: "
          f"{cfg.k_snapshot} experts/layer to shared memory; every {cfg.persist_every} snapshots: "
          f"{cfg.k_persist} experts/layer to {cfg.storage}\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root: examples
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")])))
    cmd = [sys.executable, "-m", "examples.moc_demo", "--dir", args.dir, "--steps", str(args.steps)]
    proc = subprocess.Popen(cmd + ["--child", "first"], stdout=subprocess.PIPE, text=True, env=env)
    reached = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  [run 1] " + line.rstrip())
        reached = int(line.split()[1])
        if reached >= args.kill_at:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"\n  [run 1] SIGKILL at step {reached} (exit code {proc.returncode}); restarting\n")
    proc = subprocess.run(cmd + ["--child", "second"], stdout=subprocess.PIPE, text=True, check=True, env=env)
    lines = proc.stdout.rstrip().splitlines()
    steps_at = [i for i, l in enumerate(lines) if l.startswith("step ")]
    head = lines[: steps_at[0]] if steps_at else lines
    for line in head:
        print(line)
    for line in [lines[i] for i in steps_at[:2]] + ["..."] + [lines[i] for i in steps_at[-2:]]:
        print("  [run 2] " + line)
    for line in lines[steps_at[-1] + 1:] if steps_at else []:
        print(line)
    print(f"\nInspect the store: moc inspect {os.path.join(args.dir, 'ckpt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
