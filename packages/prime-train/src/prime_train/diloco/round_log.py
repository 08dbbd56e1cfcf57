"""Counting, logging and writing each applied outer step, and the rounds' compute time.

A round runs from the end of one outer step to the end of the next; the loop reports each
inner step's compute time (`add_compute_time`), and every applied step's row carries the
round's compute utilisation: inner compute over the round's wall time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from prime_mesh import MeshError
from prime_train import faults
from prime_train.config import DilocoConfig
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.metrics import Log, Metrics
from prime_train.seam import OuterStepReport

if TYPE_CHECKING:
    import prime_comm
    from prime_mesh import ElasticDeviceMesh
    from prime_train.slot_loader import SlotLoader


class OwnWork:
    """The outer step's own passes over the model since the last row (pseudo-gradient,
    Nesterov and the copy into the model, the weight hash, the update log's entry): wall
    seconds (`outer_own_s`) and the CPU seconds of the thread that ran them
    (`outer_own_cpu_s`: all of their work with one torch thread, `train.threads = 1`; the
    figure a busy machine does not inflate, where other processes take the cores)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the block as the outer step's own work."""
        t, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - t
            self.cpu += time.thread_time() - c

    def take(self) -> dict[str, float]:
        """The row's figures; counting starts again."""
        row = {"outer_own_s": round(self.wall, 4), "outer_own_cpu_s": round(self.cpu, 4)}
        self.wall = self.cpu = 0.0
        return row


def combined_digest(shards: list[str]) -> str:
    """The outer weights' hash of a node: its one shard's, or the hash of its shards' hashes
    in local rank order."""
    return shards[0] if len(shards) == 1 else hashlib.sha256("".join(shards).encode()).hexdigest()


def members_before(mesh: ElasticDeviceMesh) -> set[str]:
    """The group's members before a sync point (for `join_cost`); none for a joiner not yet
    admitted. Never raises for a lost coordinator: the sync point that follows reconnects."""
    try:
        return set(mesh.global_members)  # the installed epoch's, kept while reconnecting
    except MeshError:
        return set()


def join_cost(mesh: ElasticDeviceMesh, before: set[str], sync_seconds: float) -> dict:
    """On a member, for the round whose sync point admitted nodes: who (`admitted`) and what
    it cost this member (`join_seconds`: that sync point's time, re-forming the group with
    them included); nothing otherwise, and nothing on the node admitted."""
    admitted = sorted(set(mesh.installed_group[1]) - before)  # (the round committed)
    if not before or not admitted or mesh.node_id in admitted:
        return {}
    return {"admitted": admitted, "join_seconds": round(sync_seconds, 3)}


def round_counts(
    inner_steps: int, data: SlotLoader | None, consumed: list[float] | None,
    counted: list[int] | None,
) -> dict[str, int | None]:  # fmt: skip
    """A committed round's row: this node's inner steps, the tokens it counted in the average
    (`counted`: its reads that counted, None when it sent nothing: 0) and the round's tokens
    over all contributors (`consumed`: the header's reads per slot)."""
    if data is None:
        return {"round_inner_steps": inner_steps, "round_tokens": None, "round_tokens_all": None}
    seq_len = data.data.seq_len
    return {
        "round_inner_steps": inner_steps,
        "round_tokens": sum(counted) * seq_len if counted is not None else 0,
        "round_tokens_all": round(sum(consumed)) * seq_len if consumed is not None else None,
    }


def joiners_waiting(
    mesh: ElasticDeviceMesh, node_group: dist.ProcessGroup | None, admitted_now: bool = False
) -> bool:
    """Whether a node is registered but not a member yet, or was admitted at this round's
    sync point (`admitted_now`: a listener, `diloco/listen.py`, whose snapshot is the state
    of the round that starts now). Either needs that state: the loop then checkpoints; also
    when the coordinator cannot say. The node's ranks answer alike."""
    try:
        mine = [admitted_now or any(m.get("state") != "member" for m in mesh.members())]
    except Exception:  # the coordinator is briefly unreachable: checkpoint, in case
        mine = [True]
    if node_group is not None:
        dist.broadcast_object_list(mine, group_src=0, group=node_group)
    return bool(mine[0])


def run_summary(cfg: DilocoConfig, rounds: RoundLog) -> dict[str, Any]:
    """A DiLoCo run's totals and settings for its summary."""
    t = rounds.totals
    return {
        **t,
        "compute_utilisation": (
            t["compute_seconds"] / t["round_seconds"] if t["round_seconds"] else None
        ),
        "overlap": cfg.overlap,
        "inner_steps": cfg.inner_steps,
        "outer_lr": cfg.outer_lr,
        "outer_momentum": cfg.outer_momentum,
        "compression": cfg.compression,
        "fragments": cfg.fragments,
        "nodes_now": rounds.nodes_now,
    }


