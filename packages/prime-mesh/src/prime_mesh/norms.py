"""Which nodes' pseudo-gradients are far outside the others' at a sync point.

Each contributing local rank may state, with its sync point arrival, the squared L2 norm of
its shard of the update it is about to send (`norm2`) and the bound the run uses
(`norm_bound`, the same on every node: it is part of the config they agreed on). A node's
norm is the root of its ranks' sum. A node whose norm exceeds `norm_bound` times the median
of the other nodes' norms is an outlier: the coordinator tells it so in its sync point reply
(`why`), and the node then contributes nothing to that round (prime-train's
`diloco/contribution.py`). With two nodes the median of the others is the other's norm: the
larger one is left out when it is `norm_bound` times the smaller. Nodes that state no norm
(a listener, a node left out for a non-finite norm) are not compared.
"""

from __future__ import annotations

import math
import statistics


def norm_outliers(norms2: dict[tuple[str, int], float], bound: float) -> dict[str, str]:
    """{node key: why} for each node whose norm exceeds `bound` x the median of the others'
    (`norms2`: squared norm per (node key, local rank)); none when `bound` <= 0."""
    if bound <= 0:
        return {}
    by_node: dict[str, float] = {}
    for (key, _), n2 in norms2.items():
        by_node[key] = by_node.get(key, 0.0) + n2
    norms = {key: math.sqrt(max(n2, 0.0)) for key, n2 in by_node.items()}
    found = {}
    for key, norm in norms.items():
        others = [n for k, n in norms.items() if k != key]
        if not others:
            continue
        median = statistics.median(others)
        if norm > bound * median:
            found[key] = (
                f"its pseudo-gradient's L2 norm {norm:.4g} is more than {bound:g} x the "
                f"median of the other {len(others)} node(s)' {median:.4g}"
            )
    return found
