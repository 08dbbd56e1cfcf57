"""Streaming outer steps (`[diloco] fragments = F`): the model synced one fragment at a time.

The model's layers are split into F fragments, strided: layer i belongs to fragment i % F.
The token embeddings belong to fragment 0, the final norm and the output head to fragment
F - 1 (with one layer per fragment, each end of the model travels with the layer next to it).

A cycle is `inner_steps` = H inner steps with F syncs in it, one every H / F steps: the
sync that ends the cycle's step (f + 1) * H / F is fragment f's. Which fragment is next
follows the committed outer step count (`outer_steps % F`, the count before the sync), not
the node's inner step, so a resumed node and a joiner, which load that count, agree with the
members. Each sync is a committed outer step of its own: one fragment's pseudo-gradient is
averaged, the outer Nesterov step applied to that fragment's outer weights and momentum
only, and that fragment's local weights reset to its new outer weights; every parameter is
still synced once every H inner steps.

With `overlap = "delayed"` each fragment's sync is applied at the next sync point, its
all-reduce in flight meanwhile (`diloco/delayed.py`).

So that each fragment is one contiguous range of the flat outer buffers (one all-reduce, one
slice of the residual), the parameters are laid out fragment by fragment (`order`); with F
= 1 the order, the layout and so every hash are today's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import Tensor

from prime_train.diloco.outer_optimizer import OuterOptimizer, local_tensor

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def fragment_of(name: str, fragments: int) -> int:
    """The fragment of the parameter named `name` (see module doc)."""
    m = _LAYER.search(name)
    if m is not None:
        return int(m.group(1)) % fragments
    return 0 if "embed" in name else fragments - 1


def order(names: Sequence[str], fragments: int) -> list[int]:
    """Indices of the parameters laid out fragment by fragment (stable within a fragment)."""
    return sorted(range(len(names)), key=lambda i: fragment_of(names[i], fragments))


class Fragments:
    """The F fragments of an outer optimizer built over parameters in `order`: each a view of
    the optimizer over its contiguous range (same buffers; see module doc)."""

    def __init__(self, optimizer: OuterOptimizer, names: Sequence[str], fragments: int):
        """`names`: the optimizer's parameters' names, in its order."""
        self.count = fragments
        self.optimizer = optimizer
        self.spans: list[tuple[int, int]] = []
        self.parts: list[OuterOptimizer] = []
        if fragments == 1:
            self.spans.append((0, optimizer.weights.numel()))
            self.parts.append(optimizer)
            return
        ids = [fragment_of(n, fragments) for n in names]
        if ids != sorted(ids):
            raise ValueError("the outer optimizer's parameters are not in fragment order")
        offset = 0
        for f in range(fragments):
            members = [i for i, x in enumerate(ids) if x == f]
            n = sum(local_tensor(optimizer.params[i]).numel() for i in members)
            self.spans.append((offset, offset + n))
            self.parts.append(optimizer.fragment(members, offset, offset + n))
            offset += n

    def index(self, outer_steps: int) -> int:
        """The fragment the sync after `outer_steps` committed outer steps averages."""
        return outer_steps % self.count

    def part(self, outer_steps: int) -> OuterOptimizer:
        """The outer optimizer of that fragment (the whole one with F = 1)."""
        return self.parts[self.index(outer_steps)]

    def span(self, outer_steps: int) -> slice:
        """That fragment's range of the flat buffers."""
        a, b = self.spans[self.index(outer_steps)]
        return slice(a, b)

    def payload_for(self, outer_steps: int) -> Tensor:
        """The pseudo-gradient buffer of the fragment synced after `outer_steps` (a late
        joiner sends zeros as long as the members' fragment: `diloco/average.py`)."""
        return self.part(outer_steps).pseudo_gradient

    def numel(self, f: int) -> int:
        a, b = self.spans[f]
        return b - a


def build(
    params: Sequence[Tensor], names: Sequence[str] | None, fragments: int, lr: float,
    momentum: float,
) -> Fragments:  # fmt: skip
    """The outer optimizer over `params` (named `names`, needed when F > 1) laid out fragment
    by fragment, and its fragments."""
    if fragments == 1:
        return Fragments(OuterOptimizer(params, lr=lr, momentum=momentum), [], 1)
    if names is None or len(names) != len(params):
        raise ValueError("diloco.fragments > 1 needs the parameters' names, one per parameter")
    idx = order(names, fragments)
    optimizer = OuterOptimizer([params[i] for i in idx], lr=lr, momentum=momentum)
    frags = Fragments(optimizer, [names[i] for i in idx], fragments)
    empty = [f for f in range(fragments) if frags.numel(f) == 0]
    if empty:
        raise ValueError(
            f"diloco.fragments = {fragments}: fragment {empty[0]} holds no parameter on this "
            "rank (use at most as many fragments as the model has layers)"
        )
    return frags
