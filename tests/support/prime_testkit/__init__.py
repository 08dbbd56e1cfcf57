"""The workspace's test kit (tests/support is on pytest's pythonpath).

- `Children` (and the `children` fixture of the root conftest.py): child processes in their
  own process group that die with the test process and are killed and reaped at teardown;
  `free_port`, `wait_until` (every wait bounded), `die_with_parent`.
- `Nodes`: named node processes driven through command and report queues, for tests that
  kill or stop their processes.
- `cli_node`: the command and environment of one `prime-train` node in its own folder.
- `gloo_world` / `gloo_group`: the one TCPStore + init_process_group for a test rank.
- `MotoS3`: moto's S3 server on a free loopback port, with fresh buckets (`CREDENTIALS`).
- `RankPool` (and the session-scoped `rank_pool` fixture): four rank processes in one gloo
  world, started once per session, that run test cases in groups of 1..4 ranks.
"""

from typing import Any

from prime_testkit.children import Children, die_with_parent, free_port, load_target, wait_until
from prime_testkit.cli_node import cli_node
from prime_testkit.nodes import Nodes

# These import torch: loaded on first use, so that plain child processes stay light.
_LAZY = {
    "DEFAULT_TIMEOUT": "gloo",
    "gloo_group": "gloo",
    "gloo_world": "gloo",
    "RankPool": "pool",
    "case_spec": "pool",
    "RankContext": "worker",
    "MotoS3": "s3",
    "CREDENTIALS": "s3",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'prime_testkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"prime_testkit.{_LAZY[name]}"), name)


__all__ = [
    "CREDENTIALS",
    "DEFAULT_TIMEOUT",
    "MotoS3",
    "Children",
    "Nodes",
    "RankContext",
    "RankPool",
    "case_spec",
    "cli_node",
    "die_with_parent",
    "free_port",
    "gloo_group",
    "gloo_world",
    "load_target",
    "wait_until",
]
