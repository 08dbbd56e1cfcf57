"""One DiLoCo outer step, start to finish: the one place where the trainer meets the mesh.

Every H inner steps the trainer calls `start(step)` then `finish()`:

1. `start` computes this rank's pseudo-gradient (outer weights - current weights).
2. `finish` re-forms the inter-node group at the sync point (`maybe_reinit_global_pg`: dead
   nodes leave, joiners enter), averages the pseudo-gradients in one compressed all-reduce
   (`prime_comm.all_reduce`, with the mesh's deadline and abort flag), and asks every member
   whether its all-reduce succeeded (`should_commit`). Only if all say yes is the outer
   Nesterov step applied; otherwise outer weights and momentum are untouched, the group
   re-forms without the suspect, and the attempt is repeated over the nodes actually present.
3. The report (time, bytes, nodes, epoch, weight hash) goes to the log and the metrics.

Here `finish` follows `start` at once (`[diloco] overlap = "none"`); `diloco/delayed.py` builds
the overlapped step on the same pieces, its all-reduce running in the background while the
next inner steps compute. Where to resume is agreed through it too
(`diloco/resume_agreement.py`). Every row also carries the round's compute utilisation: inner
compute time (`add_compute_time`, from the loop) over the wall time since the previous outer
step ended.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import prime_comm
from prime_mesh import MeshError
from prime_train.config import DilocoConfig
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.diloco.resume_agreement import agree_resume_step
from prime_train.metrics import Log, Metrics
from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh


def _combined(shards: list[str]) -> str:
    """The outer weights' hash of a node: its one shard's, or the hash of its shards' hashes
    in local rank order."""
    return shards[0] if len(shards) == 1 else hashlib.sha256("".join(shards).encode()).hexdigest()


class OuterStepFailed(RuntimeError):
    """The outer step could not be agreed on within the allowed retries."""


class JoinedLate(RunDirError):
    """A joiner was admitted at a later outer step than the state it loaded: its weights
    would differ from the members', so it leaves (the members go on without waiting)."""


@dataclass
class OuterStepReport:
    """What one applied outer step cost and who took part."""

    step: int  # the inner step it followed
    outer_step: int  # applied outer steps so far in the run, this one included
    attempts: int
    seconds: float
    allreduce_seconds: float
    bytes_sent: int
    nodes: int
    epoch: int
    outer_sha256: str
    contributors: int = 0  # nodes whose pseudo-gradients were averaged (a joiner's is not)
    compute_seconds: float = 0.0  # inner compute of the round that ended with this report
    round_seconds: float = 0.0  # its wall time (from the previous outer step's end)


