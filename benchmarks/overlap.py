"""Overlapped outer step: `--diloco.overlap none` vs `delayed` on 2 nodes over shaped links.

    sudo uv run python benchmarks/overlap.py [--steps 240] [--inner-steps 20] [--rate MBIT]
    sudo uv run python benchmarks/overlap.py --streaming --rate 10 100

`--streaming` measures issue 26's streaming row instead: the debug preset with 6 layers (dim
128; batch `--batch`, 4 by default: the smaller the batch, the larger the sync's share), uint4 + error feedback in 3 fragments (`--diloco.fragments 3`: a sync every
H / 3 steps, one fragment's bytes each), overlap "none" against "delayed" at each `--rate`
(several rates: one bed each, one table each, then a summary). A round is then one fragment's
H / F steps: the utilisation is (H / F) x t over its median wall time.

Root only (network namespaces joined through a bridge, `tc tbf` on every link; see
tests/support/prime_netbed.py); without root it says so and exits 0. Each node is the real
CLI in its own namespace (GLOO_SOCKET_IFNAME=eth0), the coordinator runs in node 0's.

1. compute-only: both nodes train alone (no mesh, no communication) at the same time, for the
   compute-only step time t (the median of their progress windows).
2. the link rate is chosen so that the uint8 all-reduce's bytes take `--share` (default 0.5)
   of a round's compute, H x t; the measured share (median synchronous all-reduce seconds over
   H x t) is printed and should lie in [1/3, 2/3].
3. the same token budget with overlap "none" then "delayed", in the same bed.

Figures: compute utilisation H x t / median round wall time (and the trainer's own inner
compute over wall), wall-clock ratio delayed/none, final held-out loss ratio delayed/none
(goal <= 1.05), bytes per round, and a PNG of training loss against wall time for each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # prime_netbed, prime_testkit

TOKEN = "overlap-benchmark-token"
SEQ = 128


def train_args(a: argparse.Namespace, runs: Path, cache: Path, name: str, steps: int) -> list:
    more = ["--diloco.compression", a.compression, "--diloco.fragments", str(a.fragments)]
    if a.error_feedback:
        more += ["--diloco.error_feedback", "true"]
    return [
        sys.executable, "-m", "prime_train.cli", "--config", str(ROOT / "configs/debug.toml"),
        "--run.name", name, "--run.runs_dir", str(runs), "--data.cache_dir", str(cache),
        "--model.dim", str(a.dim), "--model.n_layers", str(a.layers),
        "--train.batch_size", str(a.batch), "--train.steps", str(steps),
        "--diloco.inner_steps", str(a.inner_steps), "--optim.warmup_steps", "20",
        "--ckpt.every", "0", "--eval.every", "0", "--eval.batches", "16",
        "--run.log_every", "5", "--launch.local_nodes", "1", *more,
    ]  # fmt: skip


def node_env(k: int) -> dict:
    return dict(os.environ, PRIME_TOKEN=TOKEN, PRIME_LOCAL_NODE=str(k), OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="eth0", TORCH_CPP_LOG_LEVEL="ERROR")  # fmt: skip


def rows(run_dir: Path, k: int) -> list[dict]:
    path = run_dir / ("metrics.jsonl" if k == 0 else f"metrics-node{k}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_all(procs, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        left = max(1.0, deadline - time.monotonic())
        if p.wait(timeout=left) != 0:
            raise SystemExit(f"{what}: a process failed (exit {p.returncode}); see its log")


def compute_only(a, bed, children, runs, cache, logs) -> float:
    """Both nodes train alone at once; the median compute-only seconds per step."""
    procs = []
    for k in range(2):
        args = train_args(a, runs, cache, f"compute-{k}", a.compute_steps)
        with open(logs / f"compute-{k}.log", "w") as out:
            procs.append(children.popen(bed.exec_prefix(k) + args, env=node_env(0),
                                        stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    wait_all(procs, "compute-only run", 1800)
    tps = [
        r["tokens_per_s"]
        for k in range(2)
        for r in rows(runs / f"compute-{k}", 0)[2:]  # skip step-0 eval and the first window
        if "tokens_per_s" in r
    ]
    return a.batch * SEQ / statistics.median(tps)


def diloco_run(a, bed, children, runs, cache, logs, mode: str) -> dict:
    """One 2-node run in the bed; returns node 0's metrics, the summaries and wall seconds."""
    from prime_testkit import wait_until

    port = 29600 + (mode == "delayed")
    coord_cmd = [sys.executable, "-m", "prime_mesh.cli", "coordinator", "--host", bed.ip(0),
                 "--port", str(port), "--min-nodes", "2"]  # fmt: skip
    with open(logs / f"{mode}-coordinator.log", "w") as out:
        coord = children.popen(bed.exec_prefix(0) + coord_cmd, env=node_env(0), stdout=out,
                               stderr=subprocess.STDOUT)  # fmt: skip
    t0 = time.perf_counter()
    procs = []
    for k in range(2):
        args = train_args(a, runs, cache, mode, a.steps) + [
            "--diloco.overlap", mode,
            "--mesh.coordinator", f"{bed.ip(0)}:{port}", "--mesh.host", bed.ip(k),
        ]  # fmt: skip
        log = logs / f"{mode}-{k}.log"
        with open(log, "w") as out:
            procs.append(children.popen(bed.exec_prefix(k) + args, env=node_env(k),
                                        stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
        # register in node order (node 0 is rank 0)
        registered = logs / f"{mode}-coordinator.log"
        wait_until(
            lambda n=k, f=registered, p=procs[-1]: (
                f.read_text().count("registered from") > n or p.poll() is not None
            ),
            300,
            what=f"{mode} node {k} to register",
        )
    wait_all(procs, f"overlap={mode} run", 3600)
    wall = time.perf_counter() - t0
    coord.kill()
    coord.wait(timeout=10)
    run_dir = runs / mode
    summaries = [json.loads((run_dir / n).read_text())
                 for n in ("summary.json", "summary-node1.json")]  # fmt: skip
    outer = [[r["outer_sha256"] for r in rows(run_dir, k) if "outer_step" in r] for k in range(2)]
    if outer[0] != outer[1]:
        raise SystemExit(f"overlap={mode}: outer weights differ between the nodes")
    dropped = sum((logs / f"{mode}-{k}.log").read_text().count("not committed") for k in range(2))
    return {"metrics": rows(run_dir, 0), "summaries": summaries, "wall": wall, "dropped": dropped}


def in_run_step_seconds(runs: list[dict], a: argparse.Namespace) -> float:
    """Compute-only seconds per step measured inside the runs themselves: the median over the
    progress windows (both modes, node 0) that hold no outer-step boundary."""
    period = a.inner_steps // a.fragments  # steps between two syncs
    tps = [
        r["tokens_per_s"]
        for run in runs
        for r in run["metrics"]
        if "tokens_per_s" in r
        and r["step"] > 5  # not the first window (start-up)
        and (r["step"] - 1) // period == (r["step"] - 5) // period
        and r["step"] % period != 0
    ]
    return a.batch * SEQ / statistics.median(tps)


def figures(run: dict, step_s: float, h: int) -> dict:
    outer = [r for r in run["metrics"] if "outer_step" in r]
    rounds = [r for r in outer if r.get("compute_s")]  # the final settle has no compute
    d = run["summaries"][0]["diloco"]
    return {
        "round_s": statistics.median(r["round_s"] for r in rounds),
        "allreduce_s": statistics.median(r["allreduce_seconds"] for r in outer),
        "utilisation": h * step_s / statistics.median(r["round_s"] for r in rounds),
        "trainer_utilisation": d["compute_utilisation"],
        # each round's own inner compute over its wall (the trainer's per-row figure): robust
        # to the machine's load drifting between rounds, unlike H*t with one t for the run
        "round_utilisation": statistics.median(r["compute_utilisation"] for r in rounds),
        "loop_s": max(s["seconds"] for s in run["summaries"]),
        "wall": run["wall"],
        "heldout": run["summaries"][0]["heldout_loss"],
        "bytes_per_round": d["comm_bytes"] / d["outer_steps"],
        "outer_steps": d["outer_steps"],
        "dropped": run["dropped"],
    }


def plot(runs: dict[str, dict], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, run in runs.items():
        t0 = run["metrics"][0]["time"]  # the step-0 evaluation row
        pts = [(r["time"] - t0, r["loss"]) for r in run["metrics"] if "loss" in r]
        ax.plot(*zip(*pts, strict=True), label=f"overlap={mode}")
        end = [r for r in run["metrics"] if "eval_loss" in r][-1]
        ax.scatter([end["time"] - t0], [end["eval_loss"]], marker="x")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("train loss (x: final held-out)")
    ax.set_title("2 nodes on shaped links: loss against wall time")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return str(out)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--compute-steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per step")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--share", type=float, default=0.5, help="all-reduce / round compute")
    ap.add_argument("--rate", type=float, nargs="+", default=None,
                    help="link Mbit/s, one bed each (default: one, from share)")  # fmt: skip
    ap.add_argument(
        "--streaming",
        action="store_true",
        help="issue 26's row: 6 layers, dim 128, uint4 + EF, 3 fragments",
    )
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--compression", default="uint8")
    ap.add_argument("--error-feedback", action="store_true")
    ap.add_argument(
        "--png", type=Path, default=None, help="default: results/overlap[_streaming].png"
    )
    ap.add_argument("--burst", default="64kb", help="tbf bucket of the shaped links")
    ap.add_argument("--keep", type=Path, default=None, help="copy the run folders and logs here")
    a = ap.parse_args()
    if a.streaming:
        a.dim, a.layers, a.fragments = 128, 6, 3
        a.compression, a.error_feedback = "uint4", True
        a.inner_steps = a.inner_steps if a.inner_steps % 3 == 0 else 30
    name = "overlap_streaming.png" if a.streaming else "overlap.png"
    a.png = a.png or ROOT / "benchmarks" / "results" / name
    return a


def measure(
    a: argparse.Namespace, numel: int, payload: float, rate_mbit: float | None
) -> tuple[float, float, dict]:
    """Steps 1-3 of the docstring in a temp folder: the compute-only step seconds, the link
    rate (`rate_mbit`, or chosen from them), and each overlap mode's run; every log printed if
    one fails."""
    from prime_netbed import WanBed

    from prime_testkit import Children

    h = a.inner_steps // a.fragments  # steps between two syncs
    with tempfile.TemporaryDirectory() as tmp:
        runs, cache, logs = Path(tmp) / "runs", Path(tmp) / "cache", Path(tmp) / "logs"
        logs.mkdir()
        print(f"model dim {a.dim} x {a.layers} layers: {numel / 1e6:.2f}M parameters; "
              f"batch {a.batch} x {SEQ} tokens, H={a.inner_steps}, {a.fragments} fragment(s), "
              f"{a.compression}{' + EF' if a.error_feedback else ''}, {a.steps} steps",
              flush=True)  # fmt: skip
        subprocess.run(
            train_args(a, runs, cache, "warm-cache", 1),
            env=node_env(0),
            check=True,
            capture_output=True,
            timeout=900,
        )  # fmt: skip  (tokenize once)
        children = Children()  # every process is killed by pid before its namespace goes
        try:
            with WanBed(2, rate_mbit=1000, burst="256kb") as bed:
                try:
                    step_s = compute_only(a, bed, children, runs, cache, logs)
                finally:
                    children.kill_all()
            rate = rate_mbit or 8 * payload / (a.share * h * step_s) / 1e6
            print(f"compute-only: {step_s * 1e3:.0f} ms per step, {h * step_s:.2f} s per round; "
                  f"payload {payload / 1e6:.2f} MB per node per round -> link {rate:.2f} Mbit/s",
                  flush=True)  # fmt: skip
            results = {}
            with WanBed(2, rate_mbit=round(rate, 3), burst=a.burst) as bed:
                try:
                    for mode in ("none", "delayed"):
                        results[mode] = diloco_run(a, bed, children, runs, cache, logs, mode)
                        print(f"overlap={mode}: done in {results[mode]['wall']:.0f} s", flush=True)
                finally:
                    children.kill_all()
        except BaseException:
            for f in sorted(logs.glob("*.log")):
                print(f"--- {f.name}\n{f.read_text()[-1500:]}", file=sys.stderr)
            raise
        finally:
            if a.keep:
                shutil.copytree(
                    tmp,
                    a.keep / f"{rate_mbit or 'share'}",
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.npy", "ckpt*"),
                )
    return step_s, rate, results


def report(a: argparse.Namespace, step_s: float, rate: float, results: dict) -> tuple[dict, dict]:
    """The figures of both modes, from the compute-only step time measured inside the runs."""
    h = a.inner_steps // a.fragments  # a round: the steps between two syncs
    in_run_s = in_run_step_seconds(list(results.values()), a)
    none, dl = figures(results["none"], in_run_s, h), figures(results["delayed"], in_run_s, h)
    share = none["allreduce_s"] / (h * in_run_s)
    png = plot(results, a.png.with_stem(f"{a.png.stem}_{rate:g}mbit") if a.rate else a.png)
    print()
    print(f"compute-only step {step_s * 1e3:.0f} ms before the runs, {in_run_s * 1e3:.0f} ms in "
          f"the runs' windows without an outer step (used below: the machine is shared)")  # fmt: skip
    print(f"link {rate:.2f} Mbit/s (tbf burst {a.burst}, both directions);"
          f" synchronous all-reduce {none['allreduce_s']:.2f} s = {share:.2f} of a round's "
          f"compute (target 1/3..2/3)")  # fmt: skip
    print(f"{'':34}{'none':>12}{'delayed':>12}")
    for label, key, fmt in (
        ("compute utilisation H*t/round", "utilisation", "{:12.3f}"),
        ("  trainer's inner compute/wall", "trainer_utilisation", "{:12.3f}"),
        ("  median round's compute/wall", "round_utilisation", "{:12.3f}"),
        ("median round wall (s)", "round_s", "{:12.2f}"),
        ("median all-reduce (s)", "allreduce_s", "{:12.2f}"),
        ("loop wall (s)", "loop_s", "{:12.1f}"),
        ("final held-out loss", "heldout", "{:12.4f}"),
        ("MB sent per node per round", "bytes_per_round", "{:12.3f}"),
        ("applied outer steps", "outer_steps", "{:12d}"),
        ("rounds not committed (node logs)", "dropped", "{:12d}"),
    ):
        scale = 1e-6 if key == "bytes_per_round" else 1
        print(f"{label:34}" + "".join(fmt.format(f[key] * scale) for f in (none, dl)))
    print()
    print(f"wall-clock ratio delayed/none: {dl['loop_s'] / none['loop_s']:.3f}")
    print(f"held-out loss ratio delayed/none: {dl['heldout'] / none['heldout']:.3f} (goal <= 1.05)")
    print(f"compute utilisation: none {none['utilisation']:.3f}, delayed {dl['utilisation']:.3f} "
          f"(goal >= 0.95 with overlap)")  # fmt: skip
    print(f"plot: {png}")
    return none, dl


def main() -> None:
    a = parse_args()
    from prime_netbed import bed_unavailable_reason

    reason = bed_unavailable_reason()
    if reason:
        print(f"benchmarks/overlap.py: skipped: {reason}")
        return
    import torch

    from prime_comm import ring_bytes
    from prime_train.model import Transformer, model_args, num_params

    with torch.device("meta"):
        numel = num_params(Transformer(model_args("debug", dim=a.dim, n_layers=a.layers)))
    bits = {"none": 32, "uint8": 8, "uint4": 4, "uint2": 2}[a.compression]
    # one sync's bytes per node (one fragment's), with codebooks
    payload = ring_bytes(numel, world=2) * bits / 32 * 1.02 / a.fragments
    table = []
    for rate_mbit in a.rate or [None]:
        step_s, rate, results = measure(a, numel, payload, rate_mbit)
        table.append((rate, *report(a, step_s, rate, results)))
    if len(table) > 1:
        print(f"\nsummary ({a.fragments} fragment(s), {a.compression}"
              f"{' + EF' if a.error_feedback else ''}, H={a.inner_steps}):")  # fmt: skip
        print(f"{'Mbit/s':>8}{'util none':>11}{'util delayed':>14}{'round c/w none':>16}"
              f"{'round c/w delayed':>19}{'loop s none':>13}{'loop s delayed':>16}"
              f"{'held-out d/n':>14}")  # fmt: skip
        for rate, none, dl in table:
            print(f"{rate:8g}{none['utilisation']:11.3f}{dl['utilisation']:14.3f}"
                  f"{none['round_utilisation']:16.3f}{dl['round_utilisation']:19.3f}"
                  f"{none['loop_s']:13.1f}{dl['loop_s']:16.1f}"
                  f"{dl['heldout'] / none['heldout']:14.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
