"""A small byte-level MoE GPT on :class:`lazarus.moe.MoELayer`: the elastic runtime's example.

Architecture: token + learned position embedding, ``n_layers`` pre-LN blocks (causal
self-attention with ``F.scaled_dot_product_attention``, then a dense MLP or, in every
``moe_every``-th block, a :class:`~lazarus.moe.MoELayer`), final LayerNorm, a head tied to
the token embedding (or separate). Module names are fixed, so expert parameters are
``blocks.<i>.moe.experts.<e>.w1.weight`` -- moc's default expert pattern -- and
:func:`moe_layer_names` gives the MoE layers before anything is built.

Initialisation is identical on every rank with no communication: every non-expert module
draws from a generator seeded by ``(config.seed, module name)``, and every MoE layer gets
its own ``MoEConfig.seed`` from which ``MoELayer`` seeds the router and expert ``e`` by
expert id -- so expert ``e`` starts the same wherever a placement puts it. Construction
does not touch the global RNG.

Load balancing: the loss has an optional Switch-style auxiliary term
(``aux_loss_coef``) that is OFF by default on purpose -- the demo wants the real routing
skew of a real corpus, which is what Lazarus' replica allocation exploits.

Distributed step (every rank, same global batch sliced by :class:`ByteCorpus`)::

    x, y = corpus.batch(step, rank, world, batch_size, cfg.seq_len, seed=seed)
    _, loss = model(x, y); loss.backward()
    sync_gradients(model)          # dense: all-reduce mean; MoE: replicas + router
    opt.step()

``python -m examples.moe_gpt --steps 100`` trains single-process and prints the
loss curve, the validation loss, the step time and the routing skew per layer.
"""

from __future__ import annotations

import math
import numbers
import re
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lazarus.moe import MoEConfig, MoELayer, layer_placements, moe_layers, sync_moe_gradients
from lazarus.moe._comm import world as _world
from lazarus.planning import Placement

__all__ = [
    "GPTConfig",
    "MoEGPT",
    "evaluate",
    "make_optimizer",
    "moe_layer_names",
    "param_group_of",
    "routing_skew",
    "single_process_placement",
    "sync_gradients",
    "train_step",
]

TOP_K = (1, 2)
ACTIVATIONS = ("gelu", "relu", "silu")
_SEED_STRIDE = 1_000_003
_MAX_SEED = 2**31 - 1


