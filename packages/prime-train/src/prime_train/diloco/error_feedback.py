"""Error feedback (`[diloco] error_feedback = true`): what the compression took from this node's
pseudo-gradient is carried into the next round's.

`prime_comm.all_reduce(..., residual=e)` writes this node's quantization error e: on the
chunks it sent, what it meant to send minus what the codebook let it send; on the chunk it
owns, the error of re-quantizing the reduced chunk, scaled to input units (the all-gather's
error reached every node through it alone; at 2 bits it is as large as the inputs' own, see
prime-comm's README). Every node's average is then avg(pseudo-gradient + residual - e), and
the next round sends pseudo-gradient + e: nothing is lost for good, only delayed a round.
With time-budgeted rounds (`[diloco] round_seconds`) the node's weight w scales its
pseudo-gradient before e is added (it sends w x pseudo-gradient + e): e is already in the
units that were sent, so it carries over exactly whatever the next round's weight.

The residual is the node's own (not part of the committed outer state every member shares):
- each attempt sends pseudo-gradient + the residual of the last *committed* attempt, so a
  retried attempt starts from the same values (`prepare`); its new residual goes to a
  scratch buffer and becomes the node's only when the vote commits an attempt that counted
  this node (`commit`); a failed vote, or a round the node did not contribute to (a
  joiner's entry), leaves it untouched;
- it is checkpointed with the node's outer state (`state_dict`), so exact resume holds;
- a joiner starts from zero (`reset`), not from the donor's residual that came with the
  donor's checkpoint.
Off, it holds no buffers and adds nothing to checkpoints or metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class ErrorFeedback:
    """This node's quantization residual for a flat pseudo-gradient of `numel` elements."""

    def __init__(self, numel: int, enabled: bool):
        self.enabled = enabled
        self.residual = torch.zeros(numel if enabled else 0, dtype=torch.float32)
        self._next = torch.zeros_like(self.residual)  # the attempt in progress writes here
        self._prepared = False
        self._span = slice(None)  # the range the prepared attempt sends (a fragment's)

    def prepare(
        self, contributing: bool, span: slice | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """Before an attempt's all-reduce: (the committed residual, to add to what this node
        sends, the buffer for the attempt's residual); None: off, or not contributing. The
        caller adds it after weighting the pseudo-gradient (`diloco/average.py`), so a carried
        error is sent as it was meant to be, not re-weighted by the next round's share.
        `span`: the range of the flat buffers the attempt sends (streaming fragments: each
        fragment carries its own residual)."""
        self._prepared = self.enabled and contributing
        if not self._prepared:
            return None
        self._span = span or slice(None)
        return self.residual[self._span], self._next[self._span]

    def commit(self) -> None:
        """The vote committed the prepared attempt: its residual becomes this node's."""
        if self._prepared:
            self.residual[self._span].copy_(self._next[self._span])
            self._prepared = False

    def reset(self) -> None:
        """A joiner's residual: zero (what it loaded is the donor's)."""
        self.residual.zero_()
        self._prepared = False

    def metrics(self) -> dict[str, float]:
        """For the outer step's row: the residual's root mean square (nothing when off)."""
        if not self.enabled:
            return {}
        n = max(self.residual.numel(), 1)
        return {"ef_residual_rms": float(self.residual.norm()) / n**0.5}

    def state_dict(self) -> dict[str, Any]:
        """The live residual (a checkpoint loads into it in place); empty when off."""
        return {"residual": self.residual} if self.enabled else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.enabled:
            return
        t = state["residual"]
        if t.shape != self.residual.shape:
            raise ValueError(
                f"error-feedback residual has {t.numel()} elements, this model shard has "
                f"{self.residual.numel()}: was the checkpoint made with another model or layout?"
            )
        if t is not self.residual:
            self.residual.copy_(t)
        self._prepared = False
