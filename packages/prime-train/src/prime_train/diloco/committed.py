"""The state of the last committed outer step, for a run whose coordinator does not come back.

Only a committed outer step changes the outer weights and momentum, and every node holds the
same ones (with `overlap = "delayed"`, the round in flight is dropped as a failed one is). With the loop's position at that step (data order, progress, RNG), kept here at
each commit, a node can checkpoint the step every node agrees on, dropping the inner steps
since (the replicas are not in sync). Rerunning the same commands resumes from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from prime_train.diloco.outer_step import Diloco
    from prime_train.run import Run


class LastCommitted:
    """The loop's position at the last committed outer step (`take` at each commit)."""

    def __init__(self, run: Run, step: int) -> None:
        self.take(run, step)

    def take(self, run: Run, step: int) -> None:
        """Remember inner step `step` (just committed): data position, progress and RNG."""
        self.step = step
        self.data: dict[str, Any] = dict(run.loader.state_dict())
        self.progress: dict[str, Any] = dict(run.progress)
        self.rng = torch.get_rng_state()

    def checkpoint(self, run: Run, outer: Diloco) -> None:
        """Put the model back to the outer weights of that step and checkpoint it, durably
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
        run.ckpt.wait()
