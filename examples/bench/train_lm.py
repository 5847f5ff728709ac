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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

SEED = 1234         # as the harness: the same weights and batches as its llama_lib modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny GPT in plain PyTorch (no transformers needed)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(SEED)
    with device:
        if args.quick:
            shape = {"seq": 64, "micro_batch": 2, "vocab_size": 4096}
            model = models.GPT(models.GPTConfig(layers=2, hidden=128, heads=4, seq=64,
                                                vocab=4096))
        else:
            shape = models.LLAMA_SHAPE
            model = models.llama_lm(shape)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                  **({"fused": True} if cuda else {}))
    generator = torch.Generator(device=device)
    generator.manual_seed(SEED + 1 + rank)
    size = (shape["micro_batch"], shape["seq"])
    tokens = torch.randint(0, shape["vocab_size"], size, device=device, generator=generator)
    targets = torch.randint(0, shape["vocab_size"], size, device=device, generator=generator)
    loss = None
    for _ in range(args.steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if rank == 0 and loss is not None:
        print(f"loss after {args.steps} steps: {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
