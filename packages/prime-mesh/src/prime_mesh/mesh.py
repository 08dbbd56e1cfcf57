"""ElasticDeviceMesh: one node's view of the run's elastic inter-node process groups."""

from __future__ import annotations

import logging
from typing import Any

from prime_mesh.address import check_name, node_host
from prime_mesh.barrier import checked_sync_timeout
from prime_mesh.deadline import CollectiveDeadline
from prime_mesh.epoch import Epoch, retire
from prime_mesh.errors import CoordinatorGone, CoordinatorLost, MeshError
from prime_mesh.install import admit, install
from prime_mesh.local import local_env, shared_node_key
from prime_mesh.mesh_views import MeshViews
from prime_mesh.progress import validate_progress
from prime_mesh.reconnect import recover
from prime_mesh.session import Session, checked_metadata
from prime_mesh.wire import resolve_token

log = logging.getLogger("prime_mesh")


def _check_arguments(name: str | None, coordinator_grace_s: float) -> None:
    """ValueError naming a bad `name` or `coordinator_grace_s`."""
    if name is not None:
        check_name(name)
    if coordinator_grace_s < 0:
        raise ValueError(f"coordinator_grace_s must be >= 0, got {coordinator_grace_s}")


class ElasticDeviceMesh(MeshViews):
    """Joins a run through its coordinator and keeps this local rank's inter-node gloo group.

    Local rank r of every node is in inter-node group r; `global_pg` is that group for the
    current epoch, `global_rank`/`global_world_size` this node's place in it. Call
    `maybe_reinit_global_pg()` at every sync point (on every node), pass `should_abort` to
    collectives, and vote with `should_commit(ok)` before applying a step.

    The constructor blocks until the node is admitted (at the members' next sync point, or
    when the run forms) unless `wait=False`. With `wait_until_ready=True` it returns once
    registered: the node waits, visible in `members()` but never admitted nor waited for,
    until `ready()`. With `wait_until_ready="auto"` the coordinator decides, atomically with
    the registration: a node arriving while the run has members (or is being re-formed) waits
    so (`joining` is True), one arriving before the run formed is one of its founders.
    Either way the sync point that admits a node counts as its own: its
    first `maybe_reinit_global_pg()` returns the new group, so it enters the members' next
    collective (loop: sync point, then collective).

    If the coordinator dies, training goes on; the next sync point (or vote) reconnects to the
    same address for up to `coordinator_grace_s` seconds and the restarted coordinator
    re-forms the run (see `prime_mesh.reconnect`); past the grace it raises CoordinatorGone.
    A node whose coordinator does not answer when it starts (restarting, or not started yet)
    retries for the same grace, then raises CoordinatorUnreachable.
    Tell the mesh each committed outer step with `note_outer_step` so it can say where it is.

    `name` is the node's id in the run (logs, `members()`, the status page; else "node-N"):
    unique among its live nodes. Registering under a name a live node holds raises
    MeshNameTaken, after waiting one heartbeat timeout for the coordinator to evict a holder
    that died (a node restarted under its own name takes it back). `host` is the address this
    node's gloo groups bind and advertise; without it, the address of the interface that
    reaches the coordinator (see `prime_mesh.address`).

    No wait is unbounded. Once the first member reaches a sync point (or a vote), the others
    have `sync_timeout` seconds to follow (None: auto, from the recent arrival spread; see
    `prime_mesh.barrier`); a member that has not, stuck while its heartbeats go on, is
    evicted (left out of the round; it gets MeshEvicted at its next mesh call and may rejoin
    as a new member). Waiting for admission ends after `join_timeout` seconds (MeshTimeout;
    None: no bound), building a group after `pg_timeout`, and a coordinator that heartbeats but
    never answers a sync point or vote raises MeshTimeout past `request_bound`.

    Its read-only properties and queries (`node_id`, `global_rank`, `members()`, ...) are
    in its base class `prime_mesh.mesh_views.MeshViews`.
    """

    def __init__(
        self,
        coordinator: str,
        host: str | None = None,
        metadata: dict | None = None,
        token: str | bytes | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        *,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node_key: str | None = None,
        wait: bool = True,
        wait_until_ready: bool | str = False,
        join_timeout: float | None = 1800.0,
        name: str | None = None,
        connect_timeout: float = 10.0,
        pg_timeout: float = 600.0,
        coordinator_grace_s: float = 120.0,
        sync_timeout: float | None = None,
    ) -> None:
        key = resolve_token(token)
        sync_timeout = checked_sync_timeout(sync_timeout)
        host = node_host(coordinator, host)
        _check_arguments(name, coordinator_grace_s)
        self.metadata = checked_metadata(metadata, heartbeat_interval, heartbeat_timeout)
        self.local_rank, self.local_world_size = local_env(local_rank, local_world_size)
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self._join_timeout = join_timeout
        self._epoch: Epoch | None = None  # the installed epoch, whose group _pg is
        self._pg: Any = None
        self._suspect, self._vote_seq = False, 0
        # "auto": the coordinator decides at registration (`joining`)
        auto = wait_until_ready == "auto"
        self._ready = not wait_until_ready
        self._fresh = False  # admitted at a sync point the members passed, not yet used
        self._local_mesh: Any = None
        self._deadline = CollectiveDeadline(margin=heartbeat_timeout + heartbeat_interval)
        self.coordinator_grace_s, self.sync_timeout = coordinator_grace_s, sync_timeout
        self._outer: tuple[int, str] = (0, "")  # last committed outer step and weight hash
        self.norm_outlier: str | None = None  # see `maybe_reinit_global_pg`
        self.agreed_outer: tuple[int, str] | None = None  # see should_commit
        self._session = Session(
            coordinator,
            key,
            {
                "type": "register",
                "node_key": shared_node_key(self.local_world_size, node_key),
                "local_rank": self.local_rank,
                "local_world_size": self.local_world_size,
                "metadata": self.metadata,
                "heartbeat_timeout": heartbeat_timeout,
                "sync_timeout": sync_timeout,
                **({"name": name} if name is not None else {}),
            },
            first={"ready": "auto" if auto else self._ready},
            host=host,
            local_rank=self.local_rank,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            connect_timeout=connect_timeout,
            pg_timeout=pg_timeout,
            sync_timeout=sync_timeout,
            unreachable_grace=coordinator_grace_s,
        )
        if auto:
            self._ready = not self._session.joining
        try:
            log.info(
                "%s local rank %d registered with %s (gloo host %s)",
                self.node_id,
                self.local_rank,
                coordinator,
                self.host,
            )
            if wait and self._ready:
                self._admit(join_timeout)
        except BaseException:
            self._session.client.close()
            raise

    # ---- membership ----------------------------------------------------------------------
    def maybe_reinit_global_pg(
        self,
        admit_joiners: bool = True,
        listening: bool = False,
        norm2: float | None = None,
        norm_bound: float = 0.0,
    ) -> bool:
        """Sync point (call on every node): drop dead nodes, admit joiners, rebuild the group.

        Blocks until every member reached its sync point (a node that died meanwhile is evicted
        within heartbeat_timeout + one interval). Returns True when this node now holds a new
        group (new members, or a fresh group after a failed collective), False when unchanged.

        A node not admitted yet waits for admission here (a waiting node says `ready()`
        first). A node admitted at the members' sync point counts that one as its own: its
        first call returns True with the new group without waiting for the members' next
        sync point. Nodes that formed the run meet at their first sync point.

        A member that lost the coordinator reconnects here (see the class doc) and returns
        True with the re-formed group.

        `listening`: this member arrives without work of its own to bring (a joiner that only
        listens, see prime_train's `diloco/listen.py`), possibly a whole round before the
        others: its arrival does not start the coordinator's sync-timeout clock (the first
        other member's does), so it never gets the members evicted for being "late".

        `norm2`: the squared L2 norm of what this local rank is about to contribute; with
        `norm_bound` > 0 the coordinator compares the nodes' norms (`prime_mesh.norms`) and
        `norm_outlier` then says why this node's is far outside the others' (None: it is
        not, or it stated none).
        """
        self.norm_outlier = None
        try:
            return self._sync_point(admit_joiners, listening, norm2, norm_bound)
        except CoordinatorLost as e:
            if not self._recoverable(e):
                raise
            self._recover(e)
            return True

    def _recoverable(self, e: CoordinatorLost) -> bool:
        return (
            not isinstance(e, CoordinatorGone)
            and self._epoch is not None
            and not self._session.closed
        )

    def _recover(self, cause: CoordinatorLost) -> None:
        """Reconnect to a coordinator restarted at the same address and hold the re-formed
        epoch's group (see `prime_mesh.reconnect`)."""
        assert self._epoch is not None
        self._fresh = False
        grace = self.coordinator_grace_s
        self._hold(*recover(self._session, self._epoch, self._outer, grace, cause))

    def note_outer_step(self, outer_step: int, outer_hash: str) -> None:
        """Tell the mesh the run's last committed outer step and the hash of its outer weights
        (the same on every node): a restarted coordinator re-forms the run from the nodes
        that agree on the newest (see `prime_mesh.reform`), and each commit vote checks that
        the contributing members agree on it (see `should_commit`)."""
        if not (isinstance(outer_step, int) and outer_step >= 0 and isinstance(outer_hash, str)):
            raise ValueError(
                f"need an outer step >= 0 and a hash, got {outer_step!r}, {outer_hash!r}"
            )
        self._outer = (outer_step, outer_hash)

    def _sync_point(
        self, admit_joiners: bool, listening: bool, norm2: float | None, norm_bound: float
    ) -> bool:
        self._check()
        new = False
        if self._epoch is None:
            if not self._ready:
                self.ready()
            self._admit(self._join_timeout)
            new = True
        if self._fresh:
            # The members passed the sync point that admitted us and are heading into the
            # collective that follows it: syncing again would wait for their *next* sync point
            # while they wait for us in the collective.
            self._fresh = False
            latest = self._session.latest
            if latest is not None and latest.number > self._epoch.number:
                self._install(latest)  # what a stale sync request would return
            return True
        reply = self._session.client.request(
            {
                "type": "sync",
                "epoch": self._epoch.number,
                "admit": bool(admit_joiners),
                "failed": self._suspect,
                "listening": bool(listening),
                **(
                    {"norm2": float(norm2), "norm_bound": float(norm_bound)}
                    if norm2 is not None
                    else {}
                ),  # fmt: skip
            },
            timeout=self.request_bound,
            what="the coordinator to answer the sync point",
        )
        self._session.note_epoch(reply["epoch"])
        self.norm_outlier = reply.get("outlier")
        latest = self._session.latest
        assert latest is not None
        if latest.number == self._epoch.number:
            self._suspect = False
            return new
        self._install(latest)
        return True

    def ready(self) -> None:
        """Say this local rank is ready to train (after fetching and loading the run's state).

        Only meaningful with `wait_until_ready=True`: the node is admitted at the members'
        next sync point once every one of its local ranks said so (or forms the first epoch
        with the others once `min_nodes` nodes are ready). Returns without waiting for that;
        `maybe_reinit_global_pg()` then waits and returns the new group. A no-op when ready.
        """
        self._check()
        if self._ready:
            return
        self._session.client.request(
            {"type": "ready"},
            timeout=self._session.connect_timeout,
            what="the coordinator to acknowledge ready()",
        )
        self._ready = True

    def should_abort(self) -> bool:
        """True once a newer epoch exists than the one the current group belongs to."""
        self._check()
        return self._epoch is not None and self._session.newer_than(self._epoch.number)

    def should_commit(self, ok: bool, contributed: bool = True) -> bool:
        """Vote at the end of a sync step: True only if every member of the epoch reported ok.

        Every member must call it the same number of times per epoch. A False vote (or a
        changed epoch) makes the result False for all, and marks the group suspect so the next
        maybe_reinit_global_pg() builds a fresh one. A member that arrived at its last sync
        point `listening` is not waited for: its late ballot gets the result decided without
        it (True even when its own collective failed: it must not use that round). The
        ballot carries the outer state told by `note_outer_step` when `contributed` (this
        member sent work of its own; a joiner's state may lag until it caught up): a member
        whose state differs from the majority's makes the vote False and is evicted, told why.
        A passed vote sets `agreed_outer`: the contributors' state (a listener that caught up
        checks its own against it).
        """
        try:
            self._check()  # the coordinator may be lost since the sync point (overlapped round)
            if self._epoch is None:
                raise MeshError("not admitted yet: call maybe_reinit_global_pg() first")
            if not ok:
                self._suspect = True
            reply = self._session.client.request(
                {
                    "type": "vote",
                    "epoch": self._epoch.number,
                    "seq": self._vote_seq,
                    "ok": bool(ok),
                    # the coordinator compares the members' (see `note_outer_step`)
                    **({"outer": list(self._outer)} if contributed and self._outer[1] else {}),
                },
                timeout=self.request_bound,
                what="the coordinator to answer the commit vote",
            )
        except CoordinatorLost as e:
            if not self._recoverable(e):
                raise
            self._recover(e)  # the vote is lost with the coordinator: not committed here
            log.info(
                "%s: step not committed (the coordinator was lost during the vote)", self.node_id
            )
            return False
        self._vote_seq += 1
        result = bool(reply.get("result"))
        outer = reply.get("outer")
        self.agreed_outer = (int(outer[0]), str(outer[1])) if result and outer else None
        if not result:
            self._suspect = True
            log.info(
                "%s: step not committed (%s)",
                self.node_id,
                reply.get("reason", "a member reported failure"),
            )
        return result

    def report_progress(self, **numbers: float) -> None:
        """Show training numbers on the coordinator's status page (`step`, `loss`, ...: see
        `prime_mesh.progress.PROGRESS_FIELDS`); they ride on the next heartbeat. ValueError on
        an unknown field or a value that is not a finite number >= 0."""
        self._session.client.queue_progress(validate_progress(numbers))

    def record_collective(self, seconds: float, ok: bool = True) -> None:
        """Report a finished collective; ok=False marks the group suspect, so the next
        maybe_reinit_global_pg() waits for an epoch without the failed peer, or a fresh group."""
        if ok:
            self._deadline.record(seconds)
        else:
            self._suspect = True

    def close(self, completed: bool = False) -> None:
        """Leave the run gracefully and at once; the other members see a new epoch.
        `completed`: this node finished the run (a node registering later with the same
        config is told so: `RunCompleted`)."""
        if self._session.closed:
            return
        if self._pg is not None:
            retire(self._pg)
        self._session.close(completed)
        log.info("%s local rank %d left the run", self.node_id, self.local_rank)

    def __enter__(self) -> ElasticDeviceMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------
    def _admit(self, timeout: float | None) -> None:
        self._hold(*admit(self._session, timeout))
        self._fresh = self.node_id in self._session.joined

    def _install(self, target: Epoch) -> None:
        """Build the group of `target` (or of any newer epoch that appears meanwhile)."""
        self._hold(*install(self._session, target))

    def _hold(self, pg: Any, epoch: Epoch) -> None:
        """Use `pg`, the group of `epoch`, from now on (the old one is retired)."""
        if self._pg is not None:
            retire(self._pg)
        self._pg, self._epoch = pg, epoch
        self._vote_seq, self._suspect = 0, False
