"""What the loop does at an outer boundary: the outer step, and what a mesh node does when its
membership is lost there.

`OuterBoundary.sync(step)` takes the outer step and keeps the committed state
(`diloco/committed.py`) of the boundary. A lost membership has one handler per kind:

- the coordinator did not come back within `mesh.coordinator_grace_s` (`CoordinatorGone`):
  checkpoint the last committed outer step and exit with a line saying how to resume;
- evicted (a cut link, a stall, left out of a round: `MeshEvicted`) or the coordinator lost
  (`CoordinatorLost`): rejoin the others by itself through live recovery
  (`diloco/rejoin.py`), when it can; with `overlap = "delayed"` too (its round in flight is
  dropped: the members' state it loads holds that round when they committed it).

Checkpoints taken at a boundary go through `checkpoint`, which handles a coordinator found gone
there (an overlapped outer step's round ends in its checkpoint) the same way.

A stop signal (SIGTERM, SIGINT) mid-round ends a mesh node at the round's end when that comes
within `train.stop_within_s` (every node told to stop together stops at the same boundary).
Otherwise, and when the outer step is synchronous, the node leaves now (`leave_now`): it
leaves the mesh at once, so the others go on without waiting for a heartbeat timeout, and
checkpoints the committed state, the last boundary exactly; the same command rejoins later.
"""

from __future__ import annotations

import torch.distributed as dist

from prime_mesh import CoordinatorGone
from prime_train.diloco.committed import CommittedState
from prime_train.diloco.rejoin import MEMBERSHIP_LOST, rejoin_running_job
from prime_train.run import Run
from prime_train.seam import ElasticOuterStep, OuterStep, OuterStepReport


class OuterBoundary:
    """The outer step at each boundary of the loop, and its committed state (module doc)."""

    def __init__(self, run: Run, outer: OuterStep, start: int):
        self.run, self.outer = run, outer
        # a mesh node's outer step (train() checked it implements the elastic seam)
        self.elastic = outer if isinstance(outer, ElasticOuterStep) else None
        # an overlapped step drops its round in flight on the loss (`reattach`): the state it
        # rejoins with, the members', already holds that round if they committed it
        self.can_rejoin = self.elastic is not None and run.placement.membership is not None
        self.committed = CommittedState.take(run, start)
        self.rejoins = 0
        self.step_seconds = 0.0  # a running mean of the inner step's time

    def add_compute_time(self, seconds: float) -> None:
        """One inner step's time: for the outer step, and to know how far a round's end is."""
        self.outer.add_compute_time(seconds)
        self.step_seconds = (
            seconds if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * seconds
        )

    def due(self, step: int) -> bool:
        """Whether inner step `step` ends a round (the last step always does)."""
        return self.outer.is_boundary(step) or step == self.run.cfg.train.steps

    def sync(self, step: int) -> int:
        """The outer step after inner step `step`; returns the step the loop continues from
        (later than `step` after a rejoin: the members' round the node entered)."""
        report: OuterStepReport | None = None
        try:
            self.outer.start(step)
            if not self.outer.overlapped or step == self.run.cfg.train.steps:
                report = self.outer.finish()  # the final model: the outer weights
        except CoordinatorGone as e:
            self._coordinator_gone(e)
        except MEMBERSHIP_LOST as e:
            if not self.can_rejoin or self.elastic is None:
                raise
            self.rejoins += 1
            step = rejoin_running_job(self.run, self.elastic, e, self.rejoins)
        self.committed = CommittedState.take(self.run, step, report)
        return step

    def checkpoint(self, step: int) -> None:
        """Checkpoint inner step `step` (a boundary)."""
        try:
            self.run.checkpoint(step, self.outer)
        except CoordinatorGone as e:
            self._coordinator_gone(e)

    def should_leave_now(self, step: int) -> bool:
        """Told to stop after inner step `step`, mid-round: whether the node leaves now rather
        than at the round's end (see module doc). The node's ranks decide alike."""
        run, elastic = self.run, self.elastic
        if elastic is None or run.placement.membership is None or self.outer.overlapped:
            return False
        end = min(elastic.round_end(step), run.cfg.train.steps)
        decision = [(end - step) * self.step_seconds > run.cfg.train.stop_within_s]
        if run.placement.world_size > 1:
            dist.broadcast_object_list(decision, group_src=0, group=run.placement.group)
        return bool(decision[0])

    def leave_now(self) -> int:
        """Leave the mesh at once, then checkpoint the committed state (the last boundary);
        returns its step."""
        membership = self.run.placement.membership
        assert membership is not None and self.elastic is not None
        membership.close()
        self.committed.checkpoint(self.run, self.elastic)
        return self.committed.step

    def joiners_waiting(self) -> bool:
        """Whether a node waits to join (it needs a checkpoint of the round that starts now)."""
        return self.elastic is not None and self.elastic.joiners_waiting()

    def _coordinator_gone(self, error: CoordinatorGone) -> None:
        """Checkpoint the last committed outer step and raise the line that says how to
        resume from it."""
        if self.elastic is None:
            raise error
        committed = self.committed
        committed.checkpoint(self.run, self.elastic)
        mesh = self.run.cfg.mesh
        raise CoordinatorGone(
            f"the coordinator at {mesh.coordinator} did not come back within "
            f"mesh.coordinator_grace_s={mesh.coordinator_grace_s:g}s; checkpointed step "
            f"{committed.step} (the last committed outer step; the inner steps since are "
            "dropped). To resume from it, start the coordinator again and rerun the same "
            "command on every node"
        ) from error
