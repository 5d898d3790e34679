"""One training process of the exact-mode kill-and-replay test on CUDA (tests/gpu/test_gpu_exact.py).

A small MoE (``examples/toy_moe.py``: experts combined with ``index_add_``, float atomics on
a GPU unless deterministic kernels are on; dropout, drawn from the CUDA RNG; global-norm
clipping) trains ``--steps`` steps on ``--device`` with batches that are a function of the
step. With moc (``MoCConfig(exact=True)``) it prints ``STEP s async=A fallback=F`` after
every ``ckpt.step(s)`` (A, F: captures issued on the side stream into page-locked buffers /
copied by the capture thread so far) and sleeps ``--step-sleep`` seconds, so that the test
can SIGKILL it mid-run; ``--restore`` restores the newest window first and replays it.
``--no-moc``: the uninterrupted reference, without moc. At the end it writes ``--out``
(JSON): the SHA-256 of every weight and optimizer-state tensor's bytes, the step training
resumed at, and exact mode's status. The settings bit-exact replay needs on CUDA
(``docs/exact.md``) are set here, as a training script would.

    python tests/gpu/exact_cuda_worker.py --device cuda --storage S --shm M --steps 24 --out OUT.json
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before torch starts cuBLAS

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.toy_moe import BigramTask, ToyMoE  # noqa: E402
from moc import CheckpointManager, MoCConfig  # noqa: E402

VOCAB = 256


def build(device: torch.device):
    torch.manual_seed(0)
    model = ToyMoE(vocab=VOCAB, dim=128, hidden=256, num_layers=2, num_experts=8, top_k=2).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, task: BigramTask, step: int, device: torch.device, ckpt=None) -> None:
    x, y = task.batch(step, 4096)
    loss = F.cross_entropy(F.dropout(model(x.to(device)), 0.1), y.to(device))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if ckpt is not None:
        for layer, counts in model.routing_counts().items():
            ckpt.record_routing(layer, counts)
        ckpt.step(step)


def digests(model, opt) -> dict[str, str]:
    """SHA-256 of every tensor's bytes: weights by name, optimizer state by parameter name."""
    def sha(t: torch.Tensor) -> str:
        t = t.detach().cpu().contiguous()
        return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    out = {f"model/{k}": sha(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = sha(v) if torch.is_tensor(v) else repr(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the test) or cpu (to try the script without a GPU)")
    ap.add_argument("--storage")
    ap.add_argument("--shm")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--no-moc", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model, opt = build(device)
    task = BigramTask(vocab=VOCAB, seed=3)
    result: dict = {"start": 0}
    if args.no_moc:
        for step in range(args.steps):
            train_step(model, opt, task, step, device)
    else:
        if not (args.storage and args.shm):
            ap.error("--storage and --shm are needed unless --no-moc")
        cfg = MoCConfig(storage=args.storage, snapshot_dir=args.shm, interval=1, k_snapshot=2, exact=True,
                        top_k=2, persist_every=1)
        with CheckpointManager(cfg, model=model, optimizer=opt) as ckpt:
            start = ckpt.restore() if args.restore else 0
            result["start"] = start
            for step in range(start, args.steps):
                train_step(model, opt, task, step, device, ckpt)
                st = ckpt.status()["exact"]
                print(f"STEP {step} async={st['device_captures_async']} fallback={st['device_captures_fallback']}",
                      flush=True)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            ckpt.wait()
            result["status"] = ckpt.status()["exact"]
    if device.type == "cuda":
        torch.cuda.synchronize()
    result["state"] = digests(model, opt)
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)


if __name__ == "__main__":
    main()
