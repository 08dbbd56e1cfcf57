"""A stop signal that lands in the middle of a join's all-reduce stops the node: it is not
taken for that all-reduce's failure (found by benchmarks/churn.py --quick --seed 2: a listening
joiner's SIGTERM became "its all-reduce failed", and the node registered again instead of
exiting 0)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import prime_testkit

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from prime_testkit import WorldMesh
    from prime_train.diloco.average import average_pseudo_gradient
    from prime_train.stop import StopSignal, StoppedEarly

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)

    class SignalledMidCall(WorldMesh):
        def should_abort(self) -> bool:  # polled by the all-reduce: SIGTERM arrives there
            os.kill(os.getpid(), signal.SIGTERM)
            return False

    with StopSignal(at_once=True):
        try:
            got = average_pseudo_gradient(SignalledMidCall(), torch.ones(1000), "uint8", 3)
            print("returned", got.error)
        except StoppedEarly as e:
            print("stopped:", e)
    """
)


@pytest.mark.timeout(120)
def test_a_stop_signal_inside_the_all_reduce_is_not_an_all_reduce_failure(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONPATH": str(Path(prime_testkit.__file__).parents[1])},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stopped: SIGTERM received before training began" in out.stdout, out.stdout
