"""`prime-train plot`: every node's loss from one or more run folders, with membership changes.

On one machine all nodes write into one run folder (metrics.jsonl, metrics-node1.jsonl, ...);
across machines each node has its own folder, so several folders can be given. Outer-step
rows carry `nodes` and `epoch`: where they change, a dashed line marks the outer step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from prime_train.metrics import read_metrics


def node_files(run_dir: Path) -> list[tuple[str, Path]]:
    """(node label, file) for each metrics file in a run folder, node 0 first."""

    def index(p: Path) -> int:
        m = re.fullmatch(r"metrics-node(\d+)\.jsonl", p.name)
        return int(m.group(1)) if m else 0

    files = sorted(run_dir.glob("metrics*.jsonl"), key=index)
    return [
        (f"node {index(p)}", p) for p in files if re.fullmatch(r"metrics(-node\d+)?\.jsonl", p.name)
    ]


def membership_changes(records: list[dict]) -> list[tuple[int, int, int]]:
    """(step, epoch, nodes) of each outer step whose epoch or node count differs from the
    previous outer step's."""
    out, last = [], None
    for r in records:
        if "outer_step" not in r or "epoch" not in r:
            continue
        key = (r["epoch"], r.get("nodes"))
        if last is not None and key != last:
            out.append((int(r["step"]), int(r["epoch"]), int(r.get("nodes") or 0)))
        last = key
    return out


def plot_runs(run_dirs: Sequence[Path], out: Path | None = None) -> Path:
    """Draw train loss (lines) and held-out loss (dots) of every node in `run_dirs` into a
    PNG (default: the first folder's loss.png); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    names = [d.name for d in run_dirs]
    if len(set(names)) < len(names):  # runs/debug on each machine: say which machine's
        names = [f"{d.parent.name}/{d.name}" for d in run_dirs]
    for name, run_dir in zip(names, run_dirs, strict=True):
        for label, path in node_files(run_dir):
            records = read_metrics(path)
            curves.append((f"{name}: {label}" if len(run_dirs) > 1 else label, records))
    if not any("loss" in r or "eval_loss" in r for _, records in curves for r in records):
        names = ", ".join(str(d) for d in run_dirs)
        raise FileNotFoundError(f"no loss records in the metrics*.jsonl files of {names}")
    out = out or run_dirs[0] / "loss.png"
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=110)
    marked: set[tuple[int, int]] = set()
    for i, (label, records) in enumerate(curves):
        color = f"C{i % 10}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, lw=1.2, label=f"{label} train")
        if held:
            ax.plot(*zip(*held, strict=True), "o--", color=color, lw=1, ms=4,
                    label=f"{label} held-out")  # fmt: skip
        for step, epoch, nodes in membership_changes(records):
            if (step, epoch) in marked:
                continue
            marked.add((step, epoch))
            ax.axvline(step, color="0.45", ls=":", lw=1)
            ax.annotate(f"epoch {epoch}: {nodes} node{'s' if nodes != 1 else ''}",
                        (step, 1), xycoords=("data", "axes fraction"), xytext=(-3, -4),
                        textcoords="offset points", rotation=90, va="top", ha="right",
                        fontsize=8, color="0.3")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"loss per node: {', '.join(names)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
