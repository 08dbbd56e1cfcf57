"""prime_mesh: elastic inter-node process groups for training over the internet.

Names are imported lazily, so `prime-mesh status` and the errors load without torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CollectiveDeadline": "prime_mesh.deadline",
    "Coordinator": "prime_mesh.coordinator",
    "CoordinatorGone": "prime_mesh.errors",
    "CoordinatorLost": "prime_mesh.errors",
    "CoordinatorUnreachable": "prime_mesh.errors",
    "ElasticDeviceMesh": "prime_mesh.mesh",
    "MeshAuthError": "prime_mesh.errors",
    "MeshClosed": "prime_mesh.errors",
    "MeshError": "prime_mesh.errors",
    "MeshEvicted": "prime_mesh.errors",
    "MeshNameTaken": "prime_mesh.errors",
    "MeshRefused": "prime_mesh.errors",
    "MeshTimeout": "prime_mesh.errors",
    "RunCompleted": "prime_mesh.errors",
    "node_host": "prime_mesh.address",
    "query_status": "prime_mesh.status",
}
__all__ = [
    "CollectiveDeadline",
    "Coordinator",
    "CoordinatorGone",
    "CoordinatorLost",
    "CoordinatorUnreachable",
    "ElasticDeviceMesh",
    "MeshAuthError",
    "MeshClosed",
    "MeshError",
    "MeshEvicted",
    "MeshNameTaken",
    "MeshRefused",
    "MeshTimeout",
    "RunCompleted",
    "node_host",
    "query_status",
]

if TYPE_CHECKING:
    from prime_mesh.address import node_host
    from prime_mesh.coordinator import Coordinator
    from prime_mesh.deadline import CollectiveDeadline
    from prime_mesh.errors import (
        CoordinatorGone,
        CoordinatorLost,
        CoordinatorUnreachable,
        MeshAuthError,
        MeshClosed,
        MeshError,
        MeshEvicted,
        MeshNameTaken,
        MeshRefused,
        MeshTimeout,
        RunCompleted,
    )
    from prime_mesh.mesh import ElasticDeviceMesh
    from prime_mesh.status import query_status


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prime_mesh' has no attribute {name!r}")
