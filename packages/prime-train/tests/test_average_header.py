"""The outer step's exact header over a real gloo world: the contributors' inner step reaches a
listener (which holds none of its own) exactly, far past float32's 2**24; two joiners admitted
together, stating stale counts of their own, each learn the members' count."""

import pytest
import torch
import torch.distributed as dist

from prime_testkit import WorldMesh, gloo_world
from prime_train.diloco.average import average_pseudo_gradient

STEP = 123_456_789  # > 2**24: a float32 sum of it would round


def _worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        listener = rank == world - 1
        pg = torch.full((1000,), 0.0 if listener else float(rank + 1))
        reads = [0, 0, 0] if listener else [rank + 1, 0, 2]
        got = average_pseudo_gradient(WorldMesh(), pg, "none", 7, contributing=not listener,
                                      reads=reads, step=None if listener else STEP)  # fmt: skip
        silent = average_pseudo_gradient(WorldMesh(), torch.ones(10), "none", 7, reads=[1, 0, 0])
        q.put((rank, {"step": got.members_step, "contributors": got.contributors,
                      "consumed": got.consumed, "mean": pg[0].item(), "error": got.error,
                      "silent": silent.members_step}))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_header_carries_the_contributors_step_to_a_listener(children):
    results = children.ranks(_worker, 3)
    for out in results.values():
        assert out["error"] is None, out
        assert out["step"] == STEP and out["contributors"] == 2, out
        assert out["consumed"] == [3.0, 0.0, 4.0] and out["mean"] == 1.5, out
        assert out["silent"] is None, out  # no node sent its step


def _two_joiners(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        # ranks 0, 1: members at outer step 6; rank 2: a fresh joiner (0); rank 3: a rerun
        # node whose checkpoint was at outer step 2
        count = {0: 6, 1: 6, 2: 0, 3: 2}[rank]
        joiner = rank >= 2
        got = average_pseudo_gradient(WorldMesh(), torch.zeros(10), "none", count,
                                      contributing=not joiner, reads=[0, 0])  # fmt: skip
        q.put((rank, {"behind": got.behind, "late": got.late, "mismatch": got.mismatch}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_joiners_admitted_together_each_learn_the_members_count(children):
    results = children.ranks(_two_joiners, 4)
    assert results[2]["behind"] == 6 and results[3]["behind"] == 4, results  # (before: 4, 3)
    assert "admitted after 6 outer steps" in results[3]["late"], results
    assert results[0]["late"] is None and results[0]["mismatch"], results
