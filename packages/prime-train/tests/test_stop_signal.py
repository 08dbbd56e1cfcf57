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


REJOIN = textwrap.dedent(
    """
    import os, signal, sys, time
    import prime_train.outer_boundary as ob
    from prime_mesh import CoordinatorLost
    from prime_train.stop import StopSignal, StoppedEarly

    calls = []

    def listening_long(run, outer, error, rejoins, bound):  # a rejoin whose snapshot never comes
        calls.append(rejoins)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return 0

    ob.rejoin_running_job = listening_long
    with StopSignal() as stop:  # the loop's: a first signal only asks
        boundary = object.__new__(ob.OuterBoundary)  # what `_rejoin` reads of a live boundary
        boundary.stop, boundary.can_rejoin, boundary.elastic = stop, True, object()
        boundary.run = None
        boundary.rejoins = boundary.lost = boundary.missed = 0
        for case in ("signalled while rejoining", "signalled before the rejoin"):
            t = time.monotonic()
            try:
                boundary._rejoin(CoordinatorLost("the coordinator went away"))
                print(case, "returned")
            except StoppedEarly as e:
                print(f"{case}: stopped after {time.monotonic() - t:.1f}s, {len(calls)} call(s):", e)
    """
)


@pytest.mark.timeout(120)
def test_a_stop_signal_while_a_node_rejoins_mid_run_stops_it_at_once(tmp_path):
    """A node evicted mid-run rejoins by itself, which may listen until the mesh's
    join_timeout: a SIGTERM then (or one received before it began) ends the node at once,
    as during a first join, not at the end of the rejoin."""
    out = subprocess.run([sys.executable, "-c", REJOIN], capture_output=True, text=True,
                         timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    during, before = lines
    assert during.startswith("signalled while rejoining: stopped after 0."), during
    assert during.endswith("1 call(s): SIGTERM received while rejoining the running job"), during
    # the signal was taken: the next rejoin does not start
    assert before.startswith("signalled before the rejoin: stopped after 0.0s, 1 call(s):"), before
