"""PyTorch Lightning with commsched, in Lightning's own idiom: a LightningModule and a
Trainer, nothing of commsched in the training code.

Under the launcher (every rank gets the hook at its DDP model's first forward)::

    COMMSCHED=1 python -m commsched.run lightning_train.py --devices 2     # Lightning's own
    COMMSCHED=1 python -m commsched.run lightning_train.py --devices 2 --strategy ddp_spawn
    COMMSCHED=1 torchrun --nproc-per-node 2 -m commsched.run lightning_train.py --devices 2

Lightning's own convention, without the launcher (Lightning registers comm hooks on CUDA
only)::

    python lightning_train.py --accelerator gpu --devices 1 --comm-state commsched

``--comm-state commsched`` passes ``DDPStrategy(ddp_comm_state=CommschedState(module),
ddp_comm_hook=commsched_hook)``, the state built from the LightningModule before the Trainer
starts; ``--comm-state none`` passes ``ddp_comm_state=None`` with the same hook (an error
that says what to pass). Rank 0 prints each step's loss; ``--out PREFIX`` writes, per rank,
``PREFIX.rankN.json`` with the losses, the comm hooks on the DDP model and a checksum of
the final parameters.
"""

import argparse
import json
import os

import torch
import torch.nn as nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:                     # the standalone distribution
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy


class Regressor(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Record(pl.Callback):
    """Each step's loss, and the comm hooks on the DDP model while it trains; written at the
    end of training by every rank (a ddp_spawn worker runs only the fit)."""

    def __init__(self, out):
        self.out = out
        self.losses = []
        self.hooks = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = float(outputs["loss"])
        self.losses.append(loss)
        self.hooks = [getattr(hook, "__qualname__", repr(hook))
                      for hook, _ in getattr(trainer.strategy.model, "_comm_hooks", ())]
        if trainer.global_rank == 0:
            print(f"step {len(self.losses)} loss {loss!r}", flush=True)

    def on_train_end(self, trainer, module):
        if self.out:
            checksum = sum(float(p.detach().double().sum()) for p in module.parameters())
            with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
                json.dump({"rank": trainer.global_rank, "world": trainer.world_size,
                           "losses": self.losses, "hooks": self.hooks,
                           "checksum": checksum, "pid": os.getpid()}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn"])
    parser.add_argument("--comm-state", choices=["commsched", "none"],
                        help="Lightning's convention: DDPStrategy(ddp_comm_state=..., "
                             "ddp_comm_hook=commsched_hook)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", help="write PREFIX.rankN.json per rank")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(64 * args.steps, 16),
                                          torch.randn(64 * args.steps, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    module = Regressor(args.lr)
    strategy = args.strategy
    if args.comm_state is not None or strategy == "ddp":
        kwargs = {"start_method": "spawn"} if strategy == "ddp_spawn" else {}
        if args.comm_state is not None:
            from commsched.hooks import CommschedState, commsched_hook

            kwargs.update(ddp_comm_hook=commsched_hook, ddp_comm_state=(
                CommschedState(module) if args.comm_state == "commsched" else None))
        strategy = DDPStrategy(**kwargs)
    record = Record(args.out)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                         max_steps=args.steps, callbacks=[record], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)


if __name__ == "__main__":
    main()
