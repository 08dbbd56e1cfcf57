"""Bytes per outer step against held-out loss: uint8 vs uint4 and uint2 with error feedback.

The same job (the debug model on the standard library's text, same seed, data and tokens, 2
local nodes through the real CLI) with each compression; the baseline for bytes is the ideal
float32 ring all-reduce of the same pseudo-gradient (`prime_comm.ring_bytes`), the baseline
for loss the uint8 run.

    uv run python benchmarks/bandwidth.py [--steps 500] [--inner-steps 50] [--no-plain]

By default uint4 and uint2 also run without error feedback, to show what it buys
(`--no-plain` skips them).

    uv run python benchmarks/bandwidth.py --fragments [--steps 300 --inner-steps 30]

runs instead the issue's "uint4 + error feedback in 3 fragments" row (`[diloco] fragments =
3`, streaming outer steps) on the debug model with 6 layers, against uint8 on the same model
and H (its own loss baseline): an outer step is then one fragment's sync, and the largest sync
is compared with a whole-model sync of the same compression (the bytes of one cycle: the 3
fragments' syncs together; goal <= 0.4) and the held-out loss with uint8's (goal <= 1.03x).

Prints, per job: outer steps, bytes per outer step and its ratio to the float32 ring, the
largest single sync, the final held-out loss and its ratio to uint8's, and the goals of issue
26 (uint4 + EF <= 1/7.5 of the fp32 ring at <= 1.02x uint8's loss; uint2 + EF <= 1/14 at
<= 1.05x). Writes a PNG of held-out loss against bytes sent (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES = 2
# (name, compression, error feedback, goal: (max bytes ratio to the fp32 ring, max loss ratio),
#  more CLI arguments)
JOBS = [
    ("uint8", "uint8", False, None, []),
    ("uint4+EF", "uint4", True, (1 / 7.5, 1.02), []),
    ("uint2+EF", "uint2", True, (1 / 14, 1.05), []),
]
PLAIN = [("uint4", "uint4", False, None, []), ("uint2", "uint2", False, None, [])]
SIX = ["--model.n_layers", "6"]
# 3 fragments: the goal is on the largest sync against a whole-model one (not the fp32 ring)
FRAGMENTS = [
    ("uint8-6L", "uint8", False, None, SIX),
    ("uint4+EF-3frag", "uint4", True, (0.4, 1.03), [*SIX, "--diloco.fragments", "3"]),
]


def train_args(a: argparse.Namespace, runs: Path, cache: Path, name: str) -> list[str]:
    return [
        sys.executable, "-m", "prime_train.cli", "--config", str(ROOT / "configs/debug.toml"),
        "--launch.local_nodes", str(NODES), "--run.name", name, "--run.runs_dir", str(runs),
        "--data.cache_dir", str(cache), "--train.steps", str(a.steps),
        "--diloco.inner_steps", str(a.inner_steps), "--eval.every", str(a.inner_steps),
        "--eval.batches", str(a.eval_batches), "--ckpt.every", "0",
        "--run.log_every", str(max(1, a.steps // 5)),
    ]  # fmt: skip


def run(a: argparse.Namespace, runs: Path, cache: Path, job: tuple) -> dict:
    name, compression, feedback, _, more = job
    extra = ["--diloco.compression", compression, *more]
    if feedback:
        extra += ["--diloco.error_feedback", "true"]
    args = train_args(a, runs, cache, name.replace("+", "-")) + extra
    env = dict(os.environ, PRIME_TOKEN=os.environ.get("PRIME_TOKEN", "bench-token"))
    print(f"== {name}: {' '.join(extra)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(args, env=env, text=True, capture_output=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    run_dir = runs / name.replace("+", "-")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    outer = [r for r in rows if "outer_step" in r]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    sent, curve = 0, [(0, evals.get(0, summary["initial_heldout_loss"]))]
    for r in outer:  # held-out loss against the bytes node 0 had sent by then
        sent += r["bytes_sent"]
        if r["step"] in evals:
            curve.append((sent, evals[r["step"]]))
    out = {
        "name": name,
        "heldout_loss": summary["heldout_loss"],
        "outer_steps": len(outer),
        "bytes_per_outer": summary["diloco"]["comm_bytes"] / max(len(outer), 1),
        "largest_sync": max(r["bytes_sent"] for r in outer),
        "curve": curve,
        "wall_s": time.perf_counter() - t0,
        "residual_rms": [r.get("ef_residual_rms") for r in outer],
        "fragments": len({r.get("fragment") for r in outer}),
    }
    # a whole-model sync: one cycle of the fragments' syncs (all of them once)
    out["whole_sync"] = max(
        sum(r["bytes_sent"] for r in outer[i : i + out["fragments"]])
        for i in range(0, len(outer) - out["fragments"] + 1, out["fragments"])
    )
    print(f"   held-out loss {out['heldout_loss']:.4f}, {out['outer_steps']} outer steps, "
          f"{out['bytes_per_outer'] / 1e6:.3f} MB per outer step, {out['wall_s']:.0f} s",
          flush=True)  # fmt: skip
    return out


def fp32_ring_bytes(n_layers: int | None = None) -> int:
    """What one node sends in an ideal float32 ring all-reduce of the debug model."""
    import torch

    from prime_comm import ring_bytes
    from prime_train.model import Transformer, model_args, num_params

    with torch.device("meta"):
        numel = num_params(Transformer(model_args("debug", n_layers=n_layers)))
    return ring_bytes(numel, NODES)


def plot(results: list[dict], fp32: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:  # from the first outer step on (the loss before it is the same for all)
        xs, ys = zip(*r["curve"][1:], strict=True)
        plain = r["name"] in ("uint4", "uint2")  # without error feedback: dashed
        ax.plot([x / 1e6 for x in xs], ys, marker=".", ls="--" if plain else "-", label=r["name"])
    ax.axhline(results[0]["heldout_loss"], color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent by one node so far (log scale)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"loss against bytes sent (fp32 ring: {fp32 / 1e6:.2f} MB per outer step)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--no-plain", action="store_true", help="skip uint4/uint2 without EF")
    ap.add_argument("--fragments", action="store_true",
                    help="run uint4+EF in 3 fragments against uint8, 6 layers")  # fmt: skip
    ap.add_argument("--only", nargs="+", default=None, help="run these jobs (uint8 first)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="default: benchmarks/results/bandwidth[_fragments].png")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--replot", type=Path, default=None, help="only redraw from a --json file")
    a = ap.parse_args()
    if a.replot:
        saved = json.loads(a.replot.read_text())
        plot(saved["results"], saved["fp32_ring_bytes"], a.plot)
        return
    png = "bandwidth_fragments.png" if a.fragments else "bandwidth.png"
    a.plot = a.plot or ROOT / "benchmarks/results" / png
    jobs = FRAGMENTS if a.fragments else JOBS + ([] if a.no_plain else PLAIN)
    if a.only:  # uint8 stays: it is the loss baseline
        jobs = [j for j in jobs if j[0] == "uint8" or j[0] in a.only]
    with tempfile.TemporaryDirectory() as tmp:
        runs, cache = Path(tmp) / "runs", Path(tmp) / "cache"
        results = [run(a, runs, cache, job) for job in jobs]
    fp32 = fp32_ring_bytes(6 if a.fragments else None)
    base = results[0]
    print()
    layers = "6 layers" if a.fragments else "2 layers"
    print(f"{NODES} nodes, debug model ({layers}), {a.steps} steps, H = {a.inner_steps}; float32 ring: "
          f"{fp32:,} bytes per node per outer step")  # fmt: skip
    head = f"{'job':10}{'outer':>6}{'bytes/outer':>13}{'vs fp32':>9}{'1/x':>7}"
    head += f"{'largest sync':>14}{'held-out':>10}{'vs uint8':>10}  goal"
    print(head)
    for r, job in zip(results, jobs, strict=True):
        ratio, loss_ratio = r["bytes_per_outer"] / fp32, r["heldout_loss"] / base["heldout_loss"]
        goal = job[3]
        verdict = ""
        if goal and r["fragments"] > 1:  # the largest sync against a whole-model one
            share = r["largest_sync"] / r["whole_sync"]
            ok = share <= goal[0] and loss_ratio <= goal[1]
            verdict = (f"largest sync {share:.3f} of a whole-model one ({r['whole_sync']:,}; "
                       f"<= {goal[0]}) at <= {goal[1]}x: {'met' if ok else 'NOT met'}")  # fmt: skip
        elif goal:
            ok = ratio <= goal[0] and loss_ratio <= goal[1]
            verdict = f"<= 1/{1 / goal[0]:g} at <= {goal[1]}x: {'met' if ok else 'NOT met'}"
        print(f"{r['name']:10}{r['outer_steps']:6d}{r['bytes_per_outer']:13,.0f}{ratio:9.4f}"
              f"{1 / ratio:7.2f}{r['largest_sync']:14,d}{r['heldout_loss']:10.4f}"
              f"{loss_ratio:10.4f}  {verdict}")  # fmt: skip
    a.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, fp32, a.plot)
    print(f"plot: {a.plot}")
    if a.json:
        a.json.write_text(json.dumps({"fp32_ring_bytes": fp32, "results": results}, indent=1))


if __name__ == "__main__":
    main()
