"""One rank of a torchtitan training run checkpointed by moc (tests/moc/integrations/test_torchtitan.py).

Everything torchtitan-side is torchtitan 0.3.0's own code: its DeepSeek-V3 model (MLA
attention, a dense first layer, then MoE layers of ``GroupedExperts`` ``w1_EFD`` /
``w2_EDF`` / ``w3_EFD`` + shared experts + ``TokenChoiceTopKRouter``), scaled down; its
``OptimizersContainer`` (``default_adamw``), ``LRSchedulersContainer`` and a
``ParallelAwareDataloader``; the
checkpointer is built from ``MoCCheckpointManager.Config`` exactly as ``Trainer`` builds
``config.checkpoint`` and driven as ``Trainer.train`` drives it (``load()``, then
``save(step)`` after every step). Two things differ from torchtitan's ``Trainer`` on a GPU:
the inner attention is torchtitan's ``ScaledDotProductAttention`` (FlexAttention, its
language-model default, has no CPU backward in torch 2.13, and varlen attention is
CUDA-only), and FSDP2 is applied with ``fully_shard`` per block and on the root, as
torchtitan's ``apply_fsdp`` does, because its ``ParallelDims`` builds meshes on ``cuda``
when no accelerator is present (for the same reason the model spec's MoE load-balancing
hook, which reads ``ParallelDims``' meshes, is not registered: ``expert_bias_E`` exists and
is checkpointed, but stays zero).

    --kill-at S: SIGKILL the process right after step S's ``save`` (checkpoint finished).
    Every step dumps (rank 0) the full weights, AdamW state, LR and the global batch to
    <dump>/<tag>-<step>.pt; after ``load`` the restored state goes to <dump>/<tag>-restored.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
import torchtitan.models.deepseek_v3 as ds  # noqa: E402

from moc import MoCConfig  # noqa: E402
from moc.integrations.torchtitan import MoCCheckpointManager  # noqa: E402

VOCAB, DIM, SEQ, EXPERTS, TOP_K = 256, 64, 16, 8, 2


def build_model() -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 (debugmodel's structure, smaller: 3 layers, the first dense)."""
    layers = ds._build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32,
        num_experts=EXPERTS, num_shared_experts=1, router_top_k=TOP_K, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=16, max_seq_len=4 * SEQ, theta=10000.0, scaling="none"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None:
            layer.moe.load_balance_coeff = 1e-3
    cfg = ds.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=ds._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=ds._output_linear_init(DIM)))
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


class Tokens(IterableDataset):
    """An endless, stateful token stream per data-parallel rank (what torchtitan's HF text
    datasets are: ``state_dict`` gives the position)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(7919 * self.rank + self.pos)
            self.pos += 1
            yield torch.randint(0, VOCAB, (SEQ + 1,), generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


class TrainState:
    """What torchtitan's ``Trainer`` checkpoints as ``states={"train_state": self}``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def dump_state(model, optimizers, lr_schedulers, train_state, batch, path: str) -> None:
    opt = optimizers.optimizers[0]
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"opt/{names[id(p)]}/{k}"] = full(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["lr"] = torch.tensor(lr_schedulers.schedulers[0].get_last_lr()[0], dtype=torch.float64)
    out["train_state"] = torch.tensor([train_state.step, train_state.ntokens_seen])
    if batch is not None:
        out["batch"] = batch
    if dist.get_rank() == 0:
        torch.save(out, path + ".tmp")
        os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A new process restores into a differently initialised model: the weights must come from moc.
    torch.manual_seed(0 if args.kill_at >= 0 else 1234)
    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizers = default_adamw(lr=2e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=args.steps)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
    train_state = TrainState()
    ckpt_config = MoCCheckpointManager.Config(
        enable=True, moc=MoCConfig(storage=args.store, snapshot_dir=args.shm, interval=2, top_k=TOP_K,
                                   keep_last=10, coordination_timeout=timedelta(seconds=90)))
    checkpointer = ckpt_config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                     sd_adapter=None, base_folder=args.dump)
    if checkpointer.load():
        dump_state(model, optimizers, lr_schedulers, train_state, None,
                   os.path.join(args.dump, f"{args.tag}-restored.pt"))
    data = iter(dataloader)
    while train_state.step < args.steps:
        train_state.step += 1
        batch = next(data)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += batch.numel() * world
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        batches = [torch.empty_like(batch) for _ in range(world)]
        dist.all_gather(batches, batch)
        dump_state(model, optimizers, lr_schedulers, train_state, torch.stack(batches),
                   os.path.join(args.dump, f"{args.tag}-{train_state.step}.pt"))
        if train_state.step == args.kill_at:
            checkpointer.manager.wait()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
