"""DiLoCo across nodes: the outer optimizer, the outer step over the elastic mesh, membership.

Read `outer_step.py` to follow one outer step from start to finish.
"""

from prime_train.config import DilocoConfig
from prime_train.diloco.delayed import DelayedDiloco
from prime_train.diloco.listen import JoinedLate
from prime_train.diloco.membership import Membership, uses_mesh
from prime_train.diloco.outer_optimizer import OuterOptimizer, local_tensor
from prime_train.diloco.outer_step import Diloco, OuterStepFailed
from prime_train.diloco.resume_agreement import (
    LacksNewestStep,
    NoCommonCheckpoint,
    NothingToFormFrom,
)
from prime_train.seam import OuterStepReport


def make_outer_step(cfg: DilocoConfig, *args, **kwargs) -> Diloco:
    """`Diloco` for `overlap = "none"`, `DelayedDiloco` for "delayed" (same arguments)."""
    return (DelayedDiloco if cfg.overlap == "delayed" else Diloco)(cfg, *args, **kwargs)


__all__ = [
    "DelayedDiloco",
    "Diloco",
    "JoinedLate",
    "LacksNewestStep",
    "Membership",
    "NoCommonCheckpoint",
    "NothingToFormFrom",
    "OuterOptimizer",
    "OuterStepFailed",
    "OuterStepReport",
    "local_tensor",
    "make_outer_step",
    "uses_mesh",
]
