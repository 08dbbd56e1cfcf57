"""A straggler: fixed H against time-budgeted rounds (`--diloco.round_seconds`), 3 CLI nodes.

    uv run python benchmarks/stragglers.py [--inner-steps 20] [--wall 120] [--slow 5] [--cap 4]

Three prime-train nodes (configs/debug.toml, one CPU thread each), each its own process and
folder, and a coordinator in this process; node 2 trains at 1/`--slow` of the others' speed
(the fault hook `PRIME_TRAIN_FAULT_SLOW_FACTOR`). Runs, one after the other:

1. even: none slowed, fixed H: the fast nodes' round wall time without a straggler, and the
   time of H inner steps (T for run 3: the median round's compute time);
2. fixed: node 2 slowed, fixed H;
3. timed: node 2 slowed, `round_seconds = T`, `inner_steps` = `--cap` x H (4 by default): a
   cap, not the pace, so that the fast nodes fill T even when the machine runs them faster
   than in run 1 (a cap of H made them finish early and wait: the configuration the README
   advises, T the round's length and inner_steps above what a node can do in it).

Each runs `--wall` seconds from the run's step 0, evaluating the held-out loss at every outer
step. Printed: the fast nodes' median round wall time against the even run's (goal <= 1.1x),
the run's tokens/s (the contributors' committed tokens over the wall time) against the sum of
the nodes' solo rates (goal >= 0.8x), and the held-out loss at equal wall clock (the last
evaluation within `--wall`; goal: timed no worse than fixed), each marked ok or FAIL.

A node's solo rate is the tokens per second of its own inner compute, measured in the same
run (the median round's `round_tokens / compute_s`): what it trains when it never waits,
with the three processes sharing the machine as they do in the run. (A separate solo run
would be timed under another load: on a shared machine that swung 4x minutes apart.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # prime_testkit

TOKEN = "stragglers-benchmark-token"
SLOW_ENV = "PRIME_TRAIN_FAULT_SLOW_FACTOR"


def rows(folder: Path) -> list[dict]:
    path = folder / "runs" / "debug" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stop(procs: list) -> None:
    """SIGTERM every node (they stop at a round's end), then wait; SIGKILL past 60 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except Exception:
            p.kill()
            p.wait()


def mesh_run(a, children, work: Path, cache: Path, name: str, slow: bool, t: float) -> dict:
    """Phases 2-4: three nodes in one mesh for `--wall` seconds from step 0; their rows."""
    from prime_mesh import Coordinator
    from prime_testkit import start_cli_node, wait_until

    folders = [work / name / f"node{k}" for k in range(3)]
    # (a small evaluation at every outer step: it is in every round's wall time)
    # (the fixed-H straggler's round can outlast the auto sync timeout's 30 s floor: it is
    # the barrier this benchmark measures, not a node to leave out)
    h = a.inner_steps * (a.cap if t else 1)  # a timed round's cap (and eval cadence)
    args = ["--eval.every", str(h), "--eval.batches", "2", "--ckpt.every", "0",
            "--run.log_every", "5", "--diloco.sync_timeout_s", "600"]  # fmt: skip
    if t:
        args += ["--diloco.round_seconds", f"{t:.3f}"]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    procs = []
    try:
        for k, folder in enumerate(folders):
            env = {SLOW_ENV: str(a.slow)} if slow and k == 2 else {}
            procs.append(start_cli_node(children, folder, coordinator=coord.address,
                                        host="127.0.0.1", token=TOKEN, cache=cache,
                                        steps=100_000, inner_steps=h, env=env,
                                        args=args))  # fmt: skip
            wait_until(lambda k=k: len(coord.status()["nodes"]) > k, 180,
                       what=f"{name}: node {k} registers")  # fmt: skip
        wait_until(lambda: any("eval_loss" in r for r in rows(folders[0])), 180,
                   what=f"{name}: step 0")  # fmt: skip
        t0 = next(r["time"] for r in rows(folders[0]) if "eval_loss" in r)
        say(
            f"{name}: running {a.wall:g} s from step 0" + (f" (round_seconds {t:.2f})" if t else "")
        )
        while time.time() < t0 + a.wall:
            time.sleep(min(15.0, max(0.1, t0 + a.wall - time.time())))
            outer = [r for r in rows(folders[0]) if "outer_sha256" in r]
            if outer:
                r = outer[-1]
                say(f"{name}: {time.time() - t0:5.0f} s, outer step {r['outer_step']}, "
                    f"steps {r.get('round_inner_steps')} this round on node 0")  # fmt: skip
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{name}: a node exited early; see {folders[0].parent}/*.log")
    finally:
        stop(procs)
        coord.close()
    return {"t0": t0, "rows": [rows(f) for f in folders]}


def figures(run: dict, wall: float) -> dict:
    """Fast nodes' median round wall time, the run's tokens/s, the last held-out loss, all
    within `wall` of step 0."""
    end = run["t0"] + wall
    within = [[r for r in node if "outer_sha256" in r and r["time"] <= end] for node in run["rows"]]
    fast = within[0][1:] + within[1][1:]  # (each node's first round holds the start-up)
    outer0, slow = within[0], within[2]
    evals = [r for r in run["rows"][0] if "eval_loss" in r and r["time"] <= end]
    compute = [r["compute_s"] for r in fast]
    solo = [
        statistics.median(r["round_tokens"] / r["compute_s"] for r in node[1:] if r["compute_s"])
        for node in within
    ]
    return {
        "solo": solo,
        "round_s": statistics.median(r["round_s"] for r in fast),
        "compute_s": statistics.median(compute),
        "tokens_per_s": sum(r["round_tokens_all"] for r in outer0)
        / (outer0[-1]["time"] - run["t0"]),
        "heldout": evals[-1]["eval_loss"],
        "heldout_step": evals[-1]["step"],
        "outer_steps": len(outer0),
        "slow_steps": statistics.median(r["round_inner_steps"] for r in slow),
        "fast_steps": statistics.median(r["round_inner_steps"] for r in fast),
        "slow_contributed": sum(r["round_tokens"] > 0 for r in slow),
        "slow_rounds": len(slow),
    }


def report(a: argparse.Namespace, f: dict[str, dict], t: float) -> None:
    ok = lambda cond: "ok" if cond else "FAIL"  # noqa: E731
    even, fixed, timed = f["even"], f["fixed"], f["timed"]
    print(f"\nStragglers: 3 nodes, node 2 at 1/{a.slow:g} speed, H = {a.inner_steps}, "
          f"{a.wall:g} s of wall clock per run, round_seconds T = {t:.2f} s (timed run: "
          f"inner_steps {a.cap * a.inner_steps}, a cap)\n")  # fmt: skip
    print(f"{'run':<8}{'round s':>9}{'x even':>8}{'tok/s':>9}{'x solo':>8}{'held-out':>10}"
          f"{'@step':>7}{'outer':>7}{'fast/slow steps':>17}{'slow in':>9}")  # fmt: skip
    for name, r in f.items():
        print(f"{name:<8}{r['round_s']:>9.2f}{r['round_s'] / even['round_s']:>8.2f}"
              f"{r['tokens_per_s']:>9,.0f}{r['tokens_per_s'] / sum(r['solo']):>8.2f}"
              f"{r['heldout']:>10.4f}{r['heldout_step']:>7}{r['outer_steps']:>7}"
              f"{r['fast_steps']:>10g} / {r['slow_steps']:<4g}"
              f"{r['slow_contributed']:>5}/{r['slow_rounds']}")  # fmt: skip
    for name, r in f.items():
        print(f"solo tokens/s in {name}: {' + '.join(f'{x:,.0f}' for x in r['solo'])} = "
              f"{sum(r['solo']):,.0f}")  # fmt: skip
    print("\ngoals (timed, node 2 slowed):")
    x = timed["round_s"] / even["round_s"]
    print(f"  fast nodes' round <= 1.1x even:           {x:.2f}x (fixed H: "
          f"{fixed['round_s'] / even['round_s']:.2f}x)  {ok(x <= 1.1)}")  # fmt: skip
    y = timed["tokens_per_s"] / sum(timed["solo"])
    print(f"  run tokens/s >= 0.8x the solo sum:        {y:.2f}x (fixed H: "
          f"{fixed['tokens_per_s'] / sum(fixed['solo']):.2f}x)  {ok(y >= 0.8)}")  # fmt: skip
    print(f"  held-out loss at {a.wall:g} s <= fixed H:       {timed['heldout']:.4f} vs "
          f"{fixed['heldout']:.4f}  {ok(timed['heldout'] <= fixed['heldout'])}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--wall", type=float, default=120.0, help="seconds per run from step 0")
    p.add_argument("--slow", type=float, default=5.0, help="node 2's slowdown factor")
    p.add_argument("--cap", type=int, default=4,
                   help="the timed run's inner_steps, a cap: this many x H (T ends rounds)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    a = p.parse_args()

    from prime_testkit import Children

    work = Path(tempfile.mkdtemp(prefix="stragglers-"))
    cache = work / "cache"
    children = Children()
    try:
        f: dict[str, dict] = {}
        say(f"run 1/3: even, fixed H (work folder {work})")
        f["even"] = figures(mesh_run(a, children, work, cache, "even", False, 0.0), a.wall)
        t = f["even"]["compute_s"]  # H fast inner steps, as the even run paced them
        say(f"even: round {f['even']['round_s']:.2f} s, of which compute {t:.2f} s")
        say("run 2/3: node 2 slowed, fixed H")
        f["fixed"] = figures(mesh_run(a, children, work, cache, "fixed", True, 0.0), a.wall)
        say(f"run 3/3: node 2 slowed, round_seconds {t:.2f}")
        f["timed"] = figures(mesh_run(a, children, work, cache, "timed", True, t), a.wall)
        report(a, f, t)
    finally:
        children.kill_all()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
