"""The DiLoCo outer step: average pseudo-gradients across nodes, then outer Nesterov SGD.

Each rank keeps, on CPU in float32, only its own shard of the outer weights, in one flat
buffer with a view per parameter. At every sync point the pseudo-gradient (outer - current) is
computed into a second flat buffer, averaged across nodes in one all-reduce (the caller passes
prime_comm's, bound to the inter-node group), and applied only if every member agrees that it
succeeded; otherwise outer weights and momentum are left untouched so the step can be retried
on the re-formed group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor


def local_tensor(p: Tensor) -> Tensor:
    """This rank's shard of a parameter (the DTensor's local tensor, or the tensor itself)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


@dataclass
class OuterStepResult:
    """What one outer step did: whether it was applied, and the all-reduce's statistics."""

    applied: bool
    comm_stats: object | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


class OuterOptimizer:
    """Outer weights, pseudo-gradients and Nesterov momentum for this rank's parameter shards.

    `params` must be the same (sharded) parameters in the same order on every node.
    """

    def __init__(
        self, params: Iterable[Tensor], lr: float = 0.7, momentum: float = 0.9, nesterov=True
    ):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("OuterOptimizer needs at least one parameter")
        if not lr > 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        numels = [local_tensor(p).numel() for p in self.params]
        total = sum(numels)
        self.outer = torch.zeros(total, dtype=torch.float32)
        self.pseudo_grad = torch.zeros(total, dtype=torch.float32)
        self.momentum_buf = torch.zeros(total, dtype=torch.float32)
        self._views: list[Tensor] = []
        self._pg_views: list[Tensor] = []
        offset = 0
        for p, n in zip(self.params, numels, strict=True):
            shape = local_tensor(p).shape
            self._views.append(self.outer[offset : offset + n].view(shape))
            self._pg_views.append(self.pseudo_grad[offset : offset + n].view(shape))
            offset += n
        self.reset_outer_from_model()

    @property
    def numel(self) -> int:
        return self.outer.numel()

    @torch.no_grad()
    def reset_outer_from_model(self) -> None:
        """Take the model's current weights as the outer weights (at start, or after a load)."""
        for view, p in zip(self._views, self.params, strict=True):
            view.copy_(local_tensor(p).detach())

    @torch.no_grad()
    def compute_pseudo_gradient(self) -> Tensor:
        """pseudo_grad = outer - current, into the flat buffer (returned)."""
        for view, p in zip(self._pg_views, self.params, strict=True):
            view.copy_(local_tensor(p).detach())
        torch.sub(self.outer, self.pseudo_grad, out=self.pseudo_grad)
        return self.pseudo_grad

    @torch.no_grad()
    def apply(self) -> None:
        """Outer SGD (Nesterov) with the averaged pseudo-gradient, then copy into the model."""
        g = self.pseudo_grad
        self.momentum_buf.mul_(self.momentum).add_(g)
        update = (
            g.add(self.momentum_buf, alpha=self.momentum) if self.nesterov else self.momentum_buf
        )
        self.outer.sub_(update, alpha=self.lr)
        self.copy_outer_to_model()

    @torch.no_grad()
    def copy_outer_to_model(self) -> None:
        for view, p in zip(self._views, self.params, strict=True):
            local_tensor(p).copy_(view)

    @torch.no_grad()
    def restore_model(self) -> None:
        """Put the outer weights back into the model (a step that was not committed)."""
        self.copy_outer_to_model()

    def step(
        self,
        all_reduce: Callable[[Tensor], object],
        should_commit: Callable[[bool], bool],
    ) -> OuterStepResult:
        """One attempt: compute, average (via `all_reduce`, in place, avg), vote, apply or not.

        On a failed or rejected attempt nothing changes, so the caller can re-form the group and
        call `step` again.
        """
        self.compute_pseudo_gradient()
        stats, error = None, None
        try:
            stats = all_reduce(self.pseudo_grad)
            ok = bool(torch.isfinite(self.pseudo_grad).all())
            if not ok:
                error = "averaged pseudo-gradient is not finite"
        except Exception as e:  # the vote tells every member; the caller re-forms and retries
            ok, error = False, f"{type(e).__name__}: {e}"
        if should_commit(ok):
            self.apply()
            return OuterStepResult(applied=True, comm_stats=stats)
        return OuterStepResult(applied=False, comm_stats=stats, error=error or "a peer failed")

    def state_dict(self) -> dict[str, Tensor]:
        return {"outer": self.outer, "momentum": self.momentum_buf}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for key, buf in (("outer", self.outer), ("momentum", self.momentum_buf)):
            t = state[key]
            if t.shape != buf.shape:
                raise ValueError(
                    f"outer optimizer state '{key}' has {t.numel()} elements, this model shard "
                    f"has {buf.numel()}: was the checkpoint made with another model or layout?"
                )
            buf.copy_(t)
