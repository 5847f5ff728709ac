"""Small models the tests share (not named `models`: tests import examples/bench/models.py
by that name)."""

import torch


def tiny_mlp(width: int = 8) -> torch.nn.Sequential:
    """Linear(4, width), ReLU, Linear(width, 2), seeded: the same weights on every call and
    every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 2))
