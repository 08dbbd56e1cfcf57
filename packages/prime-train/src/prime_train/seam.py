"""The trainer's one seam: the outer step taken every `diloco.inner_steps` inner steps.

`prime_train.diloco.Diloco` implements it over the elastic mesh; `train(cfg, outer=X)` accepts
any object that does. What `train()` is given as `outer` is also what gets checkpointed and
what decides where the run resumes.
"""

from __future__ import annotations

from typing import Any, Protocol


class OuterStep(Protocol):
    """With `overlapped = True` (optional attribute, default False) `start` returns with the
    step's communication in flight and the loop goes on training; the next `start` completes
    it first, and the loop calls `finish` only after the last step's `start`."""

    def start(self, step: int) -> None:
        """Begin the outer step that follows inner step `step` (the model holds its weights)."""

    def finish(self) -> Any:
        """Complete the step begun by `start`; the model then holds the new weights."""

    def add_compute_time(self, seconds: float) -> None:
        """The loop reports each inner step's duration (for compute utilisation)."""

    def state_dict(self) -> dict[str, Any]:
        """The outer state to checkpoint, as live tensors and plain values (loaded in place)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state after a checkpoint was loaded into `state_dict()`'s structure."""

    def agree_resume_step(self, local_steps: list[int]) -> int | None:
        """The step every participant resumes from, given the steps this node holds."""

    def summary(self) -> dict[str, Any] | None:
        """Totals and settings for the run's summary (None: nothing to add)."""
