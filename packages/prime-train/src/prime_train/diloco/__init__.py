"""DiLoCo across nodes: the outer optimizer, the outer step over the elastic mesh, membership.

Read `outer_step.py` to follow one outer step from start to finish.
"""

from prime_train.diloco.membership import Membership, uses_mesh
from prime_train.diloco.outer_optimizer import OuterOptimizer, local_tensor
from prime_train.diloco.outer_step import (
    Diloco,
    NoCommonCheckpoint,
    OuterStepFailed,
    OuterStepReport,
)

__all__ = [
    "Diloco",
    "Membership",
    "NoCommonCheckpoint",
    "OuterOptimizer",
    "OuterStepFailed",
    "OuterStepReport",
    "local_tensor",
    "uses_mesh",
]
