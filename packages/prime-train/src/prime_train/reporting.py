"""Where a node's metrics rows go besides metrics.jsonl: the mesh's status page and trackers.

`attach_reporting(cfg, run)` is the trainer's one call: every row that `Metrics.write`
records then also reaches the coordinator (a few numbers riding on the heartbeats, shown by
`prime-mesh coordinator --status-port`) and, with `[run] trackers`, TensorBoard and W&B.
Both ask for the node's mesh at each row: a node that rejoined the run holds a new one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from prime_train.config import Config

# metrics row field -> progress field the mesh's status page shows
_PROGRESS = {
    "step": "step",
    "outer_step": "outer_step",
    "tokens_per_s": "tokens_per_s",
    "loss": "loss",
    "eval_loss": "eval_loss",
    "outer_seconds": "outer_seconds",
    "bytes_sent": "bytes_sent",
    "allreduce_seconds": "allreduce_seconds",
    "ckpt_errors": "ckpt_errors",
    "ckpt_step": "checkpoint",
}


class MeshProgress:
    """Reports each metrics row's numbers to the mesh (see `ElasticDeviceMesh.report_progress`),
    adding the time split of the last outer round: compute (everything between two outer
    steps), all-reduce, and waiting (the rest of the outer step: sync point, vote, retries)."""

    def __init__(self, mesh_of: Callable[[], Any], clock=time.perf_counter) -> None:
        self.mesh_of, self.clock = mesh_of, clock
        self._round_start = clock()

    def write(self, record: dict[str, Any]) -> None:
        numbers = {
            name: record[key]
            for key, name in _PROGRESS.items()
            if isinstance(record.get(key), int | float)
        }
        if "outer_step" in record:
            now = self.clock()
            outer = float(record.get("outer_seconds", 0.0))
            numbers["compute_seconds"] = max(0.0, now - self._round_start - outer)
            numbers["wait_seconds"] = max(0.0, outer - float(record.get("allreduce_seconds", 0.0)))
            self._round_start = now
        from prime_mesh import MeshError

        # a diverged loss (nan, inf) is in metrics.jsonl; the page shows the last finite one
        numbers = {k: v for k, v in numbers.items() if math.isfinite(v) and v >= 0}
        try:
            self.mesh_of().report_progress(**numbers)
        except MeshError:  # evicted or closed: the trainer hears of it at its next sync point
            pass

    def close(self) -> None:
        pass


def first_member(mesh_of: Callable[[], Any]) -> Callable[[], bool]:
    """A predicate: whether this node is now the mesh's first member (rank 0 of the epoch)."""
    from prime_mesh import MeshError

    def check() -> bool:
        try:
            return mesh_of().global_rank == 0
        except MeshError:
            return False

    return check


def attach_reporting(cfg: Config, run: Any) -> None:
    """Send `run.metrics` rows to the mesh's status page and the configured trackers (from
    the node's primary rank; trackers only while this node is the mesh's first member)."""
    if not run.primary:
        return
    placement = run.placement

    def mesh_of() -> Any:  # the current registration (`diloco/rejoin.py` replaces it)
        return placement.membership.mesh

    in_mesh = placement.membership is not None
    if in_mesh:
        run.metrics.sinks.append(MeshProgress(mesh_of))
    if cfg.run.trackers:
        from prime_train.trackers import Trackers

        leader = first_member(mesh_of) if in_mesh else (lambda: True)
        run.metrics.sinks.append(
            Trackers(cfg, run.run_dir, leader, run.log, node=run.placement.node.index)
        )
