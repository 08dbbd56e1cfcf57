"""A node of several ranks leaves a bad pseudo-gradient out as one: each rank checks its own
shard, and one rank's NaN leaves every rank of the node out of the round (synchronous and
`overlap = "delayed"`, whose background round must not use the node's group). Left to each rank,
the node's other ranks would count their reads in their own groups, so the node's ranks would
commit different data positions."""

import pytest
import torch
import torch.distributed as dist

from prime_testkit import WorldMesh, gloo_world
from prime_train.config import DilocoConfig
from prime_train.diloco import make_outer_step
from prime_train.seam import ElasticOuterStep


class ShardMesh(WorldMesh):
    """A fixed epoch of two nodes whose ranks of one local index average over `group`."""

    def __init__(self, group: dist.ProcessGroup, node: int):
        super().__init__()
        self.global_pg, self.global_world_size = group, 2
        self.global_members = ("node-0", "node-1")
        self.node_id = f"node-{node}"


def _two_ranks_a_node_worker(rank, world, port, overlap, q):
    """Ranks 0, 1: node 0; ranks 2, 3: node 1. Rank 1's shard of node 0's pseudo-gradient is
    NaN; every rank reports its outer step's contributors and its shard's outer weights."""
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes each)
        shards = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        node, local = divmod(rank, 2)
        weights = torch.nn.Parameter(torch.full((4,), 1.0))
        cfg = DilocoConfig(inner_steps=2, compression="none", outer_lr=1.0, outer_momentum=0.0,
                           overlap=overlap)  # fmt: skip
        outer = make_outer_step(cfg, ShardMesh(shards[local], node), [weights],
                                node_group=nodes[node])  # fmt: skip
        with torch.no_grad():  # the round's inner steps: node 0 moved by 1, node 1 by 3
            weights.sub_(float("nan") if rank == 1 else 1.0 + 2.0 * node)
        outer.start(2)
        report = outer.finish()
        # (both kinds are the seam joining goes through: else train() would not join)
        q.put((rank, (report.contributors, weights.detach().tolist(),
                      isinstance(outer, ElasticOuterStep))))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_one_ranks_nan_leaves_its_whole_node_out_of_the_round(children, overlap):
    got = children.ranks(_two_ranks_a_node_worker, 4, overlap)
    # node 1 alone contributed, on every shard: the outer weights moved by its 3
    assert got == {r: (1, [-2.0] * 4, True) for r in range(4)}, got
