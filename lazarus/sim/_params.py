"""Model presets and default performance parameters, each with its source.

"paper" = the Lazarus paper (shared/papers/000_*), "MoC" = the MoC-System paper
(shared/papers/004_*), "bench" = this project's benchmarks/README.md (AMD EPYC, 2 cores,
torch 2.13.0+cpu). "assumed" marks a value no source pins down; change it with
``--config``.
"""

from __future__ import annotations

from ._config import ModelSpec, PerfParams

# Bytes per parameter of weights + optimizer state: fp16 weights + fp32 master + Adam
# (2 + 4 + 8 = 14). Paper Table 2: one expert's weights + optimizer states are 63 MB
# (GPT-S, 4.72 M params) and 112 MB (GPT-L, 8.39 M params) = 14.0 bytes/param in MiB.
_B = 14.0

# Share of a balanced step that scales with the most loaded rank's expert work. bench
# (dispatcher (b)): traditional EP forward grows 1.28x at max/mean 2.28 and 2.09x at 4.0,
# i.e. 0.22-0.36 of the step per unit of imbalance; 0.3 also reproduces the paper's
# GPT-M gap at 10 nodes (Lazarus 45 vs DS 34 samples/s, paper section 6.2: 1.32x).
_PHI = 0.3

GPT_S = ModelSpec(
    name="gpt-s",
    num_experts=8,  # paper Table 1
    moe_layers=12,  # paper Table 1 (every layer MoE: 12 x 8 x 4.72 M + 67 M = 521 M params)
    expert_params=2 * 768 * 3072,  # GPT-2 FFN at feature dim 768 (paper Table 1)
    non_expert_params=67e6,  # 521 M total (paper Table 1) minus the experts
    bytes_per_param=_B,
    gpus_per_node=1,  # paper 6.1: each RTX 3090 is treated as one node
    slots_per_node=6,  # paper 6.1: 6 replica slots per GPU
    samples_per_node_step=4,  # paper 6.1: per-GPU batch 4, sequence 1024
    # paper 6.2: Lazarus ran 2926 GPT-S steps in 30 min (incl. ~5 reconfigurations)
    step_s=0.55,
    ref_nodes=10,
    expert_fraction=_PHI,
)
GPT_M = ModelSpec(
    name="gpt-m",
    num_experts=12,  # paper Table 1
    moe_layers=12,
    expert_params=2 * 1024 * 4096,  # feature dim 1024 (paper Table 1)
    non_expert_params=103e6,  # 1.3 B total minus 12 x 12 x 8.39 M experts
    bytes_per_param=_B,
    gpus_per_node=1,
    slots_per_node=6,
    samples_per_node_step=4,
    # paper 6.2: Lazarus 45 samples/s on 10 GPUs (40 samples/step) -> 0.89 s with skew
    step_s=0.83,
    ref_nodes=10,
    expert_fraction=_PHI,
)
GPT_L = ModelSpec(
    name="gpt-l",
    num_experts=16,  # paper Table 1
    moe_layers=12,
    expert_params=2 * 1024 * 4096,
    non_expert_params=103e6,  # 1.7 B total minus 12 x 16 x 8.39 M experts
    bytes_per_param=_B,
    gpus_per_node=1,
    slots_per_node=6,
    samples_per_node_step=4,
    # paper 6.2: Lazarus ran 1996 GPT-L steps in 30 min; same FLOPs per token as GPT-M
    step_s=0.83,
    ref_nodes=10,
    expert_fraction=_PHI,
)
DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3",
    num_experts=256,  # DeepSeek-V3 report: 256 routed experts per MoE layer
    moe_layers=58,  # DeepSeek-V3 report: 61 layers, the first 3 dense
    expert_params=3 * 7168 * 2048,  # SwiGLU expert, hidden 7168, expert dim 2048
    non_expert_params=17e9,  # 671 B total minus 58 x 256 x 44 M routed experts
    bytes_per_param=_B,
    gpus_per_node=8,  # paper 6.7: 8 H200 per node
    slots_per_node=32,  # paper 6.7: 4 expert replicas per GPU
    # DeepSeek-V3 report: 14.8 T tokens in 2.664 M H800 GPU-hours of pre-training =
    # 1,543 tokens/GPU/s = 3.0 samples of 4,096 tokens per node per second.
    samples_per_node_step=16,
    step_s=5.3,
    ref_nodes=256,  # DeepSeek-V3 was trained on 2,048 GPUs
    expert_fraction=0.5,  # assumed: routed experts + all-to-all are about half the step
    comm_per_doubling=0.03,  # assumed: all-to-all grows slightly with cluster size
    top_k=8,
    sim_layers=8,  # placement/skew simulated on 8 representative layers, costs scaled to 58
)

# DeepSeekMoE 16B (DeepSeekMoE paper, arXiv 2401.06066): the model of MoEvement's ETTR
# figure (arXiv 2412.15411: ETTR >= 0.94 at an MTBF of 10 minutes). Cluster and step assumed.
DEEPSEEK_16B = ModelSpec(
    name="deepseek-16b",
    num_experts=64,  # DeepSeekMoE 16B: 64 routed experts per MoE layer (2 shared: counted below)
    moe_layers=27,  # 28 layers, the first dense
    expert_params=3 * 2048 * 1408,  # SwiGLU expert, hidden 2048, expert dim 1408
    non_expert_params=16.4e9 - 27 * 64 * 3 * 2048 * 1408,  # 16.4 B total minus the routed experts
    bytes_per_param=_B,
    gpus_per_node=8,  # assumed: 8 nodes of 8 GPUs
    slots_per_node=16,  # assumed: 2 expert replicas per GPU (f = 2 fits on 8 nodes)
    samples_per_node_step=128,  # assumed: 8 x 128 sequences of 4,096 tokens = 4.2 M tokens per step
    step_s=3.0,  # assumed: 6 x 2.8 B active params x 4.2 M tokens at ~400 TFLOP/s per GPU on 64 GPUs
    ref_nodes=8,
    expert_fraction=0.5,  # assumed, as DeepSeek-V3
    top_k=6,
    sim_layers=4,  # placement/skew simulated on 4 representative layers, costs scaled to 27
)

