"""A plain DDP training script with no commsched in it: the Llama-architecture decoder of
``models.llama_lm`` (or, with ``--quick``, a tiny GPT in plain PyTorch), a fixed random
batch per rank, bf16 autocast on CUDA, fused AdamW, no synchronisation inside the loop. For
``commsched floor``, the launcher and telemetry, on the workload the harness calls
``llama_lib``:

    torchrun --standalone --nproc-per-node 2 examples/bench/train_lm.py --steps 40
    commsched floor --standalone --nproc-per-node 2 examples/bench/train_lm.py
    COMMSCHED=1 COMMSCHED_TELEMETRY_DIR=runs/a torchrun --standalone --nproc-per-node 2 \\
        -m commsched.run examples/bench/train_lm.py

NCCL on one GPU per rank where there are GPUs, else gloo on CPU. Prints the last loss.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

SEED = 1234         # as the harness: the same weights and batches as its llama_lib modes


def build(quick: bool, device: torch.device, model: str = "llama"):
    """The model on ``device`` (from ``SEED``) and its shape: seq, micro_batch, vocab_size."""
    torch.manual_seed(SEED)
    with device:
        if model in models.GPT2_SHAPES and not quick:
            return models.gpt2_lm(models.GPT2_SHAPES[model]), models.GPT2_SHAPES[model]
        if quick:
            return (models.GPT(models.GPTConfig(layers=2, hidden=128, heads=4, seq=64,
                                                vocab=4096)),
                    {"seq": 64, "micro_batch": 2, "vocab_size": 4096})
        return models.llama_lm(models.LLAMA_SHAPE), models.LLAMA_SHAPE


def batch(shape: dict, device: torch.device, rank: int):
    """This rank's fixed random batch, as the harness draws it."""
    generator = torch.Generator(device=device)
    generator.manual_seed(SEED + 1 + rank)
    return models.lm_batch(shape["vocab_size"], shape["micro_batch"], shape["seq"], device,
                           generator)


def train(model, optimizer, tokens, targets, steps: int, cuda: bool):
    """``steps`` training steps with no synchronisation (the host runs ahead of the
    device, as in training); the last loss."""
    loss = None
    for _ in range(steps):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = models.lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny GPT in plain PyTorch (no transformers needed)")
    parser.add_argument("--model", choices=("llama", *models.GPT2_SHAPES), default="llama",
                        help="the Llama-architecture decoder (default), or GPT-2 small or "
                             "medium from transformers (micro-batch 8, sequence 1024)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, shape = build(args.quick, device, args.model)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                  **({"fused": True} if cuda else {}))
    tokens, targets = batch(shape, device, rank)
    loss = train(model, optimizer, tokens, targets, args.steps, cuda)
    if rank == 0 and loss is not None:
        print(f"loss after {args.steps} steps: {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
