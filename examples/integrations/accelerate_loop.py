"""An Accelerate training loop with commsched, in Accelerate's own idiom
(``Accelerator.prepare``, ``accelerator.backward``); nothing of commsched in the loop.

    COMMSCHED=1 accelerate launch --multi_gpu --num_processes 2 -m commsched.run accelerate_loop.py

``prepare`` wraps the model in DistributedDataParallel where the launch is distributed,
and the launcher puts commsched's hook on it. Rank 0 prints each step's loss; ``--out
PREFIX`` writes, per rank, ``PREFIX.rankN.json`` with the losses, the comm hooks on the
prepared model and a checksum of the final parameters.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", help="write PREFIX.rankN.json per rank")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64 * args.steps, 16),
                                          torch.randn(64 * args.steps, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, (x, y) in zip(range(args.steps), loader):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {step + 1} loss {losses[-1]!r}")
    if args.out:
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        hooks = [getattr(hook, "__qualname__", repr(hook))
                 for hook, _ in getattr(model, "_comm_hooks", ())]
        with open(f"{args.out}.rank{accelerator.process_index}.json", "w") as f:
            json.dump({"rank": accelerator.process_index, "world": accelerator.num_processes,
                       "losses": losses, "hooks": hooks, "checksum": checksum,
                       "pid": os.getpid()}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
