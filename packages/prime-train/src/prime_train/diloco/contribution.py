"""Whether this node's pseudo-gradient may go into a round's average.

One node's bad numbers (a NaN or Inf from an overflow, a bad batch, a flipped bit) must not
stop the run: averaged in, they would make every node's update non-finite, every node would
refuse it, and every retry would recompute the same values. So before its all-reduce a node
checks its own pseudo-gradient; when its L2 norm is not finite (a NaN or Inf in it, or values
so large that the norm overflows float32) the node contributes nothing to that round, as a
joiner's entry round does (its reads are not counted, so its data slots are read again): the
others commit without it, it logs why and takes the committed weights like every node.
"""

from __future__ import annotations

import torch

from prime_train import faults
from prime_train.metrics import Log


def unusable(pseudo_gradient: torch.Tensor) -> str | None:
    """Why `pseudo_gradient` must not be averaged, or None. One reduction, no temporary the
    size of the model."""
    norm = float(torch.linalg.vector_norm(pseudo_gradient))
    if norm != norm or norm in (float("inf"), float("-inf")):
        return f"its L2 norm is {norm}: a NaN or Inf in it, or values that overflow float32"
    return None


def usable(pseudo_gradient: torch.Tensor, outer_step: int, log: Log | None) -> bool:
    """Whether this node's pseudo-gradient for outer step `outer_step` may be averaged; when
    not (`unusable`), a warning says why."""
    faults.poison_pseudo_gradient(outer_step, pseudo_gradient, log)  # (a test's)
    why = unusable(pseudo_gradient)
    if why is None:
        return True
    if log is not None:
        log.warn(
            f"outer step {outer_step}: this node's pseudo-gradient is left out of the round "
            f"({why}); the others commit without it and it takes the committed weights"
        )
    return False
