"""Simulator inputs with round numbers, shared by the simulator's tests
(tests/lazarus/sim): 1 s per step, 1 GB of state, 1 GB/s storage, checkpoints every 5 steps."""

from __future__ import annotations

from lazarus.sim import ModelSpec, PerfParams, SkewSpec

# A model whose costs are round numbers: 1 s per step, 1 GB of state, 1 GB/s storage.
TINY = ModelSpec(name="tiny", num_experts=2, moe_layers=1, expert_params=0.5e9, non_expert_params=0,
                 bytes_per_param=1.0, gpus_per_node=1, slots_per_node=1, samples_per_node_step=1,
                 step_s=1.0, ref_nodes=2, expert_fraction=0.0)
PERF = PerfParams(detect_s=2.0, restart_s=10.0, reconfig_s=3.0, rebalance_s=0.0, transfer_gbps=1e6,
                  storage_write_gbps=1.0, storage_read_gbps=1.0, memory_read_gbps=1.0, snapshot_gbps=1.0,
                  fb_fraction=1.0, ckpt_call_s=0.0, dispatch_overhead=0.0, join_window_s=4.0,
                  ds_interval_steps=5, ft_interval_steps=5, lazarus_interval_steps=5,
                  moc_interval_divisor=1, rebalance_every_steps=10**6, skew_epoch_steps=10**6,
                  min_replicas=2, dynamic_k=False)
FLAT = SkewSpec(zipf_s=0.0, drift=0.0)
