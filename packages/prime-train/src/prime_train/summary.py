"""The end of a run: the summary printed, saved as summary.json, and the loss plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from prime_train.files import write_atomic
from prime_train.metrics import read_metrics
from prime_train.plot import plot_runs
from prime_train.run import Run
from prime_train.seam import OuterStep


@dataclass
class LoopEnd:
    """How the loop ended, as the loop saw it."""

    step: int
    start: int  # the step it resumed from (0: a fresh run)
    last_loss: float | None  # the last progress line's mean loss (None: no step this session)
    eval_loss: float | None
    stopped_by: str | None  # the signal that stopped it early, if one did
    seconds: float
    session_tokens: int  # tokens trained in this process (not counting resumed ones)


@dataclass
class Summary:
    steps: int
    final_loss: float | None
    heldout_loss: float | None
    initial_heldout_loss: float | None
    tokens: int
    seconds: float
    tokens_per_s: float
    run_dir: str
    checkpoint_dir: str | None
    plot: str | None
    stopped_by: str | None = None
    resumed_from: int | None = None
    diloco: dict | None = None  # outer steps, bytes communicated and settings (multi-node)
    peak_gpu_memory_bytes: int | None = None  # this rank's peak CUDA allocation (None: CPU)
    ckpt_errors: int = 0  # saves and uploads that failed (an upload: its first try, or the way out)


def finish(run: Run, outer: OuterStep | None, end: LoopEnd) -> Summary:
    """Build the summary from the loop's end and the metrics file; write and print it."""
    cfg = run.cfg
    records = read_metrics(run.metrics.path) if run.metrics.path else []
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    initial = evals[0] if evals else None
    last_loss, eval_loss = end.last_loss, end.eval_loss
    if last_loss is None:
        losses = [r["loss"] for r in records if "loss" in r]
        last_loss = losses[-1] if losses else None
    if eval_loss is None and evals:
        eval_loss = evals[-1]
    plot = None
    # (a joiner that entered at the run's last round has rows but no loss to plot)
    if run.metrics.path is not None and any("loss" in r or "eval_loss" in r for r in records):
        run.metrics.close()
        plot = str(plot_runs([run.run_dir]))
    seconds = end.seconds
    summary = Summary(
        steps=end.step,
        final_loss=last_loss,
        heldout_loss=eval_loss,
        initial_heldout_loss=initial,
        tokens=int(run.progress["tokens"]),
        seconds=seconds,
        tokens_per_s=end.session_tokens / seconds if seconds > 0 else 0.0,
        run_dir=str(run.run_dir),
        checkpoint_dir=str(run.ckpt_dir),
        plot=plot,
        stopped_by=end.stopped_by,
        resumed_from=end.start or None,
        diloco=outer.summary() if outer is not None else None,
        peak_gpu_memory_bytes=(
            torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None
        ),
        ckpt_errors=run.ckpt.errors,
    )
    if not run.primary:
        return summary
    summary_file = run.run_dir / f"summary{run.placement.node.suffix}.json"
    if end.session_tokens or not summary_file.exists():  # a no-op rerun keeps the real figures
        write_atomic(summary_file, json.dumps(asdict(summary), indent=2) + "\n")
    ratio = (
        f" ({eval_loss / initial:.2f}x the step-0 {initial:.4f})"
        if eval_loss is not None and initial
        else ""
    )
    run.log.info(
        f"{'stopped' if end.stopped_by else 'done'}: {end.step}/{cfg.train.steps} steps | "
        f"train loss {_fmt(last_loss)} | held-out loss {_fmt(eval_loss)}{ratio} | "
        f"{summary.tokens:,} tokens | {seconds:.1f} s, {summary.tokens_per_s:,.0f} tok/s"
        + (f" | {summary.ckpt_errors} checkpoint errors" if summary.ckpt_errors else "")
        + "\n"
        + _diloco_line(summary.diloco)
        + f"  run folder {run.run_dir} ({summary_file.name}, metrics"
        f"{', ' + Path(plot).name if plot else ''}); checkpoints in {run.ckpt_dir}"
    )
    return summary


_DILOCO_KEYS = {"outer_steps", "inner_steps", "outer_lr", "outer_momentum", "compression",
                "comm_bytes", "comm_seconds", "nodes_now"}  # fmt: skip


def _diloco_line(d: dict | None) -> str:
    """The DiLoCo line of the printed summary (only for `Diloco.summary()`'s figures)."""
    if not d or not d.keys() >= _DILOCO_KEYS:
        return ""
    return (
        f"  DiLoCo: {d['outer_steps']} outer steps (H={d['inner_steps']}, outer lr "
        f"{d['outer_lr']}, momentum {d['outer_momentum']}, {d['compression']}"
        + (f", {d['fragments']} fragments" if d.get("fragments", 1) > 1 else "")
        + "), "
        f"{d['comm_bytes'] / 1e6:.2f} MB sent in {d['comm_seconds']:.1f} s of all-reduce, "
        f"{d['nodes_now']} node(s) at the end"
        + (
            f"; overlap {d.get('overlap', 'none')}, compute utilisation "
            f"{d['compute_utilisation']:.2f} (inner compute {d['compute_seconds']:.1f} s of "
            f"{d['round_seconds']:.1f} s)"
            if d.get("compute_utilisation") is not None
            else ""
        )
        + "\n"
    )


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"
