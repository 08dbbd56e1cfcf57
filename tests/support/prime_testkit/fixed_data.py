"""Test inputs that are the same on every machine (for digests pinned in tests)."""

from __future__ import annotations

import torch


def pseudo_random(n: int) -> torch.Tensor:
    """Uniform-looking floats from exact integer arithmetic: the same on every machine."""
    i = torch.arange(n, dtype=torch.int64)
    s = (i * 2654435761 + 12345) % 1000003
    s = (s * s + 7919 * i) % 1000003
    return (s.to(torch.float64) / 1000003 - 0.5).float()


class IndexDataset:
    """A dataset of `n` sequences of one token: sequence i holds token i (and i as its target)."""

    seq_len = 1

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i])
