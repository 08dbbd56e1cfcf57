"""Whether this node's pseudo-gradient may go into a round's average.

One node's bad numbers (a NaN or Inf from an overflow, a bad batch, a flipped bit) must not
stop the run: averaged in, they would make every node's update non-finite, every node would
refuse it, and every retry would recompute the same values. So before its all-reduce a node
checks its own pseudo-gradient; when its L2 norm is not finite (a NaN or Inf in it, or values
so large that the norm overflows float32) the node contributes nothing to that round, as a
joiner's entry round does (its reads are not counted, so its data slots are read again): the
others commit without it, it logs why and takes the committed weights like every node.

A finite norm far outside the others' (a loss spike on one node, a bad batch that did not
overflow) is caught at the sync point: each contributing rank states its squared norm there,
and the coordinator tells a node whose norm exceeds `diloco.norm_bound` (default 10) times
the median of the other nodes' (`prime_mesh.norms`); that node then contributes nothing to
the round, the same way.

A node of several ranks decides for all of them (`every_rank`): each rank checks its own
shard, and one bad shard leaves the whole node out, or its ranks' groups would count its
reads differently and its data slots drift apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from prime_train import faults
from prime_train.metrics import Log


def unusable(norm: float) -> str | None:
    """Why a pseudo-gradient of L2 norm `norm` must not be averaged, or None."""
    if norm != norm or norm in (float("inf"), float("-inf")):
        return f"its L2 norm is {norm}: a NaN or Inf in it, or values that overflow float32"
    return None


def stated_norm(pseudo_gradient: torch.Tensor, outer_step: int, log: Log | None) -> float | None:
    """The squared L2 norm of this rank's pseudo-gradient for outer step `outer_step`, which
    it states at the sync point (`prime_mesh.norms`); None when it must not be averaged
    (`unusable`), with a warning that says why."""
    faults.poison_pseudo_gradient(outer_step, pseudo_gradient, log)  # (a test's)
    norm = float(torch.linalg.vector_norm(pseudo_gradient))  # (one reduction, no temporary)
    why = unusable(norm)
    if why is None:
        return norm**2
    _left_out(outer_step, why, log)
    return None


def outlier(why: str | None, outer_step: int, bound: float, log: Log | None) -> bool:
    """Whether the sync point found this node's norm far outside the others' (`why`, the
    mesh's `norm_outlier`); if so, a warning says so."""
    if why is None:
        return False
    _left_out(outer_step, f"{why}; diloco.norm_bound = {bound:g}", log)
    return True


def every_rank(contributing: bool, node_group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of this node contributes (`node_group`: its ranks, None: one)."""
    if node_group is None:
        return contributing
    every: list[bool | None] = [None] * dist.get_world_size(node_group)
    dist.all_gather_object(every, contributing, group=node_group)
    return all(every)


def _left_out(outer_step: int, why: str, log: Log | None) -> None:
    if log is not None:
        log.warn(
            f"outer step {outer_step}: this node's pseudo-gradient is left out of the round "
            f"({why}); the others commit without it and it takes the committed weights"
        )
