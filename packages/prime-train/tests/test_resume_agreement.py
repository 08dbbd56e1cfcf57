"""Where the founders of a run resume (`diloco/resume_agreement.py`), over real gloo groups:
2 nodes of 2 ranks each (4 processes), each local rank with its own inter-node group, as a
mesh node's ranks have."""

import pytest
import torch.distributed as dist

from prime_testkit import gloo_world

# each case: the steps each rank holds; ranks 0 and 1 are node A, ranks 2 and 3 node B
CASES = {
    "same newest": [[20, 40], [20, 40], [40], [20, 40]],  # an exact resume, as before
    "torn rank": [[20, 40], [20], [20], [20]],  # node A's ranks share 20 only
    "newest wins": [[20, 40], [20, 40], [20], [20]],  # B holds the common 20, A the newer 40
    "fresh node": [[10], [10], [], []],
    "fresh run": [[], [], [], []],
    "ranks share none": [[20], [30], [], []],
}


def _agree(rank, world, port, q):
    from prime_train.diloco import LacksNewestStep, NoCommonCheckpoint
    from prime_train.diloco.resume_agreement import agree_resume_step

    gloo_world(rank, world, port)
    try:
        # every rank takes part in creating every group (gloo's rule)
        nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        node_group, global_pg = nodes[rank // 2], across[rank % 2]
        out = {}
        for name, steps in CASES.items():
            try:
                out[name] = agree_resume_step(steps[rank], node_group, global_pg, 2)
            except LacksNewestStep as e:
                out[name] = ("join", e.step, e.mine, e.holders, str(e))
            except NoCommonCheckpoint as e:
                out[name] = ("refused", str(e))
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_founders_resume_from_the_newest_step_and_the_others_join(children):
    """Every rank of a node decides alike, and the nodes decide from one all-gather: the
    newest step any node holds in all its ranks wins (even over an older common step); a node
    without it, fresh or behind, joins; nothing held anywhere is a fresh run."""
    results = children.ranks(_agree, 4, timeout=90)
    node_a, node_b = [results[0], results[1]], [results[2], results[3]]
    for a in node_a:
        assert a["same newest"] == 40 and a["torn rank"] == 20 and a["newest wins"] == 40
        assert a["fresh node"] == 10 and a["fresh run"] is None
    for b in node_b:
        assert b["same newest"] == 40 and b["torn rank"] == 20 and b["fresh run"] is None
        assert b["newest wins"][:4] == ("join", 40, 20, 1), b
        assert "checkpoints up to step 20" in b["newest wins"][4]
        assert b["fresh node"][:4] == ("join", 10, None, 1), b
        assert "holds no checkpoint" in b["fresh node"][4]
    for out in results.values():  # no node holds a whole step, but a rank holds one
        assert out["ranks share none"][0] == "refused", out
        assert "move every node's checkpoints aside" in out["ranks share none"][1]


def test_founders_behind_the_newest_checkpoint_a_node_reported_wait_for_it():
    """`check_holds_run_state`: founders whose newest step (None: none) lies behind the
    newest checkpoint a node of the run reported would roll the run back: NothingToFormFrom,
    naming that node; at or past it, or with nothing reported, they form the run."""
    from prime_train.diloco import NothingToFormFrom
    from prime_train.diloco.resume_agreement import check_holds_run_state

    check_holds_run_state(None, None)  # a fresh run, or a restarted coordinator
    check_holds_run_state(None, 40)
    check_holds_run_state((120, "node1"), 120)
    check_holds_run_state((120, "node1"), 160)  # (its stop's checkpoint, past the reported)
    for held, says in ((80, "checkpoints up to step 80"), (None, "no checkpoint")):
        with pytest.raises(NothingToFormFrom, match=f"hold {says}, but node1 reported holding "
                           "the step-120 checkpoint"):  # fmt: skip
            check_holds_run_state((120, "node1"), held)