class Diloco:
    """DiLoCo across the nodes of an elastic mesh: the trainer's outer step (see module doc).

    Implements the trainer's `OuterStep` seam whole: the step (`start`/`finish`), its state
    for checkpoints, loading it, and agreeing where to resume.
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
    ):
        """`params` are this rank's (sharded) parameters; `node_group` is the node's own process
        group when it has several ranks (each averages its shard in its own inter-node group)."""
        self.cfg, self.mesh, self.metrics, self.log = cfg, mesh, metrics, log
        self.node_group = node_group if node_group and dist.get_world_size(node_group) > 1 else None
        self.optimizer = OuterOptimizer(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.max_retries = max_retries
        self.totals = {"outer_steps": 0, "comm_bytes": 0, "comm_seconds": 0.0,
                       "compute_seconds": 0.0, "round_seconds": 0.0}  # fmt: skip
        self._compute = 0.0  # inner compute since the last outer step ended
        self._boundary: float | None = None  # when the last outer step ended
        self._started: tuple[int, float] | None = None  # (inner step, start time) of the round
        admitted = mesh.state == "member"  # a joiner is not admitted before its first step
        self._last_epoch = mesh.epoch if admitted else None
        self._nodes_now = mesh.global_world_size if admitted else 0  # as of the last outer step
        # False for a joiner's entry step: it brings no pseudo-gradient (zero), and the
        # average is taken over the nodes that contributed
        self.contributing = True
        self._contributors = 0  # of the last average
        self._late: str | None = None  # a joiner admitted after the state it loaded

    # -- the outer step ---------------------------------------------------------------------

    def add_compute_time(self, seconds: float) -> None:
        """The loop reports each inner step's time (for the compute utilisation figure)."""
        if self._boundary is None:  # the first round begins with its first inner step
            self._boundary = time.monotonic() - seconds
        self._compute += seconds

    def start(self, step: int) -> None:
        """Begin the outer step that follows inner step `step`: compute the pseudo-gradient."""
        if self._started is not None:
            raise RuntimeError("the previous outer step was started but not finished")
        self._started = (step, time.monotonic())
        self.optimizer.compute_pseudo_gradient()

    def finish(self) -> OuterStepReport:
        """Average over the live nodes, agree, apply (retrying on failure); report it."""
        if self._started is None:
            raise RuntimeError("finish() without start()")
        step, t0 = self._started
        errors: list[str] = []
        try:
            for attempt in range(1, self.max_retries + 2):
                if attempt > 1:  # the failed all-reduce may have overwritten the buffer
                    self.optimizer.compute_pseudo_gradient()
                regrouped = self.mesh.maybe_reinit_global_pg()
                stats, error = self._average(regrouped=regrouped)
                if self.mesh.should_commit(error is None):
                    if self._late is not None:  # the members commit; this node leaves
                        raise JoinedLate(self._late)
                    self.optimizer.apply()
                    return self._record(step, attempt, time.monotonic() - t0, stats)
                errors.append(error or "a peer failed")
                self._warn(
                    f"outer step attempt {attempt} not committed ({errors[-1]}); "
                    "re-forming the group and retrying"
                )
        finally:
            self._started = None
        raise OuterStepFailed(
            f"outer step failed {len(errors)} times ({'; '.join(errors)}); "
            "outer weights are unchanged"
        )

    def _average(
        self, regrouped: bool = False
    ) -> tuple[prime_comm.AllReduceStats | None, str | None]:
        """All-reduce (average) the pseudo-gradient in place; returns (stats, error).

        After the group changed (`regrouped`: the same on every member) the nodes first sum a
        two-number header: how many contribute a pseudo-gradient (a joiner's entry step does
        not) and their outer step counts, which must all be equal. The average is then over
        the contributors: every node scales the same bits by the same factor."""
        mesh, t = self.mesh, time.monotonic()
        world = mesh.global_world_size
        self._contributors = world
        try:
            if regrouped or not self.contributing:
                header = torch.tensor(
                    [float(self.contributing), float(self.totals["outer_steps"])],
                    dtype=torch.float32,
                )
                prime_comm.all_reduce(
                    header,
                    group=mesh.global_pg,
                    op="sum",
                    compression="none",
                    timeout=mesh.collective_timeout(),
                    should_abort=mesh.should_abort,
                )
                self._contributors = round(float(header[0]))
                mine = self.totals["outer_steps"]
                if float(header[1]) != float(world * mine):
                    if not self.contributing:
                        others = (float(header[1]) - mine) / max(world - 1, 1)
                        self._late = (
                            f"admitted after {others:.0f} outer steps but loaded the state "
                            f"of {mine}: the fetch outlasted a round. Rerun the same command "
                            "to join again"
                        )
                    else:
                        self._warn("a node entered with another outer step count; it leaves")
            stats = prime_comm.all_reduce(
                self.optimizer.pseudo_gradient,
                group=mesh.global_pg,
                op="avg",
                compression=self.cfg.compression,
                timeout=mesh.collective_timeout(),
                should_abort=mesh.should_abort,
            )
        except Exception as e:  # the vote tells every member; all re-form and retry
            mesh.record_collective(time.monotonic() - t, ok=False)
            return None, f"{type(e).__name__}: {e}"
        mesh.record_collective(time.monotonic() - t)
        if 0 < self._contributors < world:  # the average over the nodes that contributed
            self.optimizer.pseudo_gradient.mul_(world / self._contributors)
        if not bool(torch.isfinite(self.optimizer.pseudo_gradient).all()):
            return stats, "averaged pseudo-gradient is not finite"
        return stats, None

    def _record(
        self,
        step: int,
        attempts: int,
        seconds: float,
        stats: prime_comm.AllReduceStats | None,
        extra: dict[str, Any] | None = None,
        note: str = "",
    ) -> OuterStepReport:
        """Count, log and write one applied outer step (`extra`: more keys for its row)."""
        shards, node_bytes = self._node_figures(stats.bytes_sent if stats else 0)
        compute, wall = self._end_round()
        t = self.totals
        t["outer_steps"] += 1
        digest = _combined(shards)  # several ranks: the hash of the shards' hashes, in order
        self.mesh.note_outer_step(t["outer_steps"], digest)
        t["comm_bytes"] += node_bytes
        t["comm_seconds"] += stats.seconds if stats else 0.0
        report = OuterStepReport(
            step=step,
            outer_step=t["outer_steps"],
            attempts=attempts,
            seconds=seconds,
            allreduce_seconds=stats.seconds if stats else 0.0,
            bytes_sent=node_bytes,
            nodes=self.mesh.global_world_size,
            epoch=self.mesh.epoch,
            contributors=self._contributors or self.mesh.global_world_size,
            outer_sha256=digest,
            compute_seconds=compute,
            round_seconds=wall,
        )
        self._nodes_now = report.nodes
        if report.epoch != self._last_epoch:
            try:
                ids = [m.get("node_id") for m in self.mesh.members()]
            except MeshError as e:  # the coordinator was lost after the vote: the next sync
                ids = f"(members unknown: {type(e).__name__})"  # point reconnects
            self._info(f"mesh epoch {report.epoch}: {report.nodes} node(s) {ids}")
            self._last_epoch = report.epoch
        self._info(
            f"outer step {report.outer_step} at step {step} | {seconds:.2f} s "
            f"(all-reduce {report.allreduce_seconds:.2f} s, {report.bytes_sent / 1e6:.2f} MB "
            f"sent, {self.cfg.compression}) | {report.nodes} node(s), epoch {report.epoch}"
            + (f" | {attempts} attempts" if attempts > 1 else "")
            + note
            + (f" | compute {compute:.2f} of {wall:.2f} s ({compute / wall:.0%})" if wall else "")
        )
        if self.metrics is not None:
            self.metrics.write(
                {
                    "step": step,
                    "outer_step": report.outer_step,
                    "outer_seconds": report.seconds,
                    "allreduce_seconds": report.allreduce_seconds,
                    "bytes_sent": report.bytes_sent,
                    "nodes": report.nodes,
                    "contributors": report.contributors,
                    "epoch": report.epoch,
                    "attempts": report.attempts,
                    "outer_sha256": report.outer_sha256,
                    **({"shard_sha256": shards} if len(shards) > 1 else {}),
                    **(extra or {}),
                    "compute_s": compute,
                    "round_s": wall,
                    "compute_utilisation": compute / wall if wall else None,
                }
            )
        return report

    def _end_round(self) -> tuple[float, float]:
        """(inner compute, wall) seconds of the round since the last outer step ended; the
        next round's wall clock starts now (the caller's remaining work is counted in it)."""
        now = time.monotonic()
        compute, wall = self._compute, now - self._boundary if self._boundary else 0.0
        self._compute, self._boundary = 0.0, now
        if wall:
            self.totals["compute_seconds"] += compute
            self.totals["round_seconds"] += wall
        return compute, wall

    def _node_figures(self, bytes_sent: int) -> tuple[list[str], int]:
        """The SHA-256 of each local rank's shard of the outer weights (in local rank order)
        and the bytes the node's ranks sent together."""
        mine = (self.optimizer.digest(), bytes_sent)
        if self.node_group is None:
            return [mine[0]], bytes_sent
        out: list[Any] = [None] * dist.get_world_size(self.node_group)
        dist.all_gather_object(out, mine, group=self.node_group)
        return [str(d) for d, _ in out], sum(int(b) for _, b in out)

    # -- checkpoints and resuming -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint adds for DiLoCo: outer weights, momentum and comm totals."""
        return {"outer": self.optimizer.state_dict(), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a loaded `state_dict()` (its tensors may already be the live buffers)."""
        self.optimizer.load_state_dict(state["outer"])
        self.totals.update(state["totals"])
        # where this node is, should the coordinator restart before the next outer step
        self.mesh.note_outer_step(
            int(self.totals["outer_steps"]), _combined(self._node_figures(0)[0])
        )

    def agree_resume_step(self, local_steps: list[int]) -> int | None:
        """The newest checkpoint step every rank of every node holds (None: a fresh run, no
        node holds any): agreed inside the node first, then across nodes, each in one
        all-gather. NoCommonCheckpoint, on every node alike, when nodes hold checkpoints but
        share none: starting over would throw the run's progress away."""
        return agree_resume_step(
            local_steps, self.node_group, self.mesh.global_pg, self.mesh.global_world_size
        )

    def joiners_waiting(self) -> bool:
        """Whether a node is registered but not a member yet (it needs the state of the round
        that starts now: the loop then checkpoints). The node's ranks answer alike."""
        try:
            mine = [any(m.get("state") != "member" for m in self.mesh.members())]
        except Exception:  # the coordinator is briefly unreachable: the next boundary asks
            mine = [False]
        if self.node_group is not None:
            dist.broadcast_object_list(mine, group_src=0, group=self.node_group)
        return bool(mine[0])

    def rollback_to_outer(self) -> None:
        """Put the model back to the outer weights, the state every node shares since the last
        commit (a coordinator that did not come back: see `diloco/committed.py`)."""
        self.optimizer.load_into_model()

    def reattach(self, mesh: ElasticDeviceMesh) -> None:
        """Use `mesh`, a new registration of this node after it lost its membership (see
        `diloco/rejoin.py`): forget the old one's view; the state comes with the next load."""
        self.mesh, self._last_epoch, self._nodes_now = mesh, None, 0
        self._late, self._started, self._boundary, self._compute = None, None, None, 0.0
        self.contributing = True

    def summary(self) -> dict[str, Any]:
        """Totals and settings for the run's summary."""
        d = self.cfg
        t = self.totals
        return {
            **t,
            "compute_utilisation": (
                t["compute_seconds"] / t["round_seconds"] if t["round_seconds"] else None
            ),
            "overlap": d.overlap,
            "inner_steps": d.inner_steps,
            "outer_lr": d.outer_lr,
            "outer_momentum": d.outer_momentum,
            "compression": d.compression,
            "nodes_now": self._nodes_now,
        }

    def _info(self, msg: str) -> None:
        if self.log is not None:
            self.log.info(msg)

    def _warn(self, msg: str) -> None:
        if self.log is not None:
            self.log.warn(msg)
