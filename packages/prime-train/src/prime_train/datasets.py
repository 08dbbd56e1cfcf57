"""The training and held-out sequences of a run, from its `[data]` settings.

Each rank tokenizes only its own data slot (node x rank) into the token cache and trains on
it (see token_cache.py); a corpus with fewer training parts than slots is shared whole and
sharded by sequence instead. Ranks of a node agree on failure, so a bad file stops them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prime_train.config import Config
from prime_train.data import Sequences, SyntheticSequences, TokenSequences
from prime_train.token_cache import CorpusSpec, build_slot_tokens
from prime_train.tokens import DataError


@dataclass(frozen=True)
class RunData:
    """Training sequences (the loader takes shard `shard` of `num_shards` of them) and the
    held-out sequences, the same on every node."""

    train: Sequences
    heldout: Sequences
    shard: int
    num_shards: int


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def open_datasets(
    cfg: Config, vocab_size: int, slot: int, slots: int, group: dist.ProcessGroup | None = None
) -> RunData:
    """This rank's data: synthetic, or its slot (`node * ranks + rank` of `nodes * ranks`) of
    the tokenized corpus. `group`: the node's ranks, which fail together on bad data."""
    seq = cfg.data.seq_len
    if cfg.data.source == "synthetic":
        return RunData(
            SyntheticSequences(vocab_size, seq, cfg.run.seed),
            SyntheticSequences(vocab_size, seq, cfg.run.seed + 10**6),
            slot,
            slots,
        )
    d = cfg.data
    spec = CorpusSpec(d.path, d.source, d.text_field, d.tokenizer, d.heldout_fraction)
    cache = d.cache_dir or cfg.run.runs_dir / ".token-cache"
    workers = default_workers() if d.workers is None else d.workers
    tokens, error = None, None
    try:
        tokens = build_slot_tokens(spec, cache, slot, slots, workers)
    except DataError as e:
        error = e
    if group is not None:  # one rank's bad file stops the node's other ranks too
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if failed.item() and error is None:
            error = DataError("another rank of this node could not read its data (see its error)")
    if error is not None:
        raise error
    train, held = TokenSequences(tokens.train, seq), TokenSequences(tokens.heldout, seq)
    return RunData(train, held, slot, slots) if tokens.shared else RunData(train, held, 0, 1)
