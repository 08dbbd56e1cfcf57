"""What the loop does at an outer boundary: the outer step, and what a mesh node does when its
membership is lost there.

`OuterBoundary.sync(step)` takes the outer step and keeps the committed state
(`diloco/committed.py`) of the boundary. A lost membership has one handler per kind:

- the coordinator did not come back within `mesh.coordinator_grace_s` (`CoordinatorGone`):
  checkpoint the last committed outer step and exit with a line saying how to resume;
- evicted (a cut link, a stall, left out of a round: `MeshEvicted`) or the coordinator lost
  (`CoordinatorLost`): rejoin the others by itself through live recovery
  (`diloco/rejoin.py`), when it can; with `overlap = "delayed"` too (its round in flight is
  dropped: the members' state it loads holds that round when they committed it). A stop
  signal during the rejoin, or one received before it, ends the node at once (exit 0, its
  last checkpoint stands), as during a first join: the rejoin may listen for as long as the
  mesh's join_timeout.

With `[diloco] round_seconds = T > 0` a round ends when it has lasted T seconds from its
first inner step, or would after one more step at the node's recent pace (at least
`min_inner_steps`, at most `inner_steps` steps, decided alike by the node's ranks). The
run's position still moves by `inner_steps` per committed round: the loop's step jumps to
the round's nominal end (`round_start + inner_steps`), so every boundary stays a multiple
of H and the learning rate, `train.steps`, the checkpoint and evaluation cadences follow the
rounds the whole run committed, not a node's own count.

Checkpoints taken at a boundary go through `checkpoint`, which handles a coordinator found gone
there (an overlapped outer step's round ends in its checkpoint) the same way.

A stop signal (SIGTERM, SIGINT) mid-round ends a mesh node at the round's end when that comes
within `train.stop_within_s`. Nodes told to stop together stop at the same boundary where
each finds it within its bound (each estimates from its own step time: near the bound, one
may stay for the round's end and commit it without another that left). Otherwise, and when
the outer step is synchronous, the node leaves now (`leave_now`): it
leaves the mesh at once, so the others go on without waiting for a heartbeat timeout, and
checkpoints the committed state, the last boundary exactly; the same command rejoins later.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from prime_mesh import CoordinatorGone
from prime_train.diloco.committed import CommittedState
from prime_train.diloco.rejoin import (
    MEMBERSHIP_LOST,
    check_missed_allowed,
    left_out,
    rejoin_running_job,
)
from prime_train.run import Run
from prime_train.seam import ElasticOuterStep, OuterStep, OuterStepReport
from prime_train.stop import StopSignal


class OuterBoundary:
    """The outer step at each boundary of the loop, and its committed state (module doc)."""

    def __init__(self, run: Run, outer: OuterStep, start: int, stop: StopSignal):
        self.run, self.outer, self.stop = run, outer, stop
        # a mesh node's outer step (train() checked it implements the elastic seam)
        self.elastic = outer if isinstance(outer, ElasticOuterStep) else None
        # an overlapped step drops its round in flight on the loss (`reattach`): the state it
        # rejoins with, the members', already holds that round if they committed it
        self.can_rejoin = self.elastic is not None and run.placement.membership is not None
        self.committed = CommittedState.take(run, start)
        self.rejoins = 0  # all rejoins (the rows' `rejoined`)
        self.lost = 0  # losses but leave-outs (`diloco.max_rejoins`, per run)
        self.missed = 0  # leave-outs in a row (`diloco.max_missed_rounds`)
        self.step_seconds = 0.0  # a running mean of the inner step's time
        d = run.cfg.diloco
        self.round_seconds = d.round_seconds
        self.min_steps, self.max_steps = d.min_inner_steps, d.inner_steps
        self.round_start = start  # the committed boundary the running round began at
        self.round_t0: float | None = None  # when its first inner step began

    def add_compute_time(self, seconds: float) -> None:
        """One inner step's time: for the outer step, and to know how far a round's end is."""
        self.outer.add_compute_time(seconds)
        self.step_seconds = (
            seconds if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * seconds
        )
        if self.round_t0 is None:
            self.round_t0 = time.monotonic() - seconds

    @property
    def timed(self) -> bool:
        """Whether rounds are time-budgeted (`[diloco] round_seconds` > 0)."""
        return self.round_seconds > 0

    def due(self, step: int) -> bool:
        """Whether inner step `step` ends a round (the last step always does)."""
        if step == self.run.cfg.train.steps:
            return True
        if not self.timed:
            return self.outer.is_boundary(step)
        ran = step - self.round_start
        if ran >= self.max_steps:
            return True
        if ran < self.min_steps:
            return False
        assert self.round_t0 is not None  # set by the step's compute time
        # no step expected to end past T (the slow node's overshoot would hold the others)
        over = [time.monotonic() - self.round_t0 + self.step_seconds > self.round_seconds]
        if self.run.placement.world_size > 1:  # the node's ranks end the round together
            dist.broadcast_object_list(over, group_src=0, group=self.run.placement.group)
        return bool(over[0])

    def sync(self, step: int) -> int:
        """The outer step after inner step `step`; returns the step the loop continues from
        (later than `step` after a rejoin: the members' round the node entered)."""
        report: OuterStepReport | None = None
        self.run.ckpt.wait_staged()  # the outer step changes what a checkpoint may still copy
        if self.timed:  # the round's nominal end: the run moves by H per committed round
            step = min(self.round_start + self.max_steps, self.run.cfg.train.steps)
        try:
            self.outer.start(step)
            if not self.outer.overlapped or step == self.run.cfg.train.steps:
                report = self.outer.finish()  # the final model: the outer weights
        except CoordinatorGone as e:
            self._coordinator_gone(e)
        except MEMBERSHIP_LOST as e:
            step = self._rejoin(e)
        else:  # this node reached the sync point in time: a round with it settled
            self.missed = 0
        self.committed = CommittedState.take(self.run, step, report)
        self.round_start, self.round_t0 = step, None
        return step

    def _rejoin(self, error: BaseException) -> int:
        """This node lost its membership (`error`): rejoin the running job (within the
        bounds) and return the step of the members' round it entered."""
        if not self.can_rejoin or self.elastic is None:
            raise error
        self.rejoins += 1
        if left_out(error):
            self.missed += 1
            check_missed_allowed(self.run, error, self.missed)
        else:
            self.lost += 1
        with self.stop.at_once_during("while rejoining the running job"):
            return rejoin_running_job(self.run, self.elastic, error, self.rejoins, bound=self.lost)

    def checkpoint(self, step: int) -> int:
        """Checkpoint inner step `step` (a boundary); returns the step the loop continues
        from: later when the node rejoined instead (overlap "delayed": a checkpoint waits for
        the round in flight, which may end in this node's eviction; the members' state it
        then loads supersedes its own)."""
        try:
            self.run.checkpoint(step, self.outer)
        except CoordinatorGone as e:
            self._coordinator_gone(e)
        except MEMBERSHIP_LOST as e:
            step = self._rejoin(e)
            self.committed = CommittedState.take(self.run, step)
            self.round_start, self.round_t0 = step, None
        return step

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
