"""What a prime-train run leaves behind, read back by a test: metrics rows, outer steps, logs.

Where a node's rows are: node k of nodes that share a runs folder writes `metrics.jsonl`
(k = 0) or `metrics-node{k}.jsonl` in the run folder (`node_metrics(run_dir, k)`); a node in its
own working folder (prime_testkit.cli_node) writes `folder/runs/debug/metrics.jsonl`
(`folder_metrics(folder)`). The other helpers take those rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# the values two runs that must match are compared by (see `trace`)
TRACED = ("loss", "eval_loss", "outer_sha256", "data")


def node_metrics(run_dir: Path, node: int = 0) -> list[dict[str, Any]]:
    """The rows node `node` wrote into the run folder `run_dir`."""
    from prime_train.metrics import read_metrics

    return read_metrics(run_dir / ("metrics.jsonl" if node == 0 else f"metrics-node{node}.jsonl"))


def folder_metrics(folder: Path) -> list[dict[str, Any]]:
    """The rows of the node working in `folder` (its debug run under `folder/runs`)."""
    return node_metrics(folder / "runs" / "debug")


def losses(run_dir: Path, by_step: bool = False) -> tuple[Any, Any]:
    """Node 0's train and held-out losses in `run_dir`: two lists in the order written, or
    with `by_step` two {step: loss} dicts."""
    rows = node_metrics(run_dir)
    if by_step:
        return (
            {r["step"]: r["loss"] for r in rows if "loss" in r},
            {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
        )
    return [r["loss"] for r in rows if "loss" in r], [
        r["eval_loss"] for r in rows if "eval_loss" in r
    ]


def outer_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows of outer steps, in the order written."""
    return [r for r in rows if "outer_step" in r]


def outer_by_step(rows: Iterable[dict]) -> dict[int, dict]:
    """The rows of outer steps by outer step (the last row of a step written twice)."""
    return {r["outer_step"]: r for r in outer_rows(rows)}


def outer_hashes(rows: Iterable[dict]) -> dict[int, str]:
    """The outer weights' hash of each outer step."""
    return {k: r["outer_sha256"] for k, r in outer_by_step(rows).items()}


def slot_chain_problems(
    rows: Iterable[dict], slots: int = 0, stall: int | None = None
) -> list[str]:
    """What breaks "every data slot's counted reads are one chain from 0" in the outer-step
    rows of several nodes (each row naming its `node`; a node's first row of an outer step
    counts): a range read again (by two nodes in one outer step, or later) or a gap; with
    `stall`, a slot of the `slots` not read for more than `stall` outer steps in a row."""
    first: dict[tuple[int, int], dict] = {}  # (node, outer step) -> its first row
    for r in outer_rows(rows):
        first.setdefault((r["node"], r["outer_step"]), r)
    reads: dict[int, list[tuple[int, int, int, int]]] = {}  # slot -> (from, to, outer, node)
    for (node, k), r in sorted(first.items(), key=lambda x: x[0][1]):
        for slot, (a, b) in (r.get("data") or {}).items():
            reads.setdefault(int(slot), []).append((a, b, k, node))
    if not reads:
        return ["no row carries data slot reads"]
    problems = []
    for slot, got in sorted(reads.items()):
        at = 0
        for a, b, k, node in sorted(got):
            if a != at:
                problems.append(f"slot {slot}: node{node} read {a}..{b} at outer step {k}, "
                                f"expected from {at}")  # fmt: skip
            at = max(at, b)
    last = max(k for _, k in first)
    for slot in range(slots if stall is not None else 0):
        read_at = sorted({k for _, _, k, _ in reads.get(slot, [])})
        longest = max(b - a - 1 for a, b in zip([0, *read_at], [*read_at, last + 1], strict=True))
        if longest > stall:
            problems.append(f"slot {slot}: not read for {longest} outer steps in a row")
    return problems


def check_same_outer(node: Path, members: Sequence[Path], at_least: int = 1) -> dict[int, dict]:
    """Assert that the node working in folder `node` has each member's outer hash at every
    outer step both wrote (a node stopped by SIGTERM may go a step on), at least `at_least`
    such steps per member; returns the node's outer rows by outer step."""
    mine = outer_by_step(folder_metrics(node))
    context = node.parent
    assert mine, log_tails(context)
    for member in members:
        theirs = outer_by_step(folder_metrics(member))
        shared = [k for k in mine if k in theirs]
        assert len(shared) >= at_least, (member.name, shared, log_tails(context))
        for k in shared:
            assert mine[k]["outer_sha256"] == theirs[k]["outer_sha256"], (
                f"outer step {k}: {node.name} and {member.name} differ",
                log_tails(context),
            )
    return mine


def trace(
    rows: Iterable[dict],
    keep: Sequence[str] = TRACED,
    *,
    with_outer_step: bool = False,
    after_step: int | None = None,
) -> dict[tuple, Any]:
    """{(step, name): value} of every `keep` field of every row ((step, outer step or None,
    name) `with_outer_step`; only the rows past `after_step` when given): what a resumed run
    must reproduce of the uninterrupted one."""
    return {
        ((r["step"], r.get("outer_step"), k) if with_outer_step else (r["step"], k)): r[k]
        for r in rows
        if after_step is None or r["step"] > after_step
        for k in keep
        if k in r
    }


def log_tails(folder: Path, chars: int = 3000) -> str:
    """The last `chars` characters of every *.log in `folder`, each under its name: what an
    assertion about a multi-process run shows when it fails."""
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-chars:]}" for p in sorted(folder.glob("*.log"))
    )
