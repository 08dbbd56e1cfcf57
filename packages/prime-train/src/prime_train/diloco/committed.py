"""The committed outer state: what every member holds alike as of the last committed outer step.

Only a committed outer step changes the outer weights and momentum, and every member holds
the same ones (with `overlap = "delayed"`, the round in flight is dropped as a failed one is).
This record names that step (`outer_step`, the outer weights' hash) and keeps the loop's
position there (inner step, data order, progress, RNG, and the inner optimizer's moments,
which are the node's own: those in a scratch file, `prime_train/spill.py`, not in RAM), taken
at each outer boundary. It is what a
joiner must reach exactly, what a node checkpoints when its coordinator does not come back or
when it is told to stop mid-round (dropping the inner steps since: the replicas are not in
sync; a run resumed from it continues exactly as if it had stopped at that boundary), and the
one place to add what later becomes part of the shared state (data positions, a token
clock, ...).

With streaming fragments (`[diloco] fragments` > 1) the model at a committed sync is not the
outer weights (the other fragments hold local progress since their own syncs): the record
then also keeps the model's weights there (in the same file), and puts those back (with
`overlap = "delayed"` the fragment in flight there is dropped with them: the resumed run
syncs that fragment again at its next sync point, every node alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from prime_train.checkpointing import optimizer_state
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
    optimizer: dict[str, dict[str, Any]]  # the inner optimizer's plain values (tensors: spilled)

    @classmethod
    def take(cls, run: Run, step: int, report: OuterStepReport | None = None) -> CommittedState:
        """The state at inner step `step`, a boundary just committed (`report`: its outer
        step's report, when the step makes one). Its tensors (the inner optimizer's, and with
        fragments the model's) go to `run.spill` in the background: the optimizer's next step
        waits for them."""
        tensors, plain = _spilled(run)
        run.spill.write(tensors)
        return cls(
            step=step,
            outer_step=report.outer_step if report else None,
            outer_sha256=report.outer_sha256 if report else None,
            data=dict(run.loader.state_dict()),
            progress=dict(run.progress),
            rng=torch.get_rng_state(),
            optimizer=plain,
        )

    def checkpoint(self, run: Run, outer: ElasticOuterStep) -> None:
        """Put the model back to the outer weights of this step, and the inner optimizer and
        the loop's position to theirs there, and checkpoint it, durably (a no-op when this
        node already holds a checkpoint of it)."""
        if self.step in run.ckpt.committed_steps(local=True):  # (on the way out: no listing)
            return
        outer.rollback_to_outer()  # (with overlap: drops the round in flight, as failed)
        tensors, _ = _spilled(run)  # (fragments: the other fragments' local progress too)
        run.spill.read_into(tensors)
        for name, state in optimizer_state(run.model, run.opt).items():
            state.update(self.optimizer[name])
        run.loader.load_state_dict(self.data)
        run.progress.clear()
        run.progress.update(self.progress)
        torch.set_rng_state(self.rng)
        run.checkpoint(self.step, outer)
        run.ckpt.wait_durable()


def _spilled(run: Run) -> tuple[list[torch.Tensor], dict[str, dict[str, Any]]]:
    """What the record keeps of the live state: its tensors (this rank's local ones: the inner
    optimizer's, then with fragments the model's weights) and the optimizer's plain values."""
    tensors: list[torch.Tensor] = []
    plain: dict[str, dict[str, Any]] = {}
    for name, state in optimizer_state(run.model, run.opt).items():
        plain[name] = {k: v for k, v in state.items() if not torch.is_tensor(v)}
        tensors += [local_tensor(v) for v in state.values() if torch.is_tensor(v)]
    if run.cfg.diloco.fragments > 1:
        tensors += [local_tensor(p).detach() for p in run.params]
    return tensors, plain
