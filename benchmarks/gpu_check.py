"""The Python half of benchmarks/gpu_check.sh: measure the GPU's bf16 matmul peak, turn one
stage's run folder into a result row, and print the table.

  python benchmarks/gpu_check.py peak                      # bf16 matmul TFLOP/s ("n/a" on CPU)
  python benchmarks/gpu_check.py record RESULTS STAGE RUN_DIR --setup TEXT [--peak T --gpus G]
  python benchmarks/gpu_check.py skip RESULTS STAGE --why TEXT
  python benchmarks/gpu_check.py table RESULTS             # exit 1 if a stage failed

A row is written as soon as its stage ends (timed out too: the figures come from the progress
lines it did write). Steps/s and tokens/s are medians over a stage's progress lines after the
first (start-up and warm-up). MFU counts 6 x parameters + 12 x layers x dim x seq_len FLOPs per
token (forward and backward, attention included) against the peak measured here, per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def peak_tflops() -> str:
    import torch

    if not torch.cuda.is_available():
        return "n/a"
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return f"{2 * n**3 * reps / (time.perf_counter() - t) / 1e12:.0f}"


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut off by the stage's time limit
            pass
    return out


def flops_per_token(run_dir: Path) -> float | None:
    """From the run's saved config: 6 N + 12 L d T (see the module docstring)."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    import torch

    from prime_train.model import Transformer, model_args, num_params

    m = cfg["model"]
    vocab = m.get("vocab_size") or (257 if m["preset"] == "debug" else None)
    args = model_args(
        m["preset"],
        dim=m.get("dim"),
        n_layers=m.get("n_layers"),
        n_heads=m.get("n_heads"),
        n_kv_heads=m.get("n_kv_heads"),
        vocab_size=vocab,
        max_seq_len=cfg["data"]["seq_len"],
    )
    with torch.device("meta"):
        n = num_params(Transformer(args))
    return 6 * n + 12 * args.n_layers * args.dim * cfg["data"]["seq_len"]


def record(
    results: Path, stage: str, run_dir: Path, setup: str, peak: str, rc: int, gpus: int
) -> dict:
    files = sorted(run_dir.glob("metrics*.jsonl"))
    nodes = [_rows(f) for f in files]
    first = nodes[0] if nodes else []
    summaries = [_load(p) for p in sorted(run_dir.glob("summary*.json"))]
    summary = summaries[0] if summaries else {}
    progress = [r for r in first if "tokens_per_s" in r]
    tps = statistics.median(r["tokens_per_s"] for r in progress[1:]) if len(progress) > 1 else None
    steps = summary.get("steps") or (progress[-1]["step"] if progress else 0)
    tokens = summary.get("tokens") or (progress[-1]["tokens"] if progress else 0)
    per_step = tokens / steps if steps else None
    fpt = flops_per_token(run_dir)
    mfu = None
    if tps and fpt and peak not in ("n/a", ""):
        mfu = tps * fpt / (float(peak) * 1e12 * gpus)
    losses = [r["loss"] for r in progress]
    evals = [r["eval_loss"] for r in first if "eval_loss" in r]
    hashes = [{r["outer_step"]: r["outer_sha256"] for r in n if "outer_step" in r} for n in nodes]
    row = {
        "stage": stage,
        "setup": setup,
        "rc": rc,
        "steps": steps,
        "steps_per_s": tps / per_step if tps and per_step else None,
        "tokens_per_s": tps,
        "mfu": mfu,
        "loss": [losses[0], losses[-1]] if losses else None,
        "heldout": [evals[0], evals[-1]] if len(evals) > 1 else None,
        "outer_steps": len(hashes[0]) if hashes and hashes[0] else 0,
        "hashes_match": (all(h == hashes[0] for h in hashes) and bool(hashes[0]))
        if len(hashes) > 1
        else None,
        "peak_gpu_gib": (
            summary["peak_gpu_memory_bytes"] / 2**30
            if summary.get("peak_gpu_memory_bytes")
            else None
        ),
    }
    learned = row["loss"] is not None and row["loss"][1] < row["loss"][0]
    if row["heldout"] is not None:
        learned = learned and row["heldout"][1] < row["heldout"][0]
    problems = []
    if rc != 0:
        problems.append("timed out" if rc == 124 else f"exit {rc}")
    if not learned:
        problems.append("loss did not fall")
    if row["hashes_match"] is False:
        problems.append("outer hashes differ")
    row["status"] = "ok" if not problems else "FAIL: " + ", ".join(problems)
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: Path) -> int:
    rows = _rows(results)
    head = ["stage", "setup", "steps/s", "tokens/s", "MFU", "train loss", "held-out loss",
            "outer hashes", "peak GPU GiB", "status"]  # fmt: skip
    lines = [head]
    for r in rows:
        if r.get("status", "").startswith("skipped"):
            lines.append([r["stage"], r.get("setup", "-"), *["-"] * 7, r["status"]])
            continue
        pair = lambda p: "-" if p is None else f"{p[0]:.3f} -> {p[1]:.3f}"  # noqa: E731
        match = {None: "-", True: f"match ({r['outer_steps']} outer)", False: "DIFFER"}
        lines.append([
            r["stage"], r["setup"], _fmt(r["steps_per_s"], ".2f"), _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["mfu"], ".1%"), pair(r["loss"]), pair(r["heldout"]),
            match[r["hashes_match"]], _fmt(r["peak_gpu_gib"], ".2f"), r["status"],
        ])  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for k, line in enumerate(lines):
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if k == 0:
            print("-+-".join("-" * w for w in widths))
    failed = [r["stage"] for r in rows if r.get("status", "").startswith("FAIL")]
    if failed or not rows:
        print(f"gpu_check: FAILED stages: {', '.join(failed) or 'none ran'}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("peak")
    rec = sub.add_parser("record")
    rec.add_argument("results", type=Path)
    rec.add_argument("stage")
    rec.add_argument("run_dir", type=Path)
    rec.add_argument("--setup", required=True, help="e.g. '1 node x 1' or '2 nodes x 1'")
    rec.add_argument("--peak", default="n/a", help="TFLOP/s of one GPU ('n/a': no MFU)")
    rec.add_argument("--gpus", type=int, default=1, help="GPUs the stage's tokens/s used")
    rec.add_argument("--rc", type=int, default=0)
    skip = sub.add_parser("skip")
    skip.add_argument("results", type=Path)
    skip.add_argument("stage")
    skip.add_argument("--why", required=True)
    tab = sub.add_parser("table")
    tab.add_argument("results", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "peak":
        print(peak_tflops())
    elif a.cmd == "record":
        row = record(a.results, a.stage, a.run_dir, a.setup, a.peak, a.rc, a.gpus)
        print(f"[gpu_check] {a.stage}: {row['status']}", flush=True)
    elif a.cmd == "skip":
        with open(a.results, "a") as f:
            f.write(json.dumps({"stage": a.stage, "status": f"skipped: {a.why}"}) + "\n")
    else:
        return table(a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
