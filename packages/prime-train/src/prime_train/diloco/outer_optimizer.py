"""The outer optimizer of DiLoCo: outer weights and Nesterov momentum in flat CPU buffers.

Each rank keeps, on CPU in float32 (pinned when the model is on a GPU), only its own shard of
the outer weights, in one flat buffer with a view per parameter. At a sync point the
pseudo-gradient (outer - current) is computed into a second flat buffer, which the caller
averages across nodes in place; `apply` then takes the Nesterov step and copies the new outer
weights into the model. The class knows
nothing of nodes or networks: `prime_train.diloco.outer_step` does the averaging.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash
from torch import Tensor


def local_tensor(p: Tensor) -> Tensor:
    """This rank's shard of a parameter (the DTensor's local tensor, or the tensor itself)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def weights_digest(flat: Tensor) -> str:
    """XXH3-128 (hex) of a contiguous CPU float32 tensor's bytes, read in place."""
    return xxhash.xxh3_128_hexdigest(memoryview(flat.detach().numpy()).cast("B"))


CHUNK = (
    1 << 18
)  # elements per chunk of the outer step's passes: 1 MiB per buffer (of 2^14-2^20, the
# fastest Nesterov here: 3.2x a memcpy against 4.4x at 2^16, 7.4x at 2^14 and 4.6x at 2^20)


class OuterOptimizer:
    """Outer weights, pseudo-gradient and Nesterov momentum for this rank's parameter shards.

    `params` must be the same (sharded) parameters in the same order on every node.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.7, momentum: float = 0.9):
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        numels = [local_tensor(p).numel() for p in self.params]
        total = sum(numels)
        # with the model on a GPU, the buffers it copies to and from are pinned (faster copies)
        pin = any(local_tensor(p).is_cuda for p in self.params)
        self.weights = torch.zeros(total, dtype=torch.float32, pin_memory=pin)
        self.pseudo_gradient = torch.zeros(total, dtype=torch.float32, pin_memory=pin)
        self.momentum_buffer = torch.zeros(total, dtype=torch.float32)
        self._weight_views: list[Tensor] = []
        self._gradient_views: list[Tensor] = []
        offset = 0
        for p, n in zip(self.params, numels, strict=True):
            shape = local_tensor(p).shape
            self._weight_views.append(self.weights[offset : offset + n].view(shape))
            self._gradient_views.append(self.pseudo_gradient[offset : offset + n].view(shape))
            offset += n
        self.take_model_weights()

    def fragment(self, members: list[int], a: int, b: int) -> OuterOptimizer:
        """An OuterOptimizer over parameters `members`, whose buffers are the slices [a, b)
        of this one's (`diloco/fragments.py`): `compute_pseudo_gradient`, `apply`,
        `load_into_model` and `digest` then act on that fragment alone."""
        part = object.__new__(OuterOptimizer)
        part.params = [self.params[i] for i in members]
        part.lr, part.momentum = self.lr, self.momentum
        part.weights = self.weights[a:b]
        part.pseudo_gradient = self.pseudo_gradient[a:b]
        part.momentum_buffer = self.momentum_buffer[a:b]
        part._weight_views = [self._weight_views[i] for i in members]
        part._gradient_views = [self._gradient_views[i] for i in members]
        return part

    @torch.no_grad()
    def take_model_weights(self) -> None:
        """Take the model's current weights as the outer weights (at the start of a run)."""
        for view, p in zip(self._weight_views, self.params, strict=True):
            view.copy_(local_tensor(p).detach())

    @torch.no_grad()
    def compute_pseudo_gradient(self) -> Tensor:
        """pseudo_gradient = outer weights - current model weights (returned, to be averaged):
        one pass per parameter, no copy of the model first."""
        for w, g, p in zip(self._weight_views, self._gradient_views, self.params, strict=True):
            torch.sub(w, local_tensor(p).detach(), out=g)
        return self.pseudo_gradient

    @torch.no_grad()
    def apply(self, to_model: bool = True) -> None:
        """Nesterov SGD with the (averaged) pseudo-gradient, then (unless `to_model` is False)
        copy the new outer weights into the model.

        momentum = mu x momentum + g; weights -= lr x (g + mu x momentum): element by element
        the arithmetic of the whole-buffer form, done a chunk of `CHUNK` elements at a time
        (while the chunk is in cache, and with no whole-model temporary), each parameter's
        chunk copied into the model right after."""
        scratch = torch.empty(min(CHUNK, self.weights.numel()), dtype=torch.float32)
        base = self.weights.storage_offset()
        for view, g, p in zip(self._weight_views, self._gradient_views, self.params, strict=True):
            off, n = view.storage_offset() - base, view.numel()
            w, g, m = self.weights[off : off + n], g.view(-1), self.momentum_buffer[off : off + n]
            live = local_tensor(p)
            # a CPU model takes each chunk while it is in cache; a GPU one the whole parameter
            dst = live.view(-1) if to_model and live.is_contiguous() and not live.is_cuda else None
            for a in range(0, n, CHUNK):
                b = min(a + CHUNK, n)
                update = scratch[: b - a]
                m[a:b].mul_(self.momentum).add_(g[a:b])
                torch.add(g[a:b], m[a:b], alpha=self.momentum, out=update)
                w[a:b].sub_(update, alpha=self.lr)
                if dst is not None:
                    dst[a:b].copy_(w[a:b])
            if to_model and dst is None:
                live.copy_(view)

    @torch.no_grad()
    def load_into_model(self) -> None:
        """Copy the outer weights into the model."""
        for view, p in zip(self._weight_views, self.params, strict=True):
            local_tensor(p).copy_(view)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views of a flat buffer laid out like the outer weights."""
        return [flat[w.storage_offset() : w.storage_offset() + w.numel()].view(w.shape)
                for w in self._weight_views]  # fmt: skip

    @torch.no_grad()
    def copy_model_into(self, flat: Tensor) -> None:
        """flat = the model's current weights (this rank's shards), laid out like `weights`."""
        for view, p in zip(self.views(flat), self.params, strict=True):
            view.copy_(local_tensor(p).detach())

    @torch.no_grad()
    def shift_model(self, delta: Tensor) -> None:
        """model weights += delta (a flat buffer laid out like `weights`)."""
        for view, p in zip(self.views(delta), self.params, strict=True):
            local_tensor(p).add_(view)

    def digest(self) -> str:
        """The hash of this rank's outer weights (XXH3-128, hex): equal on every node after an
        outer step. Read straight from the buffer, no copy: at 1B parameters SHA-256 over a
        copy took ~8 s a round, XXH3 takes about a memcpy's time."""
        return weights_digest(self.weights)

    def state_dict(self) -> dict[str, Tensor]:
        """The live buffers (a checkpoint loads into them in place)."""
        return {"outer": self.weights, "momentum": self.momentum_buffer}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for key, buf in (("outer", self.weights), ("momentum", self.momentum_buffer)):
            t = state[key]
            if t.shape != buf.shape:
                raise ValueError(
                    f"outer optimizer state '{key}' has {t.numel()} elements, this model shard "
                    f"has {buf.numel()}: was the checkpoint made with another model or layout?"
                )
            if t is not buf:
                buf.copy_(t)
