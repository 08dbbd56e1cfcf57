"""Read-only views of an `ElasticDeviceMesh`: who this node is, the group it holds, the
coordinator's view of the run, and the bounds on its waits.

`MeshViews` is a base class of `ElasticDeviceMesh` (in `prime_mesh.mesh`, which changes the
state these read: admission, sync points, votes), split out to keep that module short. The
state is declared here, so both classes share it as one object's attributes.
"""

from __future__ import annotations

from typing import Any

from prime_mesh.deadline import CollectiveDeadline
from prime_mesh.epoch import Epoch
from prime_mesh.errors import CoordinatorLost, MeshError
from prime_mesh.local import make_local_mesh
from prime_mesh.session import Session


class MeshViews:
    """The properties and queries of a mesh that change nothing (see `ElasticDeviceMesh`)."""

    local_world_size: int
    _session: Session
    _epoch: Epoch | None  # the installed epoch, whose group _pg is
    _pg: Any
    _ready: bool
    _join_timeout: float | None
    _deadline: CollectiveDeadline
    _local_mesh: Any

    @property
    def joining(self) -> bool:
        """Registered with `wait_until_ready="auto"` while the run had members (or was being
        re-formed): the coordinator made this node a joiner, waiting until `ready()`."""
        return self._session.joining

    @property
    def node_id(self) -> str:
        """This node's id in the run (its `name`, else "node-N"), the same on every local rank."""
        return self._session.node_id

    @property
    def host(self) -> str:
        """The address this local rank's gloo groups bind to and advertise."""
        return self._session.host

    @property
    def join_timeout(self) -> float | None:
        """Seconds a wait for admission may last (None: no bound)."""
        return self._join_timeout

    @property
    def state(self) -> str:
        """This local rank's view: "waiting" (not ready), "joining" (ready, not admitted
        yet) or "member" (holds a group). `members()` has the coordinator's view of all."""
        self._check()
        if self._epoch is not None:
            return "member"
        return "joining" if self._ready else "waiting"

    def members(self) -> list[dict]:
        """Every node the coordinator knows (members in rank order, then the others) with its
        node_id, rank (None unless a member), state ("member", "joining": ready and admitted at
        the next sync point, "waiting": not ready yet, "registering": local ranks missing),
        listening (a member that reached its last sync point listening), local_world_size,
        last_heartbeat_age and metadata."""
        return list(self.status()["nodes"])

    def status(self) -> dict:
        """The coordinator's view: epoch, min_nodes and `nodes` (as `members()`)."""
        self._check()
        request = {"type": "status"}
        reply = self._session.client.request(
            request, timeout=self._session.connect_timeout, what="the coordinator's status"
        )
        return dict(reply["status"])

    @property
    def request_bound(self) -> float:
        """Seconds a sync point or vote waits for the coordinator's answer at most (then
        MeshTimeout): its longest wait for late members plus a heartbeat timeout."""
        return self._session.request_bound

    def round_bound(self) -> float:
        """An upper bound on one round of the README loop with no coordinator loss: a sync
        point (its answer, then at most three group builds), one collective given
        `collective_timeout()`, and the vote. For a caller that waits on another thread
        running them (prime-train's overlapped outer step)."""
        s = self._session
        build = s.pg_timeout + s.heartbeat_timeout + 2 * s.heartbeat_interval
        return 2 * self.request_bound + 3 * (build + self.request_bound) + self.collective_timeout()

    def collective_timeout(self) -> float:
        """Seconds to allow the next inter-node collective: a bounded moving average of the
        durations given to record_collective() (see CollectiveDeadline)."""
        return self._deadline.timeout()

    # ---- the installed group -------------------------------------------------------------
    @property
    def global_pg(self) -> Any:
        self._check()
        if self._pg is None:
            raise MeshError("not admitted yet: call maybe_reinit_global_pg() to wait for admission")
        return self._pg

    @property
    def global_rank(self) -> int:
        return self._current().members.index(self.node_id)

    @property
    def global_world_size(self) -> int:
        return len(self._current().members)

    @property
    def global_members(self) -> tuple[str, ...]:
        """The node ids of the installed group, in rank order (the same on every member)."""
        return self._current().members

    @property
    def epoch(self) -> int:
        return self._current().number

    @property
    def newest_checkpoint(self) -> tuple[int, str] | None:
        """(step, node id): the newest checkpoint step a node of this run reported holding
        (`report_progress(checkpoint=...)`), members and departed nodes alike, as of the
        installed epoch; None: none reported under this coordinator. Nodes forming the run
        anew that hold less would roll it back: the node holding it is away."""
        return self._current().checkpoint

    @property
    def installed_group(self) -> tuple[int, tuple[str, ...]]:
        """(epoch, member node ids in rank order) of the group installed last, read without
        raising for an eviction or a lost coordinator: a round whose vote passed before this
        node learned it was evicted is committed on every member, and it still records it."""
        if self._epoch is None:
            raise MeshError("not admitted yet: call maybe_reinit_global_pg() to wait for admission")
        return self._epoch.number, self._epoch.members

    @property
    def local_mesh(self) -> Any:
        if self._local_mesh is None:
            self._local_mesh = make_local_mesh(self.local_world_size)
        return self._local_mesh

    # ---- checks --------------------------------------------------------------------------
    def _check(self) -> None:
        self._session.check()

    def _current(self) -> Epoch:
        """The installed epoch. A lost coordinator does not change it (its group still works
        until the next sync point or vote reconnects), so that loss is not raised here."""
        try:
            self._check()
        except CoordinatorLost:
            pass
        if self._epoch is None:
            raise MeshError("not admitted yet: call maybe_reinit_global_pg() to wait for admission")
        return self._epoch
