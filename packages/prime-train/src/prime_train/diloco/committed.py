"""The committed outer state: what every member holds alike as of the last committed outer step.

Only a committed outer step changes the outer weights and momentum, and every member holds
the same ones (with `overlap = "delayed"`, the round in flight is dropped as a failed one is).
This record names that step (`outer_step`, the outer weights' hash) and keeps the loop's
position there (inner step, data order, progress, RNG, and a host copy of the inner
optimizer's moments, which are the node's own), taken at each outer boundary. It is what a
joiner must reach exactly, what a node checkpoints when its coordinator does not come back or
when it is told to stop mid-round (dropping the inner steps since: the replicas are not in
sync; a run resumed from it continues exactly as if it had stopped at that boundary), and the
one place to add what later becomes part of the shared state (data positions, a token
clock, ...).

With streaming fragments (`[diloco] fragments` > 1) the model at a committed sync is not the
outer weights (the other fragments hold local progress since their own syncs): the record
then also keeps a host copy of the model's weights there, and puts those back (with
`overlap = "delayed"` the fragment in flight there is dropped with them: the resumed run
syncs that fragment again at its next sync point, every node alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from prime_train.checkpointing import restore_optimizer, snapshot_optimizer
from prime_train.diloco.outer_optimizer import local_tensor
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
    optimizer: dict[str, dict[str, Any]]  # the inner optimizer's state, in host memory
    model: list[torch.Tensor] | None = None  # with fragments: the model's weights (host)

    @classmethod
    def take(
        cls,
        run: Run,
        step: int,
        report: OuterStepReport | None = None,
        reuse: CommittedState | None = None,
    ) -> CommittedState:
        """The state at inner step `step`, a boundary just committed (`report`: its outer
        step's report, when the step makes one); `reuse`: the record it replaces, whose host
        copies are overwritten in place (one copy of the moments in memory, not two)."""
        return cls(
            step=step,
            outer_step=report.outer_step if report else None,
            outer_sha256=report.outer_sha256 if report else None,
            data=dict(run.loader.state_dict()),
            progress=dict(run.progress),
            rng=torch.get_rng_state(),
            optimizer=snapshot_optimizer(run.model, run.opt, reuse.optimizer if reuse else None),
            model=_model_copy(run, reuse.model if reuse else None),
        )

    def checkpoint(self, run: Run, outer: ElasticOuterStep) -> None:
        """Put the model back to the outer weights of this step, and the inner optimizer and
        the loop's position to theirs there, and checkpoint it, durably (a no-op when this
        node already holds a checkpoint of it)."""
        if self.step in run.ckpt.committed_steps():
            return
        outer.rollback_to_outer()  # (with overlap: drops the round in flight, as failed)
        if self.model is not None:  # fragments: the other fragments' local progress back
            with torch.no_grad():
                for p, saved in zip(run.params, self.model, strict=True):
                    local_tensor(p).copy_(saved)
        restore_optimizer(run.model, run.opt, self.optimizer)
        run.loader.load_state_dict(self.data)
        run.progress.clear()
        run.progress.update(self.progress)
        torch.set_rng_state(self.rng)
        run.checkpoint(self.step, outer)
        run.ckpt.wait_durable()


@torch.no_grad()
def _model_copy(run: Run, old: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """With fragments, a host copy of the model's weights (into `old` when it fits)."""
    if run.cfg.diloco.fragments <= 1:
        return None
    live = [local_tensor(p).detach() for p in run.params]
    if old is not None and [t.shape for t in old] == [t.shape for t in live]:
        return [o.copy_(t) for o, t in zip(old, live, strict=True)]
    return [t.to("cpu", copy=True) for t in live]
