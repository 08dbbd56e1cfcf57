"""One DiLoCo outer step, start to finish: the one place where the trainer meets the mesh.

Every H inner steps the trainer calls `start(step)` then `finish()`:

1. `start` computes this rank's pseudo-gradient (outer weights - current weights).
2. `finish` re-forms the inter-node group at the sync point (`maybe_reinit_global_pg`: dead
   nodes leave, joiners enter), averages the pseudo-gradients in one compressed all-reduce
   (`diloco/average.py`, with the mesh's deadline and abort flag), and asks every member
   whether its all-reduce succeeded (`should_commit`). Only if all say yes is the outer
   Nesterov step applied; otherwise outer weights and momentum are untouched, the group
   re-forms without the suspect, and the attempt is repeated over the nodes actually present.
   With `[diloco] error_feedback`, each attempt sends the pseudo-gradient plus this node's
   quantization residual, kept only from a committed attempt (`diloco/error_feedback.py`).
3. The report (time, bytes, nodes, epoch, weight hash) goes to the log and the metrics
   (`diloco/round_log.py`).

A joiner's rounds are `enter(step)`: the same step, contributing nothing, as a listener
(`diloco/listen.py`) until it holds the members' state (see `diloco/join.py`).

Here `finish` follows `start` at once (`[diloco] overlap = "none"`); `diloco/delayed.py` builds
the overlapped step on the same pieces, its all-reduce running in the background while the
next inner steps compute. Where to resume is agreed through it too
(`diloco/resume_agreement.py`). A round's nominal span is `inner_steps` inner steps
(`is_boundary`, `round_end`); with `[diloco] round_seconds` the loop may end it earlier
(`outer_boundary.py`) and the average weighs each node by its reads (`diloco/average.py`).
With `[diloco] fragments = F` a round is H / F steps and its sync averages one fragment of the
model, chosen by the committed count (`diloco/fragments.py`, `part`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext, suppress
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from prime_mesh import MeshError
from prime_train import faults
from prime_train.config import DilocoConfig
from prime_train.diloco.average import Averaged, average_pseudo_gradient
from prime_train.diloco.contribution import every_rank, outlier, stated_norm
from prime_train.diloco.error_feedback import ErrorFeedback
from prime_train.diloco.fragments import build
from prime_train.diloco.join_side import JoinSide
from prime_train.diloco.listen import JoinedLate, Listener, settle_late, sync_count, sync_part
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.diloco.replay_log import Entry, ReplayLog
from prime_train.diloco.resume_agreement import agree_resume_step, check_holds_run_state
from prime_train.diloco.round_log import (
    RoundLog,
    join_cost,
    joiners_waiting,
    members_before,
    round_counts,
    run_summary,
)
from prime_train.diloco.update_codec import Encoded
from prime_train.metrics import Log, Metrics
from prime_train.seam import OuterStepReport

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh
    from prime_train.slot_loader import SlotLoader


class OuterStepFailed(RuntimeError):
    """The outer step could not be agreed on within the allowed retries."""


class Diloco(JoinSide):
    """DiLoCo across the nodes of an elastic mesh: the trainer's outer step (see module doc).

    Implements the trainer's seam whole (`prime_train.seam.ElasticOuterStep`): the step
    (`start`/`finish`), a joiner's rounds (`enter`; what else joining uses: `JoinSide`), its
    state for checkpoints, loading it, and agreeing where to resume.
    """

    overlapped = False  # `finish` follows `start` at once

    def __init__(
        self,
        cfg: DilocoConfig,
        mesh: ElasticDeviceMesh,
        params: list[torch.Tensor],
        metrics: Metrics | None = None,
        log: Log | None = None,
        max_retries: int = 3,
        node_group: dist.ProcessGroup | None = None,
        data: SlotLoader | None = None,
        names: list[str] | None = None,
        replay_log: ReplayLog | None = None,
    ):
        """`params` are this rank's (sharded) parameters; `node_group` is the node's own process
        group when it has several ranks (each averages its shard in its own inter-node group);
        `data`: the node's data slots, whose positions move with each committed round;
        `names`: the parameters' names (needed with `[diloco] fragments` > 1); `replay_log`:
        where each committed update goes for joiners to replay (`diloco/replay_log.py`)."""
        self.cfg, self.mesh, self.log, self.data = cfg, mesh, log, data
        self.node_group = node_group if node_group and dist.get_world_size(node_group) > 1 else None
        # each sync averages one fragment (`diloco/fragments.py`; F = 1: the whole model)
        self.fragments = build(params, names, cfg.fragments, cfg.outer_lr, cfg.outer_momentum)
        self.optimizer: OuterOptimizer = self.fragments.optimizer
        self.period = cfg.inner_steps // cfg.fragments  # inner steps between two syncs
        self.feedback = ErrorFeedback(self.optimizer.weights.numel(), cfg.error_feedback)
        self.max_retries = max_retries
        self.rounds = RoundLog(self.optimizer, cfg.compression, self.node_group, metrics, log)
        self.totals = self.rounds.totals
        self._started: tuple[int, float] | None = None  # (inner step, start time) of the round
        self.round_inner_steps = 0  # inner steps this node ran since its last outer step
        self.replay_log = replay_log
        self.listener: Listener | None = None  # while this joiner listens (`listen`)
        self.admitted_now = False  # this member's last round admitted a node (checkpoint)
        with suppress(MeshError):  # a joiner: not admitted yet (a lost coordinator: not raised)
            self.rounds.last_epoch, members = mesh.installed_group
            self.rounds.nodes_now = len(members)

    # -- rounds -----------------------------------------------------------------------------

    def is_boundary(self, step: int) -> bool:
        """Inner step `step` ends a round: every `inner_steps` / `fragments` steps."""
        return step % self.period == 0

    def round_end(self, step: int) -> int:
        """The inner step that ends the round running after inner step `step`."""
        return (step // self.period + 1) * self.period

    # -- the outer step ---------------------------------------------------------------------

    def add_compute_time(self, seconds: float) -> None:
        """The loop reports each inner step's time (for the compute utilisation figure)."""
        self.rounds.add_compute_time(seconds)
        self.round_inner_steps += 1

    def start(self, step: int) -> None:
        """Begin the outer step that follows inner step `step`: compute the pseudo-gradient."""
        if self._started is not None:
            raise RuntimeError("the previous outer step was started but not finished")
        self._started = (step, time.monotonic())
        with self.rounds.own.counting():
            self.part.compute_pseudo_gradient()

    def finish(self) -> OuterStepReport:
        """Average over the live nodes, agree, apply (retrying on failure); report it."""
        return self._complete(contributing=True)

    def enter(self, step: int) -> OuterStepReport | None:
        """A joiner's first round, ending at inner step `step` (see the seam): its model is
        the outer weights it loaded, so it brings a zero pseudo-gradient and the average is
        taken over the nodes that contributed. JoinedLate if it cannot use the result. None:
        a round it only listened to (admitted late, `self.listener` set: call again with the
        listener's next round)."""
        self.feedback.reset()
        if self.fragments.count > 1:  # its local weights: the shared outer ones, not the donor's
            self.optimizer.load_into_model()
        self.start(step)
        return self._complete(contributing=False)

    def _complete(self, contributing: bool) -> OuterStepReport | None:
        if self._started is None:
            raise RuntimeError("finish() without start()")
        step, t0 = self._started
        reads = None
        if self.data is not None:
            self.data.end_round()
            reads = self.data.uncommitted()
            contributing = contributing and any(reads)  # a node that read nothing trained none
        errors: list[str] = []
        try:
            for attempt in range(1, self.max_retries + 2):
                part = sync_part(self)  # (a listener's: the members' fragment)
                if attempt > 1:  # the failed all-reduce may have overwritten the buffer
                    with self.rounds.own.counting():
                        part.compute_pseudo_gradient()
                before = members_before(self.mesh)
                contributing, sync_seconds = self._sync_point(part, contributing)
                with (  # a listener's snapshot leaves the link to the all-reduce meanwhile
                    self.listener.collective() if self.listener is not None else nullcontext()
                ):
                    got = self.average(contributing, reads, step=step)
                if self.vote(got, contributing):
                    faults.stall_after_vote(self.outer_steps + 1, self.log)  # (a test's)
                    settled = settle_late(self, got, step, contributing)  # (not its own?)
                    if settled is None:
                        return None  # a round it only listened to
                    step = settled
                    fragment = self.fragments.index(self.outer_steps)  # (before it counts)
                    with self.rounds.own.counting():
                        self.part.apply()
                    extra = self._commit_data(got.consumed, self.mesh.installed_group[1])
                    seconds = time.monotonic() - t0
                    cost = join_cost(self.mesh, before, sync_seconds)
                    self.admitted_now = bool(cost)  # (its snapshot: checkpoint this round)
                    extra = {**(extra or {}), **self.feedback.metrics(), **cost,
                             "sync_seconds": round(sync_seconds, 3),  # (waiting for the others)
                             **({"fragment": fragment} if self.fragments.count > 1 else {}),
                             **round_counts(self.round_inner_steps, self.data, got.consumed,
                                            reads if contributing and got.late is None
                                            else None)}  # fmt: skip
                    report = self.rounds.record(
                        self.mesh, step, attempt, seconds, got.stats, got.contributors,
                        extra=extra,
                    )  # fmt: skip
                    self.log_update(report, encoded=got.encoded)
                    return report
                errors.append(got.error or "a peer failed")
                self._warn(
                    f"outer step attempt {attempt} not committed ({errors[-1]}); "
                    "re-forming the group and retrying"
                )
        finally:
            self._started = None
            self.round_inner_steps = 0
        raise OuterStepFailed(
            f"outer step failed {len(errors)} times ({'; '.join(errors)}); "
            "outer weights are unchanged"
        )

    def _sync_point(self, part: OuterOptimizer, contributing: bool) -> tuple[bool, float]:
        """This attempt's sync point, with the norm this node states (`diloco/contribution.py`:
        bad numbers or a norm far outside the others' leave it out of the round, not the run;
        its model takes the committed weights at apply): (contributing, seconds)."""
        outer_step = self.outer_steps + 1
        norm2 = stated_norm(part.pseudo_gradient, outer_step, self.log) if contributing else None
        contributing = norm2 is not None
        t = time.monotonic()
        self.mesh.maybe_reinit_global_pg(  # a listener may come a round early:
            listening=self.listener is not None,  # not its clock
            norm2=norm2,
            norm_bound=self.cfg.norm_bound,
        )
        if contributing and outlier(self.mesh.norm_outlier, outer_step, self.cfg.norm_bound,
                                    self.log):  # fmt: skip
            contributing = False
        if not every_rank(contributing, self.node_group):  # (one bad shard: the node's out)
            contributing = False
            part.pseudo_gradient.zero_()
        return contributing, time.monotonic() - t

    def average(
        self,
        contributing: bool,
        reads: list[int] | None = None,
        count: int | None = None,
        step: int | None = None,
    ) -> Averaged:
        """One attempt's average of the pseudo-gradient over the mesh's group, after its sync
        point; `contributing` is False for a joiner's first round or a node left out of it;
        `reads`: the node's uncounted reads per data slot; `count`: the committed count it
        states and takes its fragment from (default `listen.sync_count`: a listener's is
        the members'); `step`: its inner step there (a listener learns the members' from the
        header)."""
        count = sync_count(self) if count is None else count
        feedback = self.feedback.prepare(contributing, self.fragments.span(count))
        return average_pseudo_gradient(
            self.mesh,
            self.fragments.part(count).pseudo_gradient,
            self.cfg.compression,
            count,
            contributing=contributing,
            reads=reads,
            feedback=feedback,
            weighted=self.cfg.round_seconds > 0,
            # a late joiner's (zero) payload: the fragment of the members' count, not its own
            payload_for=self.fragments.payload_for if self.fragments.count > 1 else None,
            step=step,  # (the update log and a listener's kept rounds store these bytes:)
            keep_encoding=self.replay_log is not None or self.listener is not None,
        )

    # -- the update log and replaying it --------------------------------------------------

    @property
    def local_rank(self) -> int:
        return dist.get_rank(self.node_group) if self.node_group is not None else 0

    def log_update(self, report: OuterStepReport, step: int | None = None,
                   encoded: Encoded | None = None) -> None:  # fmt: skip
        """Append the update just applied (the pseudo-gradient buffer) to the update log;
        `step`: the inner step of the round it belongs to (default: the report's); `encoded`:
        the same update as its all-reduce's bytes (stored instead of the floats)."""
        if self.replay_log is None:
            return
        rank = self.local_rank
        with self.rounds.own.counting():  # (packed here: counted in the next round's row)
            entry = Entry(
                outer_step=report.outer_step,
                step=report.step if step is None else step,
                rank=rank,
                outer_sha256=report.outer_sha256,
                shard_sha256=self.rounds.last_shards[rank],
                update=self.fragments.part(report.outer_step - 1).pseudo_gradient,
                # the data slots' shared state after the round: a joiner takes the last one
                # it replays (none of the members' own reads)
                shared=self.data.shared_state() if self.data is not None else {},
            ).pack(encoded)
        self.replay_log.append(entry)  # (waits for the last entry's write first)

    def _commit_data(
        self, consumed: list[float] | None, members: tuple[str, ...] | list[str]
    ) -> dict[str, Any] | None:
        """A committed round: move the data slots' positions by the counted reads and hand the
        slots to `members`; the row's `data`: this node's counted reads, {slot: [from, to)}."""
        if self.data is None or consumed is None:
            return None
        return {"data": self.data.commit(consumed, members)}

    def vote(self, got: Averaged, contributed: bool = True) -> bool:
        """Ask every member whether this attempt's all-reduce worked (`should_commit`); if all
        say yes and the average counted this node, its new residual becomes its own.
        `contributed`: this node sent its pseudo-gradient (only then is its outer state
        compared with the others': a joiner's may lag until it caught up)."""
        if self.listener is not None and got.error is None:  # (a test's fault hook)
            got.error = faults.listener_round_fails(self.log)
        committed = self.mesh.should_commit(got.error is None, contributed=contributed)
        if committed and got.error is not None:  # (a listener: its ballot is not waited for)
            raise JoinedLate(f"its all-reduce failed while the members committed: {got.error}")
        if committed and got.late is None:
            self.feedback.commit()
        return committed

    # -- checkpoints and resuming -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint adds for DiLoCo: outer weights, momentum and comm totals (and,
        with error feedback, this node's residual)."""
        state = {"outer": self.optimizer.state_dict(), "totals": dict(self.totals)}
        if self.feedback.enabled:
            state["error_feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a loaded `state_dict()` (its tensors may already be the live buffers)."""
        self.optimizer.load_state_dict(state["outer"])
        self.totals.update(state["totals"])
        if self.feedback.enabled:
            self.feedback.load_state_dict(state["error_feedback"])
        # where this node is, should the coordinator restart before the next outer step
        digest = self.rounds.node_digest()
        self.mesh.note_outer_step(self.rounds.outer_steps, digest)
        if self.log is not None:  # (what a resume restored, against the rows before it)
            self.log.info(f"loaded outer step {self.rounds.outer_steps}: outer_sha256 {digest}")

    def agree_resume_step(self, local_steps: list[int]) -> int | None:
        """The newest checkpoint step any node holds in all its ranks (None: a fresh run, no
        node holds any): agreed inside the node first, then across nodes, each in one
        all-gather. LacksNewestStep on a node that does not hold it (it joins the run the
        holders form); NothingToFormFrom where none holds the newest step a node of the run
        reported (it is away); see `diloco/resume_agreement.py`."""
        step = agree_resume_step(
            local_steps, self.node_group, self.mesh.global_pg, self.mesh.global_world_size
        )
        check_holds_run_state(self.mesh.newest_checkpoint, step)
        if step is None:  # a fresh run: its first vote compares the starting weights too
            self.mesh.note_outer_step(0, self.rounds.node_digest())
        return step

    # -- membership -------------------------------------------------------------------------

    def joiners_waiting(self) -> bool:
        """Whether a node is registered but not a member yet, or was admitted at this round's
        sync point (see `round_log.joiners_waiting`)."""
        return joiners_waiting(self.mesh, self.node_group, self.admitted_now)

    def rollback_to_outer(self) -> None:
        """Put the model back to the outer weights, the state every node shares since the last
        commit (a coordinator that did not come back: see `diloco/committed.py`)."""
        self.optimizer.load_into_model()

    def reattach(self, mesh: ElasticDeviceMesh) -> None:
        """Use `mesh`, a new registration of this node after it lost its membership (see
        `diloco/rejoin.py`): forget the old one's view; the state comes with the next load."""
        self.mesh, self._started = mesh, None
        self.round_inner_steps = 0
        self.rounds.forget_round()

    def close(self) -> None:
        """Wait for the update log's last write (nothing else runs in the background of a
        synchronous outer step)."""
        if self.replay_log is not None:
            self.replay_log.close()

    def summary(self) -> dict[str, Any]:
        """Totals and settings for the run's summary."""
        return run_summary(self.cfg, self.rounds)

    def _warn(self, msg: str) -> None:
        if self.log is not None:
            self.log.warn(msg)
