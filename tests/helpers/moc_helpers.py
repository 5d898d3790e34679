"""Shared helpers for CheckpointManager tests: a tiny MoE, a deterministic training step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.toy_moe import BigramTask, ToyMoE


def make(seed: int = 0, *, optimizer: str = "adamw", num_experts: int = 8, layers: int = 2, dim: int = 16,
         task_seed: int = 0, hidden: int = 32, top_k: int = 1):
    torch.manual_seed(seed)
    model = ToyMoE(vocab=32, dim=dim, hidden=hidden, num_layers=layers, num_experts=num_experts, top_k=top_k)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, BigramTask(vocab=32, seed=task_seed)


def train_step(model, opt, task, step: int, ckpt=None, batch: int = 64) -> dict[str, torch.Tensor]:
    x, y = task.batch(step, batch)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    counts = model.routing_counts()
    if ckpt is not None:
        for layer, c in counts.items():
            ckpt.record_routing(layer, c)
        ckpt.step(step)
    return counts


def clone_state(model, opt) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    ost = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
           for p, st in opt.state.items()}
    return {"model": sd, "optim": ost}