class RoundLog:
    """The run's outer-step totals and the current round's timing (see module doc)."""

    def __init__(
        self,
        optimizer: OuterOptimizer,
        compression: str,
        node_group: dist.ProcessGroup | None,
        metrics: Metrics | None,
        log: Log | None,
    ):
        self.optimizer, self.compression, self.node_group = optimizer, compression, node_group
        self.metrics, self.log = metrics, log
        self.totals = {"outer_steps": 0, "comm_bytes": 0, "comm_seconds": 0.0,
                       "compute_seconds": 0.0, "round_seconds": 0.0}  # fmt: skip
        self.compute = 0.0  # inner compute since the last outer step ended
        self.boundary: float | None = None  # when the last outer step ended
        self.last_epoch: int | None = None  # of the last report (a new one is logged)
        self.nodes_now = 0  # as of the last outer step
        self.last_shards: list[str] = []  # each local rank's shard hash after the last one
        self.own = OwnWork()  # the outer step's own passes, for the next row

    @property
    def outer_steps(self) -> int:
        return int(self.totals["outer_steps"])

    def add_compute_time(self, seconds: float) -> None:
        """One inner step's time (the first round begins with its first inner step)."""
        if self.boundary is None:
            self.boundary = time.monotonic() - seconds
        self.compute += seconds

    def forget_round(self) -> None:
        """A new registration of the node: the next round starts with its first inner step."""
        self.boundary, self.compute, self.last_epoch, self.nodes_now = None, 0.0, None, 0

    def end_round(self) -> tuple[float, float]:
        """(inner compute, wall) seconds of the round since the last outer step ended; the
        next round's wall clock starts now (the caller's remaining work is counted in it)."""
        now = time.monotonic()
        compute, wall = self.compute, now - self.boundary if self.boundary else 0.0
        self.compute, self.boundary = 0.0, now
        if wall:
            self.totals["compute_seconds"] += compute
            self.totals["round_seconds"] += wall
        return compute, wall

    def node_figures(self, bytes_sent: int) -> tuple[list[str], int]:
        """The SHA-256 of each local rank's shard of the outer weights (in local rank order)
        and the bytes the node's ranks sent together."""
        mine = (self.optimizer.digest(), bytes_sent)
        if self.node_group is None:
            return [mine[0]], bytes_sent
        out: list[Any] = [None] * dist.get_world_size(self.node_group)
        dist.all_gather_object(out, mine, group=self.node_group)
        return [str(d) for d, _ in out], sum(int(b) for _, b in out)

    def node_digest(self) -> str:
        """The node's outer weights' hash as it stands."""
        return combined_digest(self.node_figures(0)[0])

    def record(
        self,
        mesh: ElasticDeviceMesh,
        step: int,
        attempts: int,
        seconds: float,
        stats: prime_comm.AllReduceStats | None,
        contributors: int,
        extra: dict[str, Any] | None = None,
        note: str = "",
    ) -> OuterStepReport:
        """Count, log and write one applied outer step (`extra`: more keys for its row)."""
        epoch, members = mesh.installed_group  # (an eviction noticed since the vote: still ours)
        faults.perturb_outer(self.totals["outer_steps"] + 1, self.optimizer.weights, self.log)
        with self.own.counting():  # the hash is the step's own work too
            shards, node_bytes = self.node_figures(stats.bytes_sent if stats else 0)
        extra = {**(extra or {}), **self.own.take()}
        self.last_shards = shards
        compute, wall = self.end_round()
        t = self.totals
        t["outer_steps"] += 1
        digest = combined_digest(shards)  # several ranks: the hash of the shards' hashes
        mesh.note_outer_step(t["outer_steps"], digest)
        t["comm_bytes"] += node_bytes
        t["comm_seconds"] += stats.seconds if stats else 0.0
        report = OuterStepReport(
            step=step,
            outer_step=t["outer_steps"],
            attempts=attempts,
            seconds=seconds,
            allreduce_seconds=stats.seconds if stats else 0.0,
            bytes_sent=node_bytes,
            nodes=len(members),
            epoch=epoch,
            contributors=contributors or len(members),
            outer_sha256=digest,
            compute_seconds=compute,
            round_seconds=wall,
        )
        self.nodes_now = report.nodes
        self._log(mesh, report, note)
        if self.metrics is not None:
            self.metrics.write(_row(report, shards, extra))
        return report

    def _log(self, mesh: ElasticDeviceMesh, report: OuterStepReport, note: str) -> None:
        if self.log is None:
            return
        if report.epoch != self.last_epoch:
            try:
                ids = [m.get("node_id") for m in mesh.members()]
            except MeshError as e:  # the coordinator was lost after the vote: the next sync
                ids = f"(members unknown: {type(e).__name__})"  # point reconnects
            self.log.info(f"mesh epoch {report.epoch}: {report.nodes} node(s) {ids}")
            self.last_epoch = report.epoch
        compute, wall = report.compute_seconds, report.round_seconds
        self.log.info(
            f"outer step {report.outer_step} at step {report.step} | {report.seconds:.2f} s "
            f"(all-reduce {report.allreduce_seconds:.2f} s, {report.bytes_sent / 1e6:.2f} MB "
            f"sent, {self.compression}) | {report.nodes} node(s), epoch {report.epoch}"
            + (f" | {report.attempts} attempts" if report.attempts > 1 else "")
            + note
            + (f" | compute {compute:.2f} of {wall:.2f} s ({compute / wall:.0%})" if wall else "")
        )


def _row(report: OuterStepReport, shards: list[str], extra: dict[str, Any] | None) -> dict:
    """The metrics row of an applied outer step."""
    compute, wall = report.compute_seconds, report.round_seconds
    return {
        "step": report.step,
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
