"""One node of a debug DiLoCo job run through `prime-train`, as on its own machine."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def cli_node(
    folder: Path,
    *,
    coordinator: str,
    host: str,
    token: str,
    cache: Path,
    steps: int,
    inner_steps: int,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a node working in `folder` (created; its name is the
    node name): configs/debug.toml, heartbeats every 0.5 s with a 3 s timeout, a checkpoint
    every 40 steps, no evaluation; `env` and `args` add to or override them."""
    folder.mkdir(parents=True, exist_ok=True)
    node_env = dict(os.environ, PRIME_TOKEN=token, PRIME_MESH__COORDINATOR=coordinator,
                    PRIME_MESH__HOST=host, PRIME_MESH__NODE_NAME=folder.name,
                    PRIME_MESH__HEARTBEAT_INTERVAL_S="0.5", PRIME_MESH__HEARTBEAT_TIMEOUT_S="3",
                    OMP_NUM_THREADS="1", **(env or {}))  # fmt: skip
    node_env.pop("PRIME_LOCAL_NODE", None)  # not a node of a local launcher
    argv = [
        sys.executable, "-m", "prime_train.cli",
        "--config", str(ROOT / "configs" / "debug.toml"),
        "--run.runs_dir", str(folder / "runs"),
        "--data.cache_dir", str(cache),
        "--train.steps", str(steps),
        "--diloco.inner_steps", str(inner_steps),
        "--ckpt.every", "40",
        "--eval.every", "0",
        "--run.log_every", "10",
        *args,
    ]  # fmt: skip
    return argv, node_env
