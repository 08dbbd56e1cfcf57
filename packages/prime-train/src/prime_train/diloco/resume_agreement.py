"""Where a DiLoCo run resumes: the newest checkpoint step any node holds.

A node's step is the newest that every one of its ranks holds (agreed inside the node in one
all-gather of the newest `_MAX_SHARED_STEPS` steps each rank holds). Across nodes one
all-gather of each node's step decides, the same on every node, so the founders decide alike:

- no node holds a step: a fresh run;
- the nodes that hold the newest step resume from it (exactly as when every node holds it);
- a node that does not (it holds only older steps, or none: a fresh node) raises
  `LacksNewestStep`: it leaves the founders and joins the run they form through the one join
  path (`diloco/join.py`), so a run that lost every member re-forms from the newest state
  any founder holds instead of stopping.

Nodes forming a run anew must also hold the newest checkpoint step any node of the run
reported holding on disk (`ElasticDeviceMesh.newest_checkpoint`, while the coordinator
lives): founders that hold only older checkpoints, or none, would roll the run back (or
start it over) while the node holding its newest state is away. They raise
`NothingToFormFrom` instead, leave, and wait for it to come back (`diloco/join.py`).

Newest wins even where an older step is common to every node: resuming from the common step
would throw away the rounds after it, while joining costs the lagging nodes only a snapshot.
A node whose ranks hold checkpoints but share no step, when no node holds a whole step, is
refused (`NoCommonCheckpoint`) rather than starting over, which would delete them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from prime_train.rundir import RunDirError

_MAX_SHARED_STEPS = 32  # the node's ranks compare this many newest checkpoint steps


def _node_steps(steps: list[int], group: Any) -> tuple[set[int], bool]:
    """The steps (of the newest `_MAX_SHARED_STEPS` each) that every rank of the node holds
    (`group`: its ranks; None: one rank), and whether any rank holds a step."""
    mine = sorted(steps)[-_MAX_SHARED_STEPS:]
    t = torch.full((_MAX_SHARED_STEPS + 1,), -1, dtype=torch.int64)
    t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    t[-1] = int(bool(steps))
    gathered = [t]
    if group is not None and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, t, group=group)
    common = set.intersection(*({int(s) for s in g[:-1].tolist() if s >= 0} for g in gathered))
    return common, any(int(g[-1]) > 0 for g in gathered)


def _every_node(newest: int, held: bool, global_pg: Any, nodes: int) -> list[tuple[int, bool]]:
    """Each node's (newest whole step, -1 for none; whether any of its ranks holds a step)."""
    t = torch.tensor([newest, int(held)], dtype=torch.int64)
    gathered = [t]
    if nodes > 1:
        gathered = [torch.empty_like(t) for _ in range(nodes)]
        dist.all_gather(gathered, t, group=global_pg)
    return [(int(g[0]), bool(g[1])) for g in gathered]


class NoCommonCheckpoint(RunDirError):
    """Some rank holds checkpoints, but no node holds a step that all its ranks hold: refused
    rather than silently starting over (the message says how to proceed)."""


class LacksNewestStep(RunDirError):
    """This node does not hold `step`, the newest step a founder holds: it joins the run the
    holders form (`diloco/join.py`) instead of resuming. `mine`: its own newest (None)."""

    def __init__(self, step: int, mine: int | None, holders: int):
        self.step, self.mine, self.holders = step, mine, holders
        held = "no checkpoint" if mine is None else f"checkpoints up to step {mine}"
        super().__init__(
            f"this node holds {held}, and {holders} founding node(s) hold step {step}, the "
            f"newest: the run resumes from step {step} on those, and this node joins it "
            "through live recovery (snapshot from a member, then the rounds since)"
        )


class NothingToFormFrom(RunDirError):
    """The nodes forming a run anew hold no checkpoint of its newest state: none at all, or
    only ones older than the newest a node of the run reported holding. Forming it from
    them would start it over or roll it back: the founders leave and wait for a node that
    holds that state (`diloco/join.py`)."""


def check_holds_run_state(newest: tuple[int, str] | None, step: int | None) -> None:
    """NothingToFormFrom where `step`, the newest checkpoint the founders hold (None: none),
    lies behind `newest`, the newest (step, node) a node of the run reported holding (None:
    none reported, as after a coordinator restart)."""
    if newest is None or (step is not None and step >= newest[0]):
        return
    held = "no checkpoint" if step is None else f"checkpoints up to step {step}"
    raise NothingToFormFrom(
        f"the nodes forming the run anew hold {held}, but {newest[1]} reported holding the "
        f"step-{newest[0]} checkpoint: it is away, and forming the run from these would roll "
        f"it back. Start {newest[1]} again (this node then joins it); to roll the run back "
        "on purpose, restart the coordinator"
    )


def agree_resume_step(
    local_steps: list[int], node_group: Any, global_pg: Any, nodes: int
) -> int | None:
    """The step the run resumes from, the newest any node holds in all its ranks (None: a
    fresh run, no node holds any); `node_group` joins this node's ranks (None: one rank),
    `global_pg` the `nodes` nodes. LacksNewestStep on a node that does not hold it;
    NoCommonCheckpoint, on every node alike, when ranks hold checkpoints but no node a step."""
    node_steps, node_held = _node_steps(local_steps, node_group)
    mine = max(node_steps) if node_steps else -1
    every = _every_node(mine, node_held, global_pg, nodes)
    newest = max(step for step, _ in every)
    if newest >= 0 and mine != newest:
        holders = sum(step == newest for step, _ in every)
        raise LacksNewestStep(newest, mine if mine >= 0 else None, holders)
    if newest < 0 and any(held for _, held in every):
        raise NoCommonCheckpoint(
            "no node holds a checkpoint step that all its ranks hold (this rank holds "
            f"{sorted(local_steps) or 'none'}), so the run cannot resume, and starting over "
            "would delete them. Copy the missing ranks' checkpoint files over (each rank "
            "keeps its own shard), or, to start the run over, move every node's "
            "checkpoints aside"
        )
    return newest if newest >= 0 else None
