"""The training and held-out sequences of a run, from its `[data]` settings.

Every machine holds the whole corpus's tokens (token_cache.py); which sequences a rank trains
on is the data slots' business (slot_loader.py). Ranks of a node agree on failure, so a bad
file stops them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prime_train.config import Config
from prime_train.data import Sequences, SyntheticSequences, TokenSequences
from prime_train.token_cache import CorpusSpec, build_corpus_tokens
from prime_train.tokens import DataError


@dataclass(frozen=True)
class RunData:
    """The training sequences (all of them: the data slots cut them) and the held-out
    sequences, the same on every node."""

    train: Sequences
    heldout: Sequences


# set by the local launcher: how many rank processes it runs on this machine (all nodes)
LOCAL_PROCESSES_ENV = "PRIME_LOCAL_PROCESSES"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_ranks(group: dist.ProcessGroup | None = None) -> int:
    """Rank processes sharing this machine: the node's ranks (torchrun's LOCAL_WORLD_SIZE, the
    node group), or every rank of every node the local launcher simulates here."""
    counts = [1, dist.get_world_size(group) if group is not None else 1]
    for name in ("LOCAL_WORLD_SIZE", LOCAL_PROCESSES_ENV):
        value = os.environ.get(name, "")
        counts.append(int(value) if value.isdigit() else 1)
    return max(counts)


def tokenizer_workers(setting: int | None, group: dist.ProcessGroup | None = None) -> int:
    """Tokenizer processes for this rank: `data.workers` (default: as many as allowed), at
    most this rank's share of the cores, cores / local ranks (at least 1; 0 stays 0: in the
    rank's own process), so ranks tokenizing at once do not oversubscribe the machine."""
    limit = max(1, cores() // local_ranks(group))
    return limit if setting is None else min(setting, limit)


def open_datasets(cfg: Config, vocab_size: int, group: dist.ProcessGroup | None = None) -> RunData:
    """The run's data: synthetic, or the tokenized corpus. `group`: the node's ranks, which
    fail together on bad data."""
    seq = cfg.data.seq_len
    if cfg.data.source == "synthetic":
        return RunData(
            SyntheticSequences(vocab_size, seq, cfg.run.seed),
            SyntheticSequences(vocab_size, seq, cfg.run.seed + 10**6),
        )
    d = cfg.data
    spec = CorpusSpec(d.path, d.source, d.text_field, d.tokenizer, d.heldout_fraction)
    cache = d.cache_dir or cfg.run.runs_dir / ".token-cache"
    workers = tokenizer_workers(d.workers, group)
    tokens, error = None, None
    try:
        tokens = build_corpus_tokens(spec, cache, workers)
    except DataError as e:
        error = e
    if group is not None:  # one rank's bad file stops the node's other ranks too
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if failed.item() and error is None:
            error = DataError("another rank of this node could not read its data (see its error)")
    if error is not None:
        raise error
    return RunData(TokenSequences(tokens.train, seq), TokenSequences(tokens.heldout, seq))
