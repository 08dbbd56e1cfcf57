"""One attempt at averaging the nodes' pseudo-gradients over the mesh's inter-node group.

After the group changed (`regrouped`: the same on every member) the nodes first sum a
two-number header: how many contribute a pseudo-gradient (a joiner's entry round does not) and
their outer step counts, which must all be equal. The average is then over the contributors:
every node scales the same bits by the same factor. Any failure is returned, not raised: the
vote that follows tells every member, and all re-form and retry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import prime_comm

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh


@dataclass
class Averaged:
    """The outcome of one attempt: `error` (None: it worked on this node); for a joiner,
    `late` (why it cannot use the result: it was admitted after the state it loaded); for a
    member, `mismatch` (a node entered with another outer step count: that node leaves)."""

    stats: prime_comm.AllReduceStats | None
    error: str | None
    contributors: int
    late: str | None = None
    mismatch: bool = False
    behind: int = 0  # for a late joiner: outer steps the members applied that it has not


def average_pseudo_gradient(
    mesh: ElasticDeviceMesh,
    pseudo_gradient: torch.Tensor,
    compression: str,
    outer_steps: int,
    contributing: bool = True,
    regrouped: bool = False,
) -> Averaged:
    """All-reduce (average) `pseudo_gradient` in place over the mesh's group (module doc);
    `outer_steps` is this node's count of applied outer steps."""
    t = time.monotonic()
    world = mesh.global_world_size
    contributors, late, mismatch, behind = world, None, False, 0
    try:
        if regrouped or not contributing:
            contributors, late, mismatch, behind = _header(mesh, contributing, outer_steps)
        stats = prime_comm.all_reduce(
            pseudo_gradient,
            group=mesh.global_pg,
            op="avg",
            compression=compression,
            timeout=mesh.collective_timeout(),
            should_abort=mesh.should_abort,
        )
    except Exception as e:  # the vote tells every member; all re-form and retry
        mesh.record_collective(time.monotonic() - t, ok=False)
        return Averaged(None, f"{type(e).__name__}: {e}", contributors, late, mismatch, behind)
    mesh.record_collective(time.monotonic() - t)
    if 0 < contributors < world:  # the average over the nodes that contributed
        pseudo_gradient.mul_(world / contributors)
    if not bool(torch.isfinite(pseudo_gradient).all()):
        error = "averaged pseudo-gradient is not finite"
        return Averaged(stats, error, contributors, late, mismatch, behind)
    return Averaged(stats, None, contributors, late, mismatch, behind)


def _header(
    mesh: ElasticDeviceMesh, contributing: bool, mine: int
) -> tuple[int, str | None, bool, int]:
    """Sum (contributes?, outer steps) over the group: (contributors, why this joiner is late,
    whether some node's count differs, how many outer steps this joiner is behind)."""
    world = mesh.global_world_size
    header = torch.tensor([float(contributing), float(mine)], dtype=torch.float32)
    prime_comm.all_reduce(
        header,
        group=mesh.global_pg,
        op="sum",
        compression="none",
        timeout=mesh.collective_timeout(),
        should_abort=mesh.should_abort,
    )
    late, mismatch, behind = None, float(header[1]) != float(world * mine), 0
    if mismatch and not contributing:
        others = (float(header[1]) - mine) / max(world - 1, 1)
        late = (
            f"admitted after {others:.0f} outer steps but loaded the state of {mine}: the "
            "fetch outlasted a round. Rerun the same command to join again"
        )
        behind = round(others) - mine
    return round(float(header[0])), late, mismatch, behind
