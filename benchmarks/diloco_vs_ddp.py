"""DiLoCo (uint8, every H steps) vs data-parallel averaging every step, same token budget.

Both runs use the debug model on the standard library's text with 2 local nodes through the
real CLI. The data-parallel baseline is the same trainer with H = 1, outer lr 1, no momentum
and float32 all-reduce: the nodes' weights are averaged after every step.

    uv run python benchmarks/diloco_vs_ddp.py [--steps 500] [--inner-steps 50]

Prints the final held-out loss ratio (bar <= 1.05) and the bytes ratio (bar <= 1.05/(4H)).
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


def run(name: str, runs: Path, cache: Path, steps: int, extra: list[str]) -> dict:
    args = [
        sys.executable, "-m", "prime_train.cli", "--config", str(ROOT / "configs/debug.toml"),
        "--launch.local_nodes", "2", "--run.name", name, "--run.runs_dir", str(runs),
        "--data.cache_dir", str(cache), "--train.steps", str(steps),
        "--ckpt.every", "0", "--eval.every", "0", "--run.log_every", str(max(1, steps // 5)),
        *extra,
    ]  # fmt: skip
    env = dict(os.environ, PRIME_TOKEN=os.environ.get("PRIME_TOKEN", "bench-token"))
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(extra)}", flush=True)
    r = subprocess.run(args, env=env, text=True, capture_output=True, timeout=3600)
    for line in r.stdout.splitlines():
        if "outer step" not in line:  # progress lines, without the per-sync chatter
            print("   ", line, flush=True)
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    summary = json.loads((runs / name / "summary.json").read_text())
    summary["wall_seconds"] = time.perf_counter() - t0
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.5)
    ap.add_argument("--baseline", type=Path, default=None,
                    help="reuse (or create) the data-parallel summary in this JSON file")  # fmt: skip
    a = ap.parse_args()
    if a.steps // a.inner_steps < 10:
        sys.exit("use at least 10 outer steps: --steps >= 10 * --inner-steps")
    with tempfile.TemporaryDirectory() as tmp:
        runs, cache = Path(tmp) / "runs", Path(tmp) / "cache"
        if a.baseline and a.baseline.is_file():
            dp = json.loads(a.baseline.read_text())
            print(f"== dp: reusing {a.baseline}")
        else:
            dp = run("dp", runs, cache, a.steps,
                     ["--diloco.inner_steps", "1", "--diloco.outer_lr", "1.0",
                      "--diloco.outer_momentum", "0", "--diloco.compression", "none"])  # fmt: skip
            if a.baseline:
                a.baseline.write_text(json.dumps(dp))
        dl = run("diloco", runs, cache, a.steps,
                 ["--diloco.inner_steps", str(a.inner_steps), "--diloco.compression", "uint8",
                  "--diloco.outer_lr", str(a.outer_lr),
                  "--diloco.outer_momentum", str(a.outer_momentum)])  # fmt: skip
    h = a.inner_steps
    loss_ratio = dl["heldout_loss"] / dp["heldout_loss"]
    bytes_ratio = dl["diloco"]["comm_bytes"] / dp["diloco"]["comm_bytes"]
    print()
    print(f"DiLoCo: H={h}, outer lr {a.outer_lr}, outer momentum {a.outer_momentum}, uint8")
    print(f"{'':24}{'data-parallel':>16}{'DiLoCo H=' + str(h):>16}")
    print(f"{'held-out loss':24}{dp['heldout_loss']:16.4f}{dl['heldout_loss']:16.4f}")
    print(
        f"{'step-0 held-out loss':24}{dp['initial_heldout_loss']:16.4f}{dl['initial_heldout_loss']:16.4f}"
    )
    print(f"{'outer syncs':24}{dp['diloco']['outer_steps']:16d}{dl['diloco']['outer_steps']:16d}")
    print(
        f"{'MB sent per node':24}{dp['diloco']['comm_bytes'] / 1e6:16.2f}{dl['diloco']['comm_bytes'] / 1e6:16.2f}"
    )
    print(f"{'wall seconds':24}{dp['wall_seconds']:16.1f}{dl['wall_seconds']:16.1f}")
    print()
    print(f"held-out loss ratio DiLoCo/DP: {loss_ratio:.3f} (bar <= 1.05)")
    print(f"bytes ratio DiLoCo/DP: {bytes_ratio:.5f} (bar <= 1.05/(4H) = {1.05 / (4 * h):.5f})")


if __name__ == "__main__":
    main()
