"""prime_mesh: elastic inter-node process groups for training over the internet."""

from prime_mesh.coordinator import Coordinator
from prime_mesh.deadline import CollectiveDeadline
from prime_mesh.errors import (
    CoordinatorLost,
    MeshAuthError,
    MeshClosed,
    MeshError,
    MeshEvicted,
    MeshRefused,
)
from prime_mesh.mesh import ElasticDeviceMesh
from prime_mesh.status import query_status

__version__ = "0.1.0"

__all__ = [
    "CollectiveDeadline",
    "Coordinator",
    "CoordinatorLost",
    "ElasticDeviceMesh",
    "MeshAuthError",
    "MeshClosed",
    "MeshError",
    "MeshEvicted",
    "MeshRefused",
    "query_status",
]
