"""Where a DiLoCo run resumes: the newest checkpoint step that every rank of every node holds.

Agreed inside the node first, then across nodes, each in one all-gather of the newest
`_MAX_SHARED_STEPS` steps each holds. Nodes that hold checkpoints but share none are refused
(`NoCommonCheckpoint`) rather than starting over, which would throw the run's progress away.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from prime_train.rundir import RunDirError

_MAX_SHARED_STEPS = 32  # resume agreement compares this many newest checkpoint steps


def _common_steps(
    steps: list[int], group: Any, world: int, held: bool = False
) -> tuple[set[int], bool]:
    """The steps (of the newest `_MAX_SHARED_STEPS` each) that every member of `group` holds,
    and whether any member holds a step (or was told `held`)."""
    mine = sorted(steps)[-_MAX_SHARED_STEPS:]
    t = torch.full((_MAX_SHARED_STEPS + 1,), -1, dtype=torch.int64)
    t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    t[-1] = int(held or bool(steps))
    if group is not None:
        world = dist.get_world_size(group)
    if world > 1:
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
    else:
        gathered = [t]
    common = set.intersection(*({int(s) for s in g[:-1].tolist() if s >= 0} for g in gathered))
    return common, any(int(g[-1]) > 0 for g in gathered)


class NoCommonCheckpoint(RunDirError):
    """Some node holds checkpoints but no step is held by every node: refused rather than
    silently starting over (the message says how to proceed)."""


def agree_resume_step(
    local_steps: list[int], node_group: Any, global_pg: Any, nodes: int
) -> int | None:
    """The newest step every rank of every node holds (None: a fresh run, no node holds
    any); `node_group` joins this node's ranks (None: one rank), `global_pg` the `nodes`
    nodes. NoCommonCheckpoint, on every node alike, when nodes hold checkpoints but share none."""
    node_steps, node_held = _common_steps(local_steps, node_group, 1)
    common, held = _common_steps(sorted(node_steps), global_pg, nodes, node_held)
    if held and not common:
        raise NoCommonCheckpoint(
            "the nodes share no checkpoint step (this node holds "
            f"{sorted(local_steps) or 'none'}), so the run cannot resume, and starting "
            "over would throw its progress away. A node restarted on a new machine finds "
            "its checkpoints by its name: start it with its former --mesh.node_name (its "
            "remote copies are under ckpt.remote/NAME) or copy its checkpoint folder over; "
            "to start the run over, move every node's checkpoints aside"
        )
    return max(common) if common else None
