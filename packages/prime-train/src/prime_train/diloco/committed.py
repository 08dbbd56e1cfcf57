"""The committed outer state: what every member holds alike as of the last committed outer step.

Only a committed outer step changes the outer weights and momentum, and every member holds
the same ones (with `overlap = "delayed"`, the round in flight is dropped as a failed one is).
This record names that step (`outer_step`, the outer weights' hash) and keeps the loop's
position there (inner step, data order, progress, RNG), taken at each outer boundary. It is
what a joiner must reach exactly, what a node checkpoints when its coordinator does not come
back (dropping the inner steps since: the replicas are not in sync), and the one place to add
what later becomes part of the shared state (data positions, a token clock, ...).
Everything else a node holds (its inner optimizer's moments) is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from prime_train.seam import ElasticOuterStep, OuterStepReport

if TYPE_CHECKING:
    from prime_train.run import Run


@dataclass
class CommittedState:
    """The last committed outer step and the loop's position at it (see module doc)."""

    step: int  # the inner step the outer step followed (or the step resumed from)
    outer_step: int | None  # committed outer steps in the run (None: not known yet)
    outer_sha256: str | None  # the outer weights' hash after it (None: not known yet)
    data: dict[str, Any]
    progress: dict[str, Any]
    rng: torch.Tensor

    @classmethod
    def take(cls, run: Run, step: int, report: OuterStepReport | None = None) -> CommittedState:
        """The state at inner step `step`, a boundary just committed (`report`: its outer
        step's report, when the step makes one)."""
        return cls(
            step=step,
            outer_step=report.outer_step if report else None,
            outer_sha256=report.outer_sha256 if report else None,
            data=dict(run.loader.state_dict()),
            progress=dict(run.progress),
            rng=torch.get_rng_state(),
        )

    def checkpoint(self, run: Run, outer: ElasticOuterStep) -> None:
        """Put the model back to the outer weights of this step and checkpoint it, durably
        (a no-op when this node already holds a checkpoint of it). The inner optimizer's
        moments are kept as they are: the one part not rolled back."""
        if self.step in run.ckpt.committed_steps():
            return
        outer.rollback_to_outer()
        run.loader.load_state_dict(self.data)
        run.progress.clear()
        run.progress.update(self.progress)
        torch.set_rng_state(self.rng)
        run.checkpoint(self.step, outer)
        run.ckpt.wait_durable()