# ----- configuration ---------------------------------------------------------------------------
def _int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo
            or (hi is not None and value > hi)):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"GPTConfig.{name} must be an integer {allowed}, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of :class:`MoEGPT`.

    Attributes:
        vocab: vocabulary (256 for bytes).
        d_model, n_heads: width and attention heads (``d_model % n_heads == 0``).
        n_layers: transformer blocks.
        moe_every: block ``i`` is MoE when ``i % moe_every == moe_every - 1``: 1 = every
            block, 2 = every other block (1, 3, ...); in ``[1, n_layers]``.
        num_experts, top_k, d_hidden, activation: of every MoE layer (``top_k`` 1 or 2);
            dense blocks use an MLP of the same ``d_hidden``.
        seq_len: maximum context (size of the position embedding).
        dropout: in ``[0, 1)``; 0 by default (dropout makes ranks' forwards differ).
        tie_head: the output head shares the token embedding's weight.
        aux_loss_coef: weight of the load-balancing loss; 0 (off) by default.
        grad_reduction: of the MoE layers, ``"mean"`` (matches :func:`sync_gradients`).
        seed: of every parameter's initialisation, in ``[0, 2**31 - 1]``.
    """

    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    moe_every: int = 1
    num_experts: int = 8
    top_k: int = 1
    d_hidden: int = 128
    seq_len: int = 64
    dropout: float = 0.0
    tie_head: bool = True
    activation: str = "gelu"
    aux_loss_coef: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _int("vocab", self.vocab, 2)
        _int("d_model", self.d_model, 1)
        _int("n_heads", self.n_heads, 1)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads must divide d_model = {self.d_model}, got n_heads = {self.n_heads}"
            )
        _int("n_layers", self.n_layers, 1)
        _int("moe_every", self.moe_every, 1, self.n_layers)
        _int("num_experts", self.num_experts, 1)
        if isinstance(self.top_k, bool) or self.top_k not in TOP_K:
            raise ValueError(f"GPTConfig.top_k must be one of {list(TOP_K)}, got {self.top_k!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"GPTConfig.top_k must be <= num_experts = {self.num_experts}, got {self.top_k}")
        _int("d_hidden", self.d_hidden, 1)
        _int("seq_len", self.seq_len, 1)
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real)
                or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.tie_head, bool):
            raise ValueError(f"GPTConfig.tie_head must be True or False, got {self.tie_head!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if (isinstance(self.aux_loss_coef, bool) or not isinstance(self.aux_loss_coef, numbers.Real)
                or not math.isfinite(self.aux_loss_coef) or self.aux_loss_coef < 0):
            raise ValueError(f"GPTConfig.aux_loss_coef must be a finite number >= 0, got {self.aux_loss_coef!r}")
        _int("seed", self.seed, 0, _MAX_SEED)

    def is_moe(self, block: int) -> bool:
        return block % self.moe_every == self.moe_every - 1

    def moe_config(self, block: int) -> MoEConfig:
        """The MoE layer of block ``block``: its own seed, so layers start different."""
        return MoEConfig(d_model=self.d_model, d_hidden=self.d_hidden, num_experts=self.num_experts,
                         top_k=self.top_k, activation=self.activation,
                         seed=self.seed * (self.n_layers + 1) + block + 1, grad_reduction="mean")


def moe_layer_names(config: GPTConfig) -> list[str]:
    """Qualified module names of the MoE layers of ``MoEGPT(config)``, without building it
    (what a controller/planner needs to plan placements per layer)."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    return [f"blocks.{i}.moe" for i in range(config.n_layers) if config.is_moe(i)]


def single_process_placement(num_experts: int) -> Placement:
    """All experts on one rank."""
    return Placement([list(range(num_experts))], num_experts=num_experts, strategy="single")


# ----- modules -------------------------------------------------------------------------------------
def _module_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _SEED_STRIDE + zlib.crc32(name.encode()))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_hidden)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU()}[cfg.activation]
        self.proj = nn.Linear(cfg.d_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN block; exactly one of ``mlp`` / ``moe`` exists."""

    def __init__(self, cfg: GPTConfig, index: int, placement: Placement | None, group: Any) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.aux_loss_coef = cfg.aux_loss_coef
        if placement is None:
            self.mlp = MLP(cfg)
        else:
            self.moe = MoELayer(cfg.moe_config(index), placement, group=group)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        h = self.ln2(x)
        if hasattr(self, "moe"):
            if self.aux_loss_coef > 0 and self.training:
                self.aux_loss = _balance_loss(self.moe, h)
            return x + self.drop(self.moe(h))
        return x + self.drop(self.mlp(h))


def _balance_loss(moe: MoELayer, h: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e * P_e`` on this rank's tokens
    (f: fraction of routed slots, P: mean router probability); 1 when perfectly balanced."""
    e = moe.config.num_experts
    probs = F.softmax(moe.router.logits(h.reshape(-1, h.shape[-1])), dim=-1)
    idx = probs.topk(moe.config.top_k, dim=-1).indices
    frac = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / idx.numel()
    return e * (frac * probs.mean(0)).sum()


class MoEGPT(nn.Module):
    """Byte-level GPT with :class:`~lazarus.moe.MoELayer` blocks.

    Args:
        config: shapes and seed.
        placements: per MoE layer name (exactly :func:`moe_layer_names`), one placement
            for all layers, or ``None``: all experts on the single rank of a single-process
            run (``ValueError`` when the group has more ranks).
        group: process group of the MoE layers and of :func:`sync_gradients`
            (default: the world when ``torch.distributed`` is initialised).
    """

    def __init__(self, config: GPTConfig, placements: Mapping[str, Placement] | Placement | None = None, *,
                 group: Any = None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.group = group
        plans = self._resolve_placements(placements)
        with torch.random.fork_rng(devices=[]):  # nn defaults draw from the global RNG; keep it untouched
            self.tok_emb = nn.Embedding(config.vocab, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(
                Block(config, i, plans.get(f"blocks.{i}.moe"), group) for i in range(config.n_layers)
            )
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab, bias=False)
            if config.tie_head:
                self.head.weight = self.tok_emb.weight
        self._init_dense()
        self.last_lm_loss: float | None = None
        self.last_aux_loss: float | None = None

    def _resolve_placements(self, placements: Mapping[str, Placement] | Placement | None) -> dict[str, Placement]:
        return layer_placements({n: self.config.num_experts for n in moe_layer_names(self.config)}, placements,
                                self.group)

    @torch.no_grad()
    def _init_dense(self) -> None:
        """GPT-2 style init of everything outside the MoE layers, seeded by module name."""
        cfg = self.config
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        moe_prefixes = tuple(n + "." for n in moe_layer_names(cfg))
        for name, module in self.named_modules():
            if name.startswith(moe_prefixes) or any(name == p[:-1] for p in moe_prefixes):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name == "head" and cfg.tie_head:
                    continue
                std = resid_std if name.endswith(".proj") else 0.02
                gen = _module_generator(cfg.seed, name)
                module.weight.copy_(torch.empty(module.weight.shape).normal_(0.0, std, generator=gen))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    # ----- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` int64 ``[B, T]`` (``T <= seq_len``) -> logits ``[B, T, vocab]``; with
        targets ``y`` ``[B, T]`` also the mean next-token cross-entropy (plus
        ``aux_loss_coef`` x the mean balance loss of the MoE layers, when enabled)."""
        cfg = self.config
        if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"x must be an integer tensor [batch, time], got {x.dtype} {tuple(x.shape)}")
        t = x.shape[1]
        if not 1 <= t <= cfg.seq_len:
            raise ValueError(f"sequence length must be in [1, seq_len = {cfg.seq_len}], got {t}")
        pos = torch.arange(t, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            block.aux_loss = None
            h = block(h)
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits
        if y.shape != x.shape:
            raise ValueError(f"y must have the shape of x {tuple(x.shape)}, got {tuple(y.shape)}")
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        self.last_lm_loss = float(loss.detach())
        aux = [b.aux_loss for b in self.blocks if b.aux_loss is not None]
        if aux:
            aux_mean = torch.stack(aux).mean()
            self.last_aux_loss = float(aux_mean.detach())
            loss = loss + cfg.aux_loss_coef * aux_mean
        return logits, loss

    # ----- MoE views -------------------------------------------------------------------------
    def moe_layers(self) -> list[tuple[str, MoELayer]]:
        return moe_layers(self)

    def moe_layout(self) -> dict[str, Any]:
        """``{"layers": {name: num_experts}, "top_k": k}``."""
        return {"layers": {n: layer.num_experts for n, layer in moe_layers(self)},
                "top_k": self.config.top_k}

    def routing_counts(self) -> dict[str, torch.Tensor | None]:
        """Global tokens per expert of every MoE layer in the last training forward."""
        return {n: layer.routing_counts for n, layer in moe_layers(self)}

    def set_placements(self, placements: Mapping[str, Placement] | Placement) -> dict[str, tuple[list[int], list[int]]]:
        """:meth:`MoELayer.set_placement` on every layer (collective; experts move by
        all-to-all). Returns ``{layer: (added, removed)}``; rebuild the optimizer after
        (``make_optimizer(model, ..., previous=old)``)."""
        plans = self._resolve_placements(placements)
        return {n: layer.set_placement(plans[n]) for n, layer in moe_layers(self)}

    def sync_gradients(self) -> None:
        sync_gradients(self, group=self.group)


# ----- training helpers ----------------------------------------------------------------------------
def _replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds a copy of: everything outside the MoE layers plus the
    routers, in named_parameters order (the experts are synced by their holders)."""
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    return [p for _, p in model.named_parameters() if id(p) not in experts and p.requires_grad]


def sync_gradients(model: nn.Module, *, group: Any = None) -> None:
    """Data-parallel gradient sync of the whole model (after ``backward``, every rank):
    the gradients of the replicated parameters (dense ones and the routers) are averaged
    over ``group`` with ONE flat all-reduce, then :meth:`MoELayer.sync_gradients` makes
    expert replicas identical (summed over holders, divided by the world size). With
    equal per-rank batches the step equals single-model training on the global batch.
    In a single process only the experts' (local, no-op) sync runs."""
    _, size = _world(group)
    for name, layer in moe_layers(model):
        if layer.grad_reduction != "mean":
            raise ValueError(f"{name}: sync_gradients averages, it needs grad_reduction='mean'")
    if size > 1:
        params = _replicated_parameters(model)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    sync_moe_gradients(model, include_router=False)


_NORM_HINT = re.compile(r"(^|\.)(ln\w*|norm\w*|layernorm\w*)\.")


def param_group_of(name: str, param: torch.Tensor) -> str:
    """``"decay"`` for weight matrices/embeddings (>= 2-D), ``"no_decay"`` for biases and
    norm parameters -- a rule on the name and shape only, so it holds for expert
    parameters a new placement adds."""
    if name.endswith("bias") or _NORM_HINT.search(name) or param.dim() < 2:
        return "no_decay"
    return "decay"


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1, *,
                   betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                   previous: torch.optim.Optimizer | None = None) -> torch.optim.AdamW:
    """AdamW with exactly two param groups, ``decay`` then ``no_decay`` (key ``"group"``),
    each listing the model's parameters sorted by name (natural order, so
    ``experts.10`` after ``experts.9``), whatever order experts were added in.

    ``previous``: the optimizer being replaced after a reconfiguration; the state of every
    parameter object still in the model (kept experts, dense weights) and each group's
    current ``lr`` carry over. New experts start with empty state (or load it, keyed by
    parameter name, from moc / their old holder).
    """
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    named = sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda t: _natural_key(t[0]))
    decay = [p for n, p in named if param_group_of(n, p) == "decay"]
    no_decay = [p for n, p in named if param_group_of(n, p) == "no_decay"]
    groups = [
        {"params": decay, "weight_decay": float(weight_decay), "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "group": "no_decay"},
    ]
    opt = torch.optim.AdamW(groups, lr=float(lr), betas=betas, eps=eps)
    if previous is not None:
        old_lr = {g.get("group"): g["lr"] for g in previous.param_groups}
        for g in opt.param_groups:
            if g["group"] in old_lr:
                g["lr"] = old_lr[g["group"]]
        for g in opt.param_groups:
            for p in g["params"]:
                if p in previous.state and previous.state[p]:
                    opt.state[p] = previous.state[p]
    return opt


def train_step(model: MoEGPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step: forward, backward, :func:`sync_gradients`, optimizer step. Returns this
    rank's loss (no gradient clipping: a local norm would differ between ranks)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    sync_gradients(model, group=getattr(model, "group", None))
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: MoEGPT, corpus: Any, *, batches: int = 4, batch_size: int = 32, seq_len: int | None = None,
             seed: int = 0, rank: int = 0, world: int = 1) -> float:
    """Mean validation cross-entropy (nats/byte) over ``batches`` global batches; every rank
    of the model's group must call it (the MoE layers communicate); the result is the
    global mean on all ranks."""
    was_training = model.training
    model.eval()
    seq_len = model.config.seq_len if seq_len is None else seq_len
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for i in range(batches):
            x, y = corpus.validation_batch(i, rank, world, batch_size, seq_len, seed=seed)
            logits = model(x)
            total[0] += F.cross_entropy(logits.reshape(-1, model.config.vocab), y.reshape(-1), reduction="sum").double()
            total[1] += y.numel()
    finally:
        model.train(was_training)
    if _world(model.group)[1] > 1:
        dist.all_reduce(total, group=model.group)
    return float(total[0] / total[1])


def routing_skew(counts: torch.Tensor | Sequence[int]) -> float:
    """Load skew of one layer: max / mean tokens per expert (1.0 = perfectly balanced,
    ``E`` = everything on one expert)."""
    c = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
    if c.numel() == 0:
        raise ValueError("counts must hold at least one expert")
    if bool((c < 0).any()):
        raise ValueError(f"counts must be >= 0, got {c.tolist()}")
    mean = float(c.mean())
    if mean == 0:
        raise ValueError("counts sum to zero: no tokens were routed")
    return float(c.max()) / mean


# ----- demo --------------------------------------------------------------------------------------
def _main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json

    from .corpus import ByteCorpus

    ap = argparse.ArgumentParser(prog="python -m examples.moe_gpt",
                                 description="Train the MoE GPT single-process on the stdlib corpus.")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--moe-every", type=int, default=1)
    ap.add_argument("--aux-loss-coef", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print one JSON summary")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = ByteCorpus()
    t_corpus = time.perf_counter() - t0
    cfg = GPTConfig(top_k=args.top_k, moe_every=args.moe_every, aux_loss_coef=args.aux_loss_coef, seed=args.seed)
    model = MoEGPT(cfg)
    opt = make_optimizer(model, args.lr)
    counts = {n: torch.zeros(cfg.num_experts, dtype=torch.int64) for n in moe_layer_names(cfg)}
    curve = []
    times = []
    for step in range(args.steps):
        x, y = corpus.batch(step, 0, 1, args.batch_size, cfg.seq_len, seed=args.seed)
        t = time.perf_counter()
        loss = train_step(model, opt, x, y)
        times.append(time.perf_counter() - t)
        for n, c in model.routing_counts().items():
            counts[n] += c
        curve.append(loss)
        if not args.json and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss:.4f}  {1e3 * times[-1]:.1f} ms")
    val = evaluate(model, corpus, seed=args.seed)
    times_sorted = sorted(times[1:] or times)
    summary = {
        "corpus": repr(corpus), "corpus_load_s": round(t_corpus, 4), "config": asdict(cfg),
        "params": sum(p.numel() for p in model.parameters()),
        "loss_first": curve[0], "loss_last10_mean": sum(curve[-10:]) / len(curve[-10:]), "val_loss": val,
        "step_ms_median": 1e3 * times_sorted[len(times_sorted) // 2],
        "routing_counts": {n: c.tolist() for n, c in counts.items()},
        "routing_skew": {n: round(routing_skew(c), 3) for n, c in counts.items()},
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
