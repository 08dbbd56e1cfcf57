import os
import signal
import subprocess
import sys

import pytest

from prime_testkit import (
    Children,
    clean_env,
    debug_args,
    slot_chain_problems,
    wait_exit,
    wait_until,
)


def test_children_are_killed_and_reaped():
    c = Children()
    p = c.python(["-c", "import time; time.sleep(600)"])
    wait_until(lambda: os.getpgid(p.pid) == p.pid, 10, what="child in its own group")
    c.kill_all()
    assert p.returncode == -signal.SIGKILL


def test_grandchildren_die_with_the_group(tmp_path):
    c = Children()
    pidfile = tmp_path / "pid"
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pidfile)!r}, 'w').write(str(g.pid)); time.sleep(600)"
    )
    c.python(["-c", code])
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), 20, what="grandchild pid")
    gpid = int(pidfile.read_text())
    c.kill_all()

    def gone():
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            return True
        # a zombie awaiting its (dead) parent's reaper also counts as gone
        with open(f"/proc/{gpid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"

    wait_until(gone, 10, what="grandchild to die")


def _case_sum(ctx, value):
    """Sum of (rank + value) over the call's group, with the group's own view of it."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank + value)])
    if ctx.group.startswith("fresh"):  # an unregistered group: call it directly
        ctx.pg.allreduce([t]).wait()
        size = ctx.pg.size()
    else:
        dist.all_reduce(t, group=ctx.pg)
        size = dist.get_world_size(ctx.pg)
    return {"sum": t.item(), "rank": ctx.rank, "size": size}


def _case_fail(ctx):
    raise ValueError(f"rank {ctx.rank} refuses")


def test_rank_pool_runs_cases_in_groups_of_each_size(rank_pool):
    for world in (1, 2, 4):
        replies = rank_pool.run(_case_sum, world, value=10)
        want = sum(r + 10 for r in range(world))
        assert [(r["rank"], r["size"], r["sum"]) for r in replies] == [
            (r, world, want) for r in range(world)
        ]
    replies = rank_pool.run(_case_sum, 3, group=rank_pool.fresh_group(), value=1)
    assert [r["sum"] for r in replies] == [6.0] * 3 and replies[2]["size"] == 3


def test_rank_pool_reports_a_failing_case_and_goes_on(rank_pool):
    with pytest.raises(AssertionError, match="ValueError: rank 0 refuses"):
        rank_pool.run(_case_fail, 2)
    # rank 1's answer to the failed call is stale now: the next call gets its own answers
    assert [r["sum"] for r in rank_pool.run(_case_sum, 2, value=0)] == [1.0, 1.0]


def test_a_process_still_running_past_its_wait_prints_its_stacks(tmp_path, children):
    """`wait_exit` on a prime-train run that does not end in time: the error carries every
    thread's stack of each of its prime-train processes (SIGUSR1), and the run goes on."""
    log = tmp_path / "run.log"
    args = debug_args(tmp_path / "runs", tmp_path / "cache", "--launch.local_nodes", "1",
                      "--data.source", "synthetic", "--train.steps", "100000")  # fmt: skip
    with open(log, "w") as out:
        p = children.popen([sys.executable, "-m", "prime_train.cli", *args],
                           env=clean_env(PRIME_TOKEN="testkit"), stdout=out,
                           stderr=subprocess.STDOUT)  # fmt: skip
    wait_until(lambda: "parameters" in log.read_text() or p.poll() is not None, 120,
               what="the run's start")  # fmt: skip
    with pytest.raises(AssertionError, match="still running") as e:
        wait_exit(p, 1, log)
    assert "most recent call first" in str(e.value) and "prime_train" in str(e.value)
    assert p.poll() is None  # (the handler printed and went on)


def test_slot_chain_problems_find_a_range_read_twice_a_gap_and_a_stalled_slot():
    def row(node, k, data):
        return {"node": node, "outer_step": k, "data": data}

    good = [row(0, 1, {"0": [0, 4]}), row(1, 1, {"1": [0, 4]}),
            row(1, 2, {"0": [4, 6]}), row(0, 2, {"1": [4, 8]})]  # fmt: skip
    assert slot_chain_problems(good) == [] and slot_chain_problems(good, 2, stall=0) == []
    twice = [*good, row(2, 3, {"0": [4, 6]})]  # a late node read slot 0's 4..6 again
    assert slot_chain_problems(twice) == [
        "slot 0: node2 read 4..6 at outer step 3, expected from 6"
    ]
    gap = [*good, row(0, 3, {"1": [9, 10]})]
    assert "expected from 8" in slot_chain_problems(gap)[0]
    on = [*good, row(0, 3, {"1": [8, 9]}), row(0, 4, {"1": [9, 10]})]  # slot 0 left behind
    assert slot_chain_problems(on, 2, stall=2) == []
    assert slot_chain_problems(on, 2, stall=1) == ["slot 0: not read for 2 outer steps in a row"]
    assert slot_chain_problems(good, 3, stall=1) == ["slot 2: not read for 2 outer steps in a row"]
    assert slot_chain_problems([row(0, 1, {})]) == ["no row carries data slot reads"]
