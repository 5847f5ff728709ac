"""Hugging Face ``Trainer`` with commsched, in the Trainer's own idiom: a small GPT-2 built
from a config (random weights, no download) trained on random tokens; nothing of commsched
in the script.

    COMMSCHED=1 torchrun --nproc-per-node 2 -m commsched.run hf_trainer.py
    COMMSCHED=1 accelerate launch --multi_gpu --num_processes 2 -m commsched.run hf_trainer.py

(``--multi_gpu`` starts one process per rank on CPU too; ``accelerate launch --cpu`` starts
one process whatever ``--num_processes`` says.) Rank 0 prints the loss the Trainer logs at
every step; ``--out PREFIX`` writes, per rank, ``PREFIX.rankN.json`` with those losses, the
comm hooks on the Trainer's DDP model and a checksum of the final parameters.
"""

import argparse
import json
import os
import tempfile

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (the Trainer shards them)."""

    def __init__(self, count: int, length: int, vocab: int):
        self.ids = torch.randint(vocab, (count, length),
                                 generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """The logged losses, and the comm hooks on the Trainer's DDP model (``trainer`` is set
    once the Trainer exists)."""

    def __init__(self, out):
        self.out, self.trainer, self.losses, self.hooks = out, None, [], None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            if state.is_world_process_zero:
                print(f"step {state.global_step} loss {logs['loss']!r}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        self.hooks = [getattr(hook, "__qualname__", repr(hook))
                      for hook, _ in getattr(wrapped, "_comm_hooks", ())]

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.out:
            checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
            with open(f"{self.out}.rank{args.process_index}.json", "w") as f:
                json.dump({"rank": args.process_index, "world": args.world_size,
                           "losses": self.losses, "hooks": self.hooks, "checksum": checksum,
                           "pid": os.getpid()}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="write PREFIX.rankN.json per rank")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    record = Record(args.out)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=4,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0,
            disable_tqdm=True)
        trainer = Trainer(model=model, args=training, callbacks=[record],
                          train_dataset=Tokens(4 * 2 * args.steps, 16, config.vocab_size))
        record.trainer = trainer
        trainer.train()


if __name__ == "__main__":
    main()
