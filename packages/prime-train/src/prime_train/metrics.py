"""What a person sees: prefixed progress lines, metrics.jsonl, the summary and the loss plot."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from prime_train.files import write_atomic


class Log:
    """Lines that say which node and rank speaks; only `primary` ranks print progress."""

    def __init__(self, prefix: str, primary: bool, stream: TextIO | None = None):
        self.prefix, self.primary = prefix, primary
        self.stream = stream

    def info(self, msg: str) -> None:
        if self.primary:
            self._write(msg)

    def warn(self, msg: str) -> None:
        self._write(f"warning: {msg}")

    def _write(self, msg: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(f"{self.prefix} {msg}\n")
        stream.flush()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a crash: skip it
            continue
    return out


class Metrics:
    """Appends one JSON object per line; on resume drops records past the resumed step."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f: TextIO | None = None

    def open(self, resume_step: int) -> None:
        if self.path is None:
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        if self.path.exists():
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._f = open(self.path, "a")  # noqa: SIM115 - kept open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw train and held-out loss against step from RUN_DIR/metrics.jsonl into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train and not held:
        raise FileNotFoundError(f"no loss records in {metrics}")
    out = out or run_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if held:
        ax.plot(*zip(*held, strict=True), "o-", label="held-out loss", lw=1.5, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
