"""Settings that are only wrong once combined (model shape, vocabulary, data path), checked
before the local launcher starts any node: one error line in seconds, instead of every node
importing torch and failing with the same line."""

from __future__ import annotations

from prime_train.config import Config
from prime_train.corpus import resolve_files
from prime_train.hf_import import run_model_args
from prime_train.tokens import make_tokenizer


def check_settings(cfg: Config) -> None:
    """Raise the ConfigError (shape, vocabulary, init_from) or DataError (data.path) that each
    node would raise at start-up; the nodes still check for themselves (torchrun runs them
    without this launcher)."""
    tokenizer = None if cfg.data.source == "synthetic" else make_tokenizer(cfg.data.tokenizer)
    run_model_args(cfg, tokenizer.vocab_size if tokenizer else None)
    if cfg.data.source != "synthetic":
        resolve_files(cfg.data.path, cfg.data.source)
