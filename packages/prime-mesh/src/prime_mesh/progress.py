"""Training progress that nodes report with their heartbeats, and the coordinator's bounded history.

A node calls `ElasticDeviceMesh.report_progress(step=..., loss=...)`; the numbers ride on its
next heartbeat (so they are authenticated like every membership message) and the coordinator
keeps, per node, the latest values and a bounded series, plus a bounded log of membership
events (joined, left, evicted, and why). Everything here is plain data for the status page,
`/api/status` and `/metrics`; nothing secret (token, rendezvous prefix, `_` metadata) goes in.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

# name -> (what it is, whether it must be a whole number)
PROGRESS_FIELDS: dict[str, tuple[str, bool]] = {
    "step": ("inner step reached", True),
    "outer_step": ("outer (DiLoCo) steps taken", True),
    "tokens_per_s": ("training throughput, tokens per second", False),
    "loss": ("training loss", False),
    "eval_loss": ("held-out loss", False),
    "outer_seconds": ("wall time of the last outer step", False),
    "bytes_sent": ("bytes this node sent in the last outer step", True),
    "compute_seconds": ("seconds of inner steps since the previous outer step", False),
    "allreduce_seconds": ("seconds in the last outer step's all-reduce", False),
    "wait_seconds": ("seconds of the last outer step spent waiting on peers", False),
    "ckpt_errors": ("checkpoint saves and uploads that failed so far", True),
    # (also the coordinator's: see `ElasticDeviceMesh.newest_checkpoint`)
    "checkpoint": ("the newest checkpoint step this node holds on disk", True),
}
MAX_PENDING = 64  # reports queued between two heartbeats (older ones are dropped first)
SERIES_POINTS = 2000  # points kept per node
EVENTS = 500  # membership events kept
DEPARTED = 64  # departed nodes kept on the page


def validate_progress(numbers: Mapping[str, Any]) -> dict[str, float | int]:
    """The numbers as a plain dict; ValueError naming the first unknown field or bad value."""
    out: dict[str, float | int] = {}
    for name, value in numbers.items():
        if name not in PROGRESS_FIELDS:
            raise ValueError(
                f"unknown progress field {name!r}; report any of {', '.join(PROGRESS_FIELDS)}"
            )
        whole = PROGRESS_FIELDS[name][1]
        ok_type = isinstance(value, int) if whole else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < 0:
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"progress field {name!r} must be {kind} >= 0, got {value!r}")
        out[name] = int(value) if whole else float(value)
    return out


def public_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata without a node's private keys (those starting with '_')."""
    return {k: v for k, v in metadata.items() if not (isinstance(k, str) and k.startswith("_"))}


class History:
    """What the status page shows besides the live membership. Bounded; one per coordinator
    start (`run_id` changes when the coordinator restarts, so a reader can say so)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.run_id = secrets.token_hex(4)
        self.started = clock()
        self.events: deque[dict] = deque(maxlen=EVENTS)
        self.series: dict[str, deque[dict]] = {}
        self.latest: dict[str, dict] = {}
        self.departed: deque[dict] = deque(maxlen=DEPARTED)
        self.dropped_reports = 0
        # the newest `checkpoint` a node reported: (step, node id, its run's config hash),
        # kept after the node left, for the nodes forming that run anew (the epoch carries it)
        self.newest_checkpoint: tuple[int, str, str | None] | None = None

    def event(self, kind: str, epoch: int, node_id: str | None, why: str, members: list) -> None:
        self.events.append(
            {
                "time": self.clock(),
                "kind": kind,
                "epoch": epoch,
                "node_id": node_id,
                "reason": why,
                "members": list(members),
            }
        )

    def departed_node(self, node_id: str, address: str, state: str, reason: str) -> None:
        self.departed.append(
            {
                "node_id": node_id,
                "address": address,
                "state": state,
                "reason": reason,
                "time": self.clock(),
            }
        )

    def report(self, node_id: str, reports: Any, run: str | None = None) -> None:
        """Record a heartbeat's reports (`run`: the node's config hash); malformed ones (an
        old or buggy peer) are counted, not kept."""
        if not isinstance(reports, list):
            self.dropped_reports += 1
            return
        for numbers in reports[:MAX_PENDING]:
            try:
                point = validate_progress(numbers if isinstance(numbers, dict) else {"?": 0})
            except ValueError:
                self.dropped_reports += 1
                continue
            if not point:
                continue
            step, newest = point.get("checkpoint"), self.newest_checkpoint
            if step is not None and (newest is None or newest[2] != run or step > newest[0]):
                self.newest_checkpoint = int(step), node_id, run
            self.latest.setdefault(node_id, {}).update(point)
            series = self.series.get(node_id)
            if series is None:
                series = self.series[node_id] = deque(maxlen=SERIES_POINTS)
                while len(self.series) > DEPARTED * 2:  # forget the oldest nodes' series
                    oldest = next(iter(self.series))
                    del self.series[oldest]
                    self.latest.pop(oldest, None)
            series.append({"time": self.clock(), **point})


def page_of(h: History, status: dict, addresses: Mapping[str, str], members: list[str]) -> dict:
    """The status page's data from the coordinator's `status` view, each node's address and
    the members in rank order: plain values copied out, so it is serialized after the lock is
    released; no token, rendezvous prefix or `_` metadata."""
    nodes = []
    for view in status["nodes"]:
        nodes.append(
            {
                **view,
                "address": addresses[view["node_id"]],
                "metadata": public_metadata(view["metadata"]),
                "progress": dict(h.latest.get(view["node_id"], {})),
            }
        )
    for gone in h.departed:
        nodes.append({**gone, "progress": dict(h.latest.get(gone["node_id"], {}))})
    return {
        "history": {"run_id": h.run_id, "started": h.started},
        "epoch": status["epoch"],
        "min_nodes": status["min_nodes"],
        "members": members,
        "nodes": nodes,
        "events": list(h.events),
        "series": {k: list(v) for k, v in h.series.items()},
        "dropped_reports": h.dropped_reports,
    }
