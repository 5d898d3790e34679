"""A user's transformers.Trainer script with moc's callback (tests/moc/integrations/test_transformers.py).

A tiny random qwen3_moe, trained by a real ``transformers.Trainer`` whose only moc line is
``callbacks=[MoCCallback(...)]``. It records, per optimizer step, the hashes of the samples
each micro-batch held, the loss, the learning rate and ``state.epoch``, plus hashes of the
model and optimizer state after every step and right after ``train()`` began (after a
restore). ``--kill-at N`` SIGKILLs the process itself at the end of step N (after moc's
``step()`` ran), as a crash would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from moc import MoCConfig
from moc.integrations.transformers import MoCCallback

SAMPLES, SEQ, VOCAB = 24, 16, 128


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_hash(model) -> str:
    return digest(p for _, p in sorted(model.state_dict().items()))


def optimizer_hash(model, optimizer) -> str:
    opt = getattr(optimizer, "optimizer", optimizer)
    out = []
    for _, p in sorted(model.named_parameters()):
        st = opt.state.get(p, {})
        out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    return digest(out)


class Recorder(TrainerCallback):
    def __init__(self, model, kill_at: int | None, out: str) -> None:
        self.kill_at, self.out = kill_at, out
        self.rec: dict = {"steps": {}, "resumed": None}
        self.current: list[str] = []
        model.register_forward_pre_hook(self._batch, with_kwargs=True)

    def _batch(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        self.current += [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:12] for row in ids]

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.rec["resumed"] = {"global_step": state.global_step, "model": model_hash(model),
                               "optimizer": optimizer_hash(model, optimizer)}

    def on_step_begin(self, args, state, control, **kw):
        self.current = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.rec["steps"][state.global_step] = {
            "samples": self.current, "epoch": state.epoch, "lr": lr_scheduler.get_last_lr()[0],
            "model": model_hash(model), "optimizer": optimizer_hash(model, optimizer)}
        self.dump()
        if state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def dump(self) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.rec, f)
        os.replace(tmp, self.out)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.rec["steps"].setdefault(state.global_step, {})["loss"] = logs["loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-strategy", default="no")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(a.out), "trainer-out"),
                             per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             num_train_epochs=a.epochs, learning_rate=3e-3, lr_scheduler_type="linear",
                             warmup_steps=2, logging_steps=1, save_strategy=a.save_strategy, save_steps=5,
                             report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    recorder = Recorder(model, a.kill_at, a.out)
    moc_cb = MoCCallback(MoCConfig(storage=a.storage, interval=4, k_snapshot=None, persist_every=2, top_k=2))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[moc_cb, recorder])
    out = trainer.train()
    report = moc_cb.last_restore_report
    recorder.rec["final"] = {"global_step": trainer.state.global_step, "train_loss": out.training_loss,
                             "resumed_step": moc_cb.resumed_step, "report": None if report is None else str(report),
                             "trainer_log_filters": len(logging.getLogger("transformers.trainer").filters)}
    recorder.dump()


if __name__ == "__main__":
    main()