PRESETS: dict[str, ModelSpec] = {m.name: m for m in (GPT_S, GPT_M, GPT_L, DEEPSEEK_V3, DEEPSEEK_16B)}

DEFAULT_PERF = PerfParams(
    detect_s=15.0,  # paper 6.3: 10-20 s for enqueued NCCL kernels to time out
    restart_s=60.0,  # assumed: relaunch processes, CUDA/NCCL init, rebuild model (not measured here)
    reconfig_s=10.0,  # paper 6.3: 5-15 s to rebuild NCCL groups (ours on gloo: ~50 ms, DESIGN 5)
    rebalance_s=2.0,  # assumed: planned regroup between steps (no timeout to wait out)
    transfer_gbps=2.36,  # paper Table 2: 160 x 112 MB experts moved in 7.6 s (GPT-L, step 200)
    storage_write_gbps=1.25,  # paper 6.1: NFS server behind a 10 Gbps NIC
    storage_read_gbps=1.25,  # paper 6.1: same NFS server
    memory_read_gbps=2.14,  # bench: MoC restore from shared-memory snapshot, 1,462 MB in 0.683 s, measured
    # before restores read the mapped snapshot directly (now 0.29-0.35 s): conservative, kept so the
    # recorded simulator results stay reproducible
    snapshot_gbps=12.0,  # assumed: effective pinned GPU->CPU copy over PCIe per node
    fb_fraction=0.66,  # assumed: forward+backward share of a step that a snapshot can overlap
    ckpt_call_s=0.010,  # bench: MoC K=1 "loop blocked" 10.0-10.7 ms per checkpoint
    dispatch_overhead=0.03,  # paper 6.5.1: "small overhead" of the dispatcher at 1:1 (assumed 3%)
    join_window_s=120.0,  # paper 6.4: all methods wait 2 minutes before scaling up
    ds_interval_steps=50,  # paper 6.1: DS checkpoints every 50 steps
    ft_interval_steps=250,  # paper 6.1: DS(FT) every 250 steps
    lazarus_interval_steps=250,  # paper 6.4: Lazarus fallback checkpoints every 250 steps
    moc_interval_divisor=5,  # assumed: MoC checkpoints 5x as often (they cost ~1-2% of a full one)
    rebalance_every_steps=200,  # paper 6.1: Lazarus rebalances every 200 steps
    skew_epoch_steps=200,  # assumed: routing loads drift on the rebalance time scale
    min_replicas=2,  # paper 6.1: f = 2
    k_persist=1,  # bench / MoC: K=1 persisted expert per layer
    persist_every=4,  # bench: "2 levels" rows persist every 4th snapshot
    plt_threshold=0.0375,  # MoC 4.2: PLT below 3.75% keeps accuracy
    dynamic_k=True,  # MoC 5.3: double K when PLT crosses the threshold
    exact_window_steps=8,  # issue 22 / benchmarks/exact: W = 8 (k_snapshot = E / 8)
    exact_weight_bytes=4.0,  # moc exact mode captures the state_dict tensors: fp32 parameters
    # (FSDP2 mixed precision keeps fp32 parameters; MoEvement captures 2-byte compute weights)
)

# DeepSeek-V3-like cluster (paper 6.7: 8 x H200 and 8 x 400 Gbps NICs per node).
DEEPSEEK_PERF = DEFAULT_PERF.with_overrides({
    "restart_s": 180.0,  # assumed: relaunching a 64-128 node job takes minutes
    "reconfig_s": 20.0,  # assumed: paper 6.3's upper range at larger scale
    "transfer_gbps": 400.0,  # assumed: aggregate; one node alone has 8 x 400 Gbps = 400 GB/s
    "storage_write_gbps": 200.0,  # assumed: a parallel file system's aggregate write rate
    "storage_read_gbps": 400.0,  # assumed: reads twice as fast as writes
    "memory_read_gbps": 20.0,  # assumed: host memory -> GPU per node
    "snapshot_gbps": 100.0,  # assumed: 8 GPUs x PCIe 5 copies per node
})

# The 8-node DeepSeekMoE 16B cluster: a parallel file system and per-node copies as above.
DEEPSEEK_16B_PERF = DEFAULT_PERF.with_overrides({
    "storage_write_gbps": 10.0,  # assumed: a parallel file system's share for an 8-node job
    "storage_read_gbps": 20.0,  # assumed: reads twice as fast as writes
    "memory_read_gbps": 20.0,  # assumed: host memory -> GPU per node (as DeepSeek-V3)
    "snapshot_gbps": 100.0,  # assumed: 8 GPUs x PCIe 5 copies per node (as DeepSeek-V3)
    "transfer_gbps": 400.0,  # assumed: 8 x 400 Gbps NICs per node (as DeepSeek-V3)
})

PRESET_PERF: dict[str, PerfParams] = {"deepseek-v3": DEEPSEEK_PERF, "deepseek-16b": DEEPSEEK_16B_PERF}


def preset(name: str) -> tuple[ModelSpec, PerfParams]:
    """The model preset ``name`` and its default performance parameters."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"--model must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[key], PRESET_PERF.get(key, DEFAULT_PERF)
