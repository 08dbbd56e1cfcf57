"""Packed sequences of `seq_len + 1` tokens (inputs and shifted targets), and the held-out set.

A dataset is an indexable set of such sequences; training reads them through the data slots
(`slot_loader.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from prime_train.tokens import DataError


class Sequences(Protocol):
    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> torch.Tensor: ...


class TokenSequences:
    """Sequences packed back to back from a memory-mapped token array."""

    def __init__(self, path: Path, seq_len: int):
        self.tokens = np.load(path, mmap_mode="r")
        self.seq_len = seq_len
        self._n = (len(self.tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self._n:
            raise IndexError(i)
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class SyntheticSequences:
    """Uniform random tokens; sequence i depends only on (seed, i). For benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, n: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self._n = vocab_size, seq_len, seed, n
        self._gen = torch.Generator()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> torch.Tensor:
        self._gen.manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=self._gen)


def eval_batches(
    data: Sequences, batch_size: int, batches: int, shard: int = 0, num_shards: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: the first `batches` batches of shard `shard` of `num_shards`
    (every `num_shards`-th sequence), the same every time."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
    n = min(batches, len(data) // num_shards // batch_size)
    if n == 0:
        raise DataError(
            f"too little held-out data: {len(data)} sequences of {data.seq_len + 1} tokens give "
            f"no batch of {batch_size} for each of {num_shards} rank(s); add text or lower "
            "train.batch_size / data.seq_len"
        )
    out = []
    for b in range(n):
        idx = [shard + num_shards * (b * batch_size + j) for j in range(batch_size)]
        seqs = torch.stack([data[i] for i in idx])
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out
