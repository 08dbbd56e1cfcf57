"""The workspace's test kit (tests/support is on pytest's pythonpath): every helper that more
than one test file uses lives here, once, one module per concern.

- children: `Children` (and the `children` fixture of the root conftest.py): child processes
  in their own process group that die with the test process and are killed and reaped at
  teardown; `free_port`, `wait_until` and `wait_exit` (every wait bounded; a process that
  does not end prints its stacks), `die_with_parent`.
- nodes: `Nodes`: named node processes driven through command and report queues, for tests
  that kill or stop their processes.
- cli_node: prime-train nodes through the real CLI. `debug_args` (configs/debug.toml with a
  runs folder and a token cache), `clean_env` (no PRIME_* settings); `cli_node` /
  `start_cli_node`: a node in its own working folder; `start_ranked_node`: one of several
  rank processes, as torchrun starts it; `start_coordinator_cli`: `prime-mesh
  coordinator` as its own process on a given port, logging to a file (restarted there);
  `start_mesh_coordinator`: one on a free port, its output collected (`LineProc`, a child
  whose output lines are kept with their times); `start_local_node(s)`: node k of nodes
  sharing one runs folder (PRIME_LOCAL_NODE=k); `run_local_nodes`: such a job with its
  coordinator, run to its end or stopped with SIGTERM. The root conftest.py's module-scoped
  `token_cache` fixture is the token cache of a module's runs.
- runs: what a run leaves behind. `node_metrics` (node k's rows in a shared runs folder),
  `folder_metrics` (a node in its own folder), `outer_rows` / `outer_by_step` /
  `outer_hashes` (its outer steps), `check_same_outer` (a node has the members' hashes),
  `losses` (node 0's train and held-out losses),
  `trace` (what a resumed run must reproduce: by default the `TRACED` values),
  `log_tails` (every log of a test's folder, for a failing assertion).
- fixed_data: `pseudo_random`, floats that are the same on every machine (pinned digests);
  `IndexDataset`, sequences that are their own index.
- mesh: prime-mesh's coordinator from a test: `node_states`, `node_ids`, `mesh_round` (one
  step of its mesh node processes), `form` / `register` / `sync_all` and `FakeConn` (with `replies`) /
  `FakeClock` that drive its Membership state machine without sockets. The prime-mesh tests'
  conftest.py has the `coordinator` fixture (the module's TOKEN and MIN_NODES).
- ckpt: `make_checkpoint`, a committed prime-ckpt step folder written by hand;
  `donor_processes`: rate-limited `prime_ckpt.peer serve` donors, each with its URL;
  `small_state`, a state to save; `small_disk_at`, a disk too small for what a test saves.
- comm: `available_simd_levels`, the prime-comm kernels' SIMD levels this CPU runs.
- memory: `rss_anon_kib`, this process's anonymous resident memory (what a test asserts).
- gloo: `gloo_world` / `gloo_group`: the one TCPStore + init_process_group for a test rank.
- s3: `MotoS3`: moto's S3 server on a free loopback port, with fresh buckets (`CREDENTIALS`);
  `DeadS3`: an endpoint that hangs or refuses.
- pool, worker: `RankPool` (and the session-scoped `rank_pool` fixture): four rank processes
  in one gloo world, started once per session, that run test cases in groups of 1..4 ranks.

Beside the kit in tests/support: prime_browser (headless Chromium: `chromium`, `table`,
`canvas_ink`) and prime_netbed (the WAN bed of network namespaces, root only).
"""

from typing import Any

from prime_testkit.children import (
    Children,
    die_with_parent,
    free_port,
    load_target,
    wait_exit,
    wait_until,
)
from prime_testkit.ckpt import donor_processes, make_checkpoint, small_disk_at, small_state
from prime_testkit.cli_node import (
    LineProc,
    clean_env,
    cli_node,
    debug_args,
    run_local_nodes,
    start_cli_node,
    start_coordinator_cli,
    start_local_node,
    start_local_nodes,
    start_mesh_coordinator,
    start_nodes_in_turn,
    start_ranked_node,
    stop_once_contributing,
)
from prime_testkit.comm import available_simd_levels
from prime_testkit.memory import rss_anon_kib
from prime_testkit.mesh import (
    FakeClock,
    FakeConn,
    form,
    mesh_round,
    node_ids,
    node_states,
    register,
    sync_all,
)
from prime_testkit.nodes import Nodes
from prime_testkit.runs import (
    TRACED,
    check_same_outer,
    folder_metrics,
    log_tails,
    losses,
    node_metrics,
    outer_by_step,
    outer_hashes,
    outer_rows,
    slot_chain_problems,
    trace,
)

# These import torch: loaded on first use, so that plain child processes stay light.
_LAZY = {
    "DEFAULT_TIMEOUT": "gloo",
    "gloo_group": "gloo",
    "gloo_world": "gloo",
    "WorldMesh": "gloo",
    "RankPool": "pool",
    "case_spec": "pool",
    "RankContext": "worker",
    "MotoS3": "s3",
    "DeadS3": "s3",
    "CREDENTIALS": "s3",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'prime_testkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"prime_testkit.{_LAZY[name]}"), name)


__all__ = [
    "slot_chain_problems",
    "donor_processes",
    "CREDENTIALS",
    "DEFAULT_TIMEOUT",
    "TRACED",
    "WorldMesh",
    "Children",
    "FakeClock",
    "FakeConn",
    "form",
    "DeadS3",
    "MotoS3",
    "Nodes",
    "RankContext",
    "RankPool",
    "case_spec",
    "clean_env",
    "cli_node",
    "debug_args",
    "die_with_parent",
    "folder_metrics",
    "free_port",
    "available_simd_levels",
    "gloo_group",
    "gloo_world",
    "load_target",
    "log_tails",
    "losses",
    "make_checkpoint",
    "mesh_round",
    "node_ids",
    "register",
    "sync_all",
    "small_disk_at",
    "rss_anon_kib",
    "small_state",
    "node_metrics",
    "node_states",
    "outer_by_step",
    "check_same_outer",
    "outer_hashes",
    "outer_rows",
    "run_local_nodes",
    "start_cli_node",
    "start_nodes_in_turn",
    "stop_once_contributing",
    "start_coordinator_cli",
    "start_mesh_coordinator",
    "LineProc",
    "start_local_node",
    "start_local_nodes",
    "start_ranked_node",
    "trace",
    "wait_exit",
    "wait_until",
]
