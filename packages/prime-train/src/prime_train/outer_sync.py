"""The sync point of DiLoCo across nodes: re-form the mesh, average, vote, apply or retry.

This is the one seam between the trainer and the elastic mesh: `OuterSync.step()` is called
every H inner steps. A failed attempt (a node died or stalled mid all-reduce, a vote said no)
leaves outer weights and momentum unchanged; the mesh drops the suspect and the step is
retried over the nodes actually present, so the average is always over live nodes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import prime_comm
from prime_train.diloco import OuterOptimizer

log = logging.getLogger(__name__)


class OuterStepFailed(RuntimeError):
    """The outer step could not be agreed on within the allowed retries."""


@dataclass
class OuterStepReport:
    """What one outer step cost and who took part."""

    attempts: int
    seconds: float
    comm_seconds: float
    bytes_sent: int
    bytes_received: int
    world_size: int
    epoch: int


class OuterSync:
    """Binds an OuterOptimizer to an ElasticDeviceMesh (or to no mesh: a single node)."""

    def __init__(
        self,
        outer: OuterOptimizer,
        mesh=None,
        compression: str = "uint8",
        max_retries: int = 3,
    ) -> None:
        if compression not in ("uint8", "none"):
            raise ValueError(f"diloco.compression must be 'uint8' or 'none', got {compression!r}")
        self.outer = outer
        self.mesh = mesh
        self.compression = compression
        self.max_retries = max_retries
        self._last_stats: prime_comm.AllReduceStats | None = None

    def _all_reduce(self, flat) -> prime_comm.AllReduceStats | None:
        mesh = self.mesh
        if mesh is None:
            return None  # one node: its own pseudo-gradient is the average
        start = time.monotonic()
        try:
            stats = prime_comm.all_reduce(
                flat,
                group=mesh.global_pg,
                op="avg",
                compression=self.compression,
                timeout=mesh.collective_timeout(),
                should_abort=mesh.should_abort,
            )
        except Exception:
            mesh.record_collective(time.monotonic() - start, ok=False)
            raise
        mesh.record_collective(time.monotonic() - start)
        self._last_stats = stats
        return stats

    def _commit(self, ok: bool) -> bool:
        return ok if self.mesh is None else self.mesh.should_commit(ok)

    def step(self) -> OuterStepReport:
        """Average pseudo-gradients over live nodes and take the outer step (retrying)."""
        start = time.monotonic()
        errors = []
        for attempt in range(1, self.max_retries + 2):
            if self.mesh is not None:
                self.mesh.maybe_reinit_global_pg()
            self._last_stats = None
            result = self.outer.step(self._all_reduce, self._commit)
            if result.applied:
                s = self._last_stats
                return OuterStepReport(
                    attempts=attempt,
                    seconds=time.monotonic() - start,
                    comm_seconds=s.seconds if s else 0.0,
                    bytes_sent=s.bytes_sent if s else 0,
                    bytes_received=s.bytes_received if s else 0,
                    world_size=self.mesh.global_world_size if self.mesh else 1,
                    epoch=self.mesh.epoch if self.mesh else 0,
                )
            errors.append(result.error)
            log.warning(
                "outer step attempt %d not committed (%s); re-forming the group and retrying",
                attempt,
                result.error,
            )
        raise OuterStepFailed(
            f"outer step failed {len(errors)} times ({'; '.join(map(str, errors))}); "
            "outer weights are unchanged"
        )
