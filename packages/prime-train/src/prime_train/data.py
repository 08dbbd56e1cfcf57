"""Packed sequences, sharded by node and rank, with an exact resumable position.

A dataset is an indexable set of sequences of `seq_len + 1` tokens (inputs and shifted
targets). The loader walks a seeded permutation of them per epoch; shard `s` of `n` takes
every n-th entry, so shards never overlap and the order depends only on (seed, epoch).
Its whole position is `{"epoch", "pos"}`: saving and restoring that resumes exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

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


def data_part(node: int, nodes: int, rank: int, ranks: int) -> tuple[int, int]:
    """(part, parts): local rank `rank` of node `node` reads part `node * ranks + rank` of
    `nodes * ranks`, so no two ranks of a run read the same sequence (until it wraps around)."""
    if not (0 <= node < nodes and 0 <= rank < ranks):
        raise ValueError(f"node {node} of {nodes}, rank {rank} of {ranks}: out of range")
    return node * ranks + rank, nodes * ranks


class ShardedLoader:
    """Batches of `batch_size` sequences for one shard, in a per-epoch seeded order."""

    def __init__(
        self,
        data: Sequences,
        batch_size: int,
        shard: int = 0,
        num_shards: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} outside 0..{num_shards - 1}")
        self.data, self.batch_size = data, batch_size
        self.shard, self.num_shards, self.seed, self.shuffle = shard, num_shards, seed, shuffle
        self.per_shard = len(data) // num_shards
        if self.per_shard < batch_size:
            raise DataError(
                f"too little data: {len(data)} sequences of {data.seq_len + 1} tokens give "
                f"{self.per_shard} per shard ({num_shards} shards) but a batch needs {batch_size}; "
                "add text or lower train.batch_size / data.seq_len"
            )
        self.epoch, self.pos = 0, 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _index(self, k: int) -> int:
        """Dataset index of the k-th sequence of this shard in the current epoch."""
        if not self.shuffle:
            return self.shard + self.num_shards * k
        if self._order_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            self._order = torch.randperm(len(self.data), generator=g)
            self._order_epoch = self.epoch
        return int(self._order[self.shard + self.num_shards * k])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64."""
        if self.pos + self.batch_size > self.per_shard:
            self.epoch, self.pos = self.epoch + 1, 0
        seqs = torch.stack([self.data[self._index(self.pos + j)] for j in range(self.batch_size)])
        self.pos += self.batch_size
        return seqs[:, :-1], seqs[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def eval_batches(
    data: Sequences, batch_size: int, batches: int, shard: int = 0, num_shards: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set: the first `batches` batches of this shard, same every time."""
    loader = ShardedLoader(data, batch_size, shard, num_shards, shuffle=False)
    n = min(batches, loader.per_shard // batch_size)
    return [loader.next_batch() for _ in range(n)]
