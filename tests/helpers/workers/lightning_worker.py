"""A user's Lightning script with moc's callback (tests/moc/integrations/test_lightning.py).

A LightningModule around a tiny random qwen3_moe, a shuffling DataLoader (order drawn from
the global RNG), gradient accumulation 2, and ``callbacks=[MoCCallback(...)]``. Records per
optimizer step the samples trained, the loss and hashes of the model and optimizer state;
``--kill-at N`` SIGKILLs the process at the end of step N (after moc's ``step()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import warnings

import lightning.pytorch as pl
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moc import MoCConfig
from moc.integrations.lightning import MoCCallback


from hf_trainer_worker import SAMPLES, SEQ, VOCAB, digest  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        self.model = AutoModelForCausalLM.from_config(config)
        self.seen: list[str] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        self.seen += [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:12] for row in ids]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.last_loss = float(loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    def __init__(self, kill_at: int | None, out: str) -> None:
        self.kill_at, self.out = kill_at, out
        self.rec: dict = {"steps": {}, "resumed": None}
        self.last = None

    def _hashes(self, module):
        opt = module.trainer.optimizers[0]
        state = []
        for _, p in sorted(module.named_parameters()):
            st = opt.state.get(p, {})
            state += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        return digest(p for _, p in sorted(module.state_dict().items())), digest(state)

    def on_fit_start(self, trainer, module):
        m, o = self._hashes(module)
        self.rec["resumed"] = {"global_step": trainer.global_step, "model": m, "optimizer": o,
                               "epoch": trainer.current_epoch}
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.last:
            return
        self.last = trainer.global_step
        m, o = self._hashes(module)
        self.rec["steps"][str(trainer.global_step)] = {
            "samples": module.seen, "loss": module.last_loss, "model": m, "optimizer": o,
            "lr": trainer.optimizers[0].param_groups[0]["lr"], "epoch": trainer.current_epoch}
        module.seen = []
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.rec, f)
        os.replace(tmp, self.out)
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-at", type=int)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = Module()
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1234))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2, shuffle=True)
    moc_cb = MoCCallback(MoCConfig(storage=a.storage, interval=4, k_snapshot=None, persist_every=2, top_k=2))
    trainer = pl.Trainer(max_epochs=3, accumulate_grad_batches=2, callbacks=[moc_cb, Recorder(a.kill_at, a.out)],
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         default_root_dir=os.path.dirname(a.out))
    trainer.fit(module, loader)
    rec = json.load(open(a.out))
    report = moc_cb.last_restore_report
    rec["final"] = {"global_step": trainer.global_step, "resumed_step": moc_cb.resumed_step,
                    "report": None if report is None else str(report),
                    "filters_left": sum("resuming" in str(getattr(f[1], "pattern", "")) for f in warnings.filters)}
    with open(a.out, "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
