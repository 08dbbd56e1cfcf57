"""prime-train's test kit: the tiny config every in-process and CLI test starts from, and the
one CLI runner (a clean `PRIME_*` environment, bounded by a timeout)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from prime_testkit import clean_env
from prime_train.config import Config
from prime_train.config_load import load_config

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"

# The debug config made small: one node, a few stdlib files, 40 steps of 8 x 64 tokens.
TINY = [
    "--launch.local_nodes", "1",
    "--run.log_every", "5",
    "--data.path", "{stdlib}/[a-c]*.py",
    "--data.seq_len", "64",
    "--train.steps", "40",
    "--train.batch_size", "8",
    "--optim.warmup_steps", "5",
    "--eval.every", "20",
    "--eval.batches", "2",
    "--ckpt.every", "0",
]  # fmt: skip


def tiny_args(runs_dir: Path, *extra: str) -> list[str]:
    """CLI arguments of the tiny run in `runs_dir` (later `extra` overrides win)."""
    return ["--config", str(DEBUG), "--run.runs_dir", str(runs_dir), *TINY, *extra]


@pytest.fixture
def tiny(tmp_path) -> Callable[..., Config]:
    """`tiny(*overrides)`: the tiny run's Config, with its runs folder under tmp_path."""

    def tiny_config(*extra: str) -> Config:
        args = tiny_args(tmp_path / "runs", *extra)
        return load_config(args[1], args[2:], env={})

    return tiny_config


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """`run_cli(*args, env=None, timeout=280, cwd=None)`: `prime-train *args` as a user runs
    it, in a clean environment (plus `env`), output captured."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 280, cwd=None):
        return subprocess.run(
            [sys.executable, "-m", "prime_train.cli", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_env(**(env or {})),
            cwd=cwd,
        )

    return run


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """The environment a CLI test runs nodes in: this one, less any PRIME_* setting."""
    return clean_env()


@pytest.fixture(scope="session")
def tiny_cli_args() -> Callable[..., list[str]]:
    """`tiny_cli_args(runs_dir, *overrides)`: the tiny run as CLI arguments."""
    return tiny_args
