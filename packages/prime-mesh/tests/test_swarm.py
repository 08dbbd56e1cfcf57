"""A swarm of 64 simulated nodes against the real `prime-mesh coordinator` (see
benchmarks/swarm.py: each node is the project's Session and CoordinatorClient, no training):
all 64 reach one epoch, and the coordinator's threads stay bounded. The README's CI command.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
THREAD_BOUND = 16  # independent of the number of nodes (517 at 256 nodes before)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_64_simulated_nodes_reach_one_epoch_with_bounded_threads():
    # as the README writes it: uv run python benchmarks/swarm.py --nodes 64 --json
    proc = subprocess.run(
        [sys.executable, "benchmarks/swarm.py", "--nodes", "64", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert row["storm_s"] is not None, row  # all 64 in one epoch, every one registered
    assert row["failures"] == 0, row
    assert row["threads"] <= THREAD_BOUND and row["threads_end"] <= THREAD_BOUND, row
    assert "| N = 64 |" in proc.stdout
