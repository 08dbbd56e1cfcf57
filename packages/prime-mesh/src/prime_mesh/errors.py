"""Errors raised by prime_mesh; all derive from MeshError so a trainer can catch one type."""


class MeshError(RuntimeError):
    """Base class for every prime_mesh error."""


class MeshAuthError(MeshError):
    """The peer could not be authenticated (wrong or missing token, forged or replayed message)."""


class MeshRefused(MeshError):
    """The coordinator refused this node (e.g. its local_world_size or config hash differs)."""


class RunCompleted(MeshRefused):
    """The coordinator says the run is complete: its members finished every step."""


class MeshNameTaken(MeshRefused):
    """Another live node of the run already goes by this node's name."""


class MeshEvicted(MeshError):
    """This node was evicted from the run (stalled, cut off, or timed out); rejoin as a new member."""


class MeshTimeout(MeshError, TimeoutError):
    """A bounded wait of the mesh ran out (admission, building a group, or a coordinator that
    keeps heartbeating but does not answer a sync point or vote within its bound)."""


class CoordinatorLost(MeshError):
    """The coordinator closed the connection or stopped answering."""


class CoordinatorUnreachable(CoordinatorLost):
    """Nothing accepted a connection at the coordinator's address (refused, no route, timed
    out): a wrong address, or a coordinator not (yet, or not again) running."""


class MeshClosed(MeshError):
    """The mesh was closed with close(); create a new ElasticDeviceMesh to join again."""


class CoordinatorGone(CoordinatorLost):
    """No coordinator came back at the run's address within the grace period
    (`coordinator_grace_s`): the run cannot go on until it is restarted."""
