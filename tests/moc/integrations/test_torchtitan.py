"""moc as torchtitan's checkpointer (moc.integrations.torchtitan.MoCCheckpointManager).

torchtitan 0.3.0 itself (installed by `make install` with --no-deps, see the Makefile): its
DeepSeek-V3 model with GroupedExperts under FSDP2 on 2 gloo ranks, its optimizer, LR
scheduler and data loader, SIGKILLed after step 5 (newest checkpoint: step 4), restored in
new processes into a differently initialised model, compared tensor by tensor.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if sys.version_info < (3, 11):   # torchtitan 0.3 requires Python >= 3.11; the Makefile installs it there
    pytest.skip("torchtitan 0.3 needs Python >= 3.11", allow_module_level=True)

from tests.conftest import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "workers" / "titan_worker.py"


def _run(args: list[str], world: int = 2, timeout: float = 240) -> list[int]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env))
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(600)
def test_torchtitan_deepseek_v3_fsdp2_sigkill_resume_is_exact(tmp_path):
    store, shm, dump = tmp_path / "store", tmp_path / "shm", tmp_path / "dump"
    dump.mkdir()
    common = ["--store", str(store), "--shm", str(shm), "--dump", str(dump), "--steps", "7"]
    assert _run([*common, "--tag", "a", "--kill-at", "5"]) == [-9, -9], "both ranks die by SIGKILL"
    assert _run([*common, "--tag", "b"]) == [0, 0]

    saved, restored = _load(dump / "a-4.pt"), _load(dump / "b-restored.pt")
    # The restoring processes started from other random weights: everything equal to the
    # killed run's step 4 came from moc (weights, expert_bias_E buffers, AdamW moments and
    # step counts, the LR schedule, torchtitan's train_state).
    assert set(restored) == set(saved) - {"batch"}
    experts = [k for k in saved if k.startswith("model/") and ".routed_experts.inner_experts.w" in k]
    assert len(experts) == 6 and all(saved[k].shape[0] == 8 for k in experts), experts
    assert any(k.endswith("expert_bias_E") for k in saved)
    for key, value in saved.items():
        if key != "batch":
            assert torch.equal(restored[key], value), f"{key}: restored differs from the step-4 state"
    assert restored["train_state"].tolist() == [4, 4 * 2 * (2 * 17)], "step, ntokens_seen (2 ranks x 2 x 17)"

    # The resumed run sees the batches the killed run saw at steps 5 (data loader position
    # restored) and reaches the same state bit for bit.
    a5, b5 = _load(dump / "a-5.pt"), _load(dump / "b-5.pt")
    assert torch.equal(a5["batch"], b5["batch"]), "step 5 must train on the same global batch"
    assert not torch.equal(_load(dump / "a-4.pt")["batch"], b5["batch"])
    for key, value in a5.items():
        assert torch.equal(b5[key], value), f"{key}: the resumed step 5 differs from the uninterrupted one"
    assert (dump / "b-7.pt").exists() and not (dump / "b-4.pt").exists(), "resumed at step 5, ran to 7"


def test_config_errors_name_the_field(tmp_path):
    from moc import MoCConfig
    from moc.integrations.torchtitan import MoCCheckpointManager

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=None, states={})
    moc_cfg = MoCConfig(storage=str(tmp_path / "s"))
    with pytest.raises(ValueError, match=r"checkpoint\.load_step=3.*allowed: -1"):
        MoCCheckpointManager.Config(enable=True, load_step=3, moc=moc_cfg).build(**kw)
    with pytest.raises(ValueError, match=r"checkpoint\.create_seed_checkpoint=True.*allowed: False"):
        MoCCheckpointManager.Config(enable=True, create_seed_checkpoint=True, moc=moc_cfg).build(**kw)
    with pytest.raises(ValueError, match="model_parts has 2 parts"):
        MoCCheckpointManager.Config(enable=True, moc=moc_cfg).build(**{**kw, "model_parts": [model, model]})
    # Disabled: builds nothing, load/save are no-ops (torchtitan's contract).
    off = MoCCheckpointManager.Config(moc=moc_cfg).build(**kw)
    assert off.load() is False and off.save(1) is False and off.manager is None
    assert not (tmp_path / "s").exists()
