"""One attempt at averaging the nodes' pseudo-gradients over the mesh's inter-node group.

The nodes first sum an exact (uncompressed) header: whether each contributes a
pseudo-gradient (a joiner's entry round does not), their outer step counts, which must all be
equal, the contributors' inner step at this sync point (in two parts, so the float32 sums stay
exact: a listener, which holds no step of its own, takes the members'), and, with data slots, how many sequences each read from each slot and not counted yet
(`reads`: a few numbers per slot; only a contributor's count). The header goes with every
round, with or without `reads`: whether a node contributes is its own to say (a joiner, a
node whose numbers went bad or were an outlier), so no node can tell whether the others send
one. The average is then over the contributors: every node scales the same bits by the same factor.
With `weighted` (time-budgeted rounds, `[diloco] round_seconds`), each contributor's
pseudo-gradient counts by the sequences it read that round: it first scales its own by
contributors x its reads / all reads, exactly 1 when all read alike (the arithmetic is then
the unweighted one, bit for bit). Any failure is returned, not raised: the vote that follows
tells every member, and all re-form and retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import prime_comm
from prime_train.diloco.update_codec import Encoded

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh


@dataclass
class Averaged:
    """The outcome of one attempt: `error` (None: it worked on this node); for a joiner,
    `late` (why it cannot use the result: it was admitted after the state it loaded);
    `mismatch`: some node states another outer step count than this one (a contributor's is
    compared in the commit vote, and one that differs leaves; `listen.check_holds_agreed` makes a
    node that did not contribute leave)."""

    stats: prime_comm.AllReduceStats | None
    error: str | None
    contributors: int
    late: str | None = None
    mismatch: bool = False
    consumed: list[float] | None = None  # per data slot, the contributors' reads (summed)
    behind: int = 0  # for a late joiner: outer steps the members applied that it has not
    members_step: int | None = None  # the contributors' inner step (None: none sent)
    encoded: Encoded | None = None  # the average as its all-reduce's bytes (`keep_encoding`)


def average_pseudo_gradient(
    mesh: ElasticDeviceMesh,
    pseudo_gradient: torch.Tensor,
    compression: str,
    outer_steps: int,
    contributing: bool = True,
    reads: list[int] | None = None,
    feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    weighted: bool = False,
    payload_for: Callable[[int], torch.Tensor] | None = None,
    step: int | None = None,
    keep_encoding: bool = False,
) -> Averaged:
    """All-reduce (average) `pseudo_gradient` in place over the mesh's group (module doc);
    `outer_steps` is this node's count of applied outer steps; `reads`: this node's uncounted
    reads per data slot; `feedback` (error feedback, `diloco/error_feedback.py`): the residual
    this node carries, added after the weighting, and the buffer that receives this attempt's
    quantization error; `weighted`: weigh the contributors by their `reads`;
    `payload_for` (streaming fragments): a late joiner's buffer for the members' outer step
    count, so that its zeros are as long as the fragment the members send; `step`: this node's
    inner step at the sync point (the header's `members_step`); `keep_encoding`: the result
    also as the bytes it was decoded from (`Averaged.encoded`, for the update log)."""
    t = time.monotonic()
    world = mesh.global_world_size
    contributors, late, mismatch, consumed, behind = world, None, False, None, 0
    members_step = None
    try:
        contributors, late, mismatch, consumed, behind, members_step = _header(
            mesh, contributing, outer_steps, reads, step
        )
        if behind > 0 and payload_for is not None:  # (a joiner: it contributes nothing)
            pseudo_gradient = payload_for(outer_steps + behind).zero_()
        if weighted and reads is not None and consumed is not None:
            _weigh(pseudo_gradient, contributors, sum(reads) if contributing else 0, consumed)
        carried, residual = feedback if feedback is not None else (None, None)
        if carried is not None:
            pseudo_gradient.add_(carried)
        stats = prime_comm.all_reduce(
            pseudo_gradient,
            group=mesh.global_pg,
            op="avg",
            compression=compression,
            timeout=mesh.collective_timeout(),
            should_abort=mesh.should_abort,
            residual=residual,
            keep_encoding=keep_encoding,
        )
    except Exception as e:  # the vote tells every member; all re-form and retry
        mesh.record_collective(time.monotonic() - t, ok=False)
        error = f"{type(e).__name__}: {e}"
        return Averaged(None, error, contributors, late, mismatch, consumed, behind, members_step)
    mesh.record_collective(time.monotonic() - t)
    scale = world / contributors if 0 < contributors < world else 1.0
    if scale != 1.0:  # the average over the nodes that contributed
        pseudo_gradient.mul_(scale)
    error = None if _finite(pseudo_gradient) else "averaged pseudo-gradient is not finite"
    encoded = Encoded(stats.encoding, scale) if stats.encoding is not None else None
    return Averaged(
        stats, error, contributors, late, mismatch, consumed, behind, members_step, encoded
    )


def _finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every element is finite, a chunk at a time (no mask as long as the model)."""
    flat = t.view(-1)
    return all(
        bool(torch.isfinite(flat[a : a + chunk]).all()) for a in range(0, flat.numel(), chunk)
    )


def _weigh(
    pseudo_gradient: torch.Tensor, contributors: int, mine: int, consumed: list[float]
) -> None:
    """Scale this node's pseudo-gradient so that the plain average that follows weighs each
    contributor by its reads: x contributors * mine / total (integers, so exactly 1.0 when
    every contributor read as much: nothing is touched)."""
    total = round(sum(consumed))
    scale = contributors * mine / total if total else 0.0
    if scale != 1.0:
        pseudo_gradient.mul_(scale)


STEP_SPLIT = 4096  # a step is sent as (step // STEP_SPLIT, step % STEP_SPLIT)


def _header(
    mesh: ElasticDeviceMesh, contributing: bool, mine: int, reads: list[int] | None,
    step: int | None,
) -> tuple[int, str | None, bool, list[float] | None, int, int | None]:  # fmt: skip
    """Sum (contributes?, outer steps, the step in two parts, the contributors' outer steps,
    reads per slot) over the group: (contributors, why this joiner is late, whether some
    node's count differs, the reads summed, how many outer steps this joiner is behind, the
    contributors' step). The members' count comes from the contributors alone: two joiners
    admitted together each state a count of their own (a fresh one 0, a rerun its stale one),
    and an average over all the others would be neither. Float32 is exact here: a round's
    reads of a slot are far below 2**24, and so are the step's parts summed over fewer than
    4096 contributors."""
    world = mesh.global_world_size
    counted = reads if (reads is not None and contributing) else [0] * len(reads or [])
    high, low = divmod(step, STEP_SPLIT) if contributing and step is not None else (0, 0)
    header = torch.tensor(
        [float(contributing), float(mine), float(high), float(low), float(contributing) * mine,
         *counted], dtype=torch.float32,
    )  # fmt: skip
    prime_comm.all_reduce(
        header,
        group=mesh.global_pg,
        op="sum",
        compression="none",
        timeout=mesh.collective_timeout(),
        should_abort=mesh.should_abort,
    )
    late, mismatch, behind = None, float(header[1]) != float(world * mine), 0
    contributors = round(float(header[0]))
    if mismatch and not contributing:
        others = (
            float(header[4]) / contributors
            if contributors
            else (float(header[1]) - mine) / max(world - 1, 1)
        )
        late = (
            f"admitted after {others:.0f} outer steps but loaded the state of {mine}: the "
            "fetch outlasted a round. Rerun the same command to join again"
        )
        behind = round(others) - mine
    consumed = header[5:].tolist() if reads is not None else None
    return contributors, late, mismatch, consumed, behind, _agreed_step(header, contributors)


def _agreed_step(header: torch.Tensor, contributors: int) -> int | None:
    """The contributors' step (the same on each: they meet at this sync point) from the
    header's summed parts; None when none contributed, or the sums are no multiple of the
    count (steps that differ, a bug elsewhere)."""
    high, low = round(float(header[2])), round(float(header[3]))
    if contributors <= 0 or high == low == 0 or high % contributors or low % contributors:
        return None  # (0: none sent a step; no sync point is at step 0)
    return high // contributors * STEP_SPLIT + low // contributors
