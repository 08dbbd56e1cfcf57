"""The training and held-out sequences of a run, from its `[data]` settings."""

from __future__ import annotations

import torch.distributed as dist

from prime_train.config import Config
from prime_train.data import Sequences, SyntheticSequences, TokenSequences
from prime_train.tokens import ByteTokenizer, DataError, HFTokenizer, build_token_cache


def open_datasets(
    cfg: Config, placement, tokenizer: ByteTokenizer | HFTokenizer | None, vocab_size: int
) -> tuple[Sequences, Sequences]:
    """(train, held-out) sequences; `tokenizer` is None for synthetic data."""
    seq = cfg.data.seq_len
    if tokenizer is None:
        return (
            SyntheticSequences(vocab_size, seq, cfg.run.seed),
            SyntheticSequences(vocab_size, seq, cfg.run.seed + 10**6),
        )
    cache = cfg.data.cache_dir or cfg.run.runs_dir / ".token-cache"
    # rank 0 tokenizes, the others then find the cache ready (or meet the same error)
    files, error = None, None
    if placement.rank == 0:
        try:
            files = build_token_cache(cfg.data.path, tokenizer, cfg.data.heldout_fraction, cache)
        except DataError as e:
            error = e
    if placement.world_size > 1:
        dist.barrier(group=placement.group)
    if error is not None:
        raise error
    if files is None:
        files = build_token_cache(cfg.data.path, tokenizer, cfg.data.heldout_fraction, cache)
    return TokenSequences(files.train, seq), TokenSequences(files.heldout, seq)
