"""Randomized churn: a seeded schedule of events over one DiLoCo run on the WAN bed (root),
checked from every node's rows.

    uv run python benchmarks/churn.py                     # 20 seeds; prints how many held
    uv run python benchmarks/churn.py --seed 7 --runs 1   # replay seed 7's schedule
    uv run python benchmarks/churn.py --quick --seeds 0 7 --faults nan   # CI's two short seeds

Each seed draws a schedule (`draw`) in benchmarks/wan_chaos_schedule.py's language from its
own random generator: SIGKILL and rerun, SIGTERM and rerun, SIGSTOP past the heartbeat
timeout, fresh joiners, a member leaving while another node listens, a coordinator SIGKILL and
restart, one node whose outer weights are perturbed and one whose pseudo-gradient holds a NaN
at an outer step drawn too (`draw_faults`, prime_train.faults' hooks); then every node still
down is rerun, the job settles and every node is stopped with SIGTERM. The job (benchmarks/wan_chaos_job.py) runs `prime-mesh coordinator` and every node as
`prime-train` in its own network namespace and working folder, on --mbit links. The same seed
and settings draw the same schedule (the events' exact times depend on the machine).

A run holds when, from all nodes' metrics rows:
- one `outer_sha256` per outer step across every node (but the perturbed node's row at the
  step its weights were changed: the vote after it must find it), no outer step rolled back;
- every data slot's counted reads form one chain from 0 (nothing read twice or skipped);
- no stretch without a commit longer than the sync timeout (--sync-timeout);
- every node process exits 0 (except the ones the schedule SIGKILLed), and no namespace or
  process is left behind.
Prints each run's seed, schedule and checks, and how often the fault hooks fired (a node
stopped before its hook's outer step never fires it), then a summary; exits 1 unless every
run held.
Without root it says so and exits 0.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # prime_testkit, prime_netbed
sys.path.insert(0, str(ROOT / "benchmarks"))

import wan_chaos_report as report  # noqa: E402
import wan_chaos_schedule as schedule  # noqa: E402
from wan_chaos import bed_workdir, run_job  # noqa: E402

from prime_mesh.round_requests import DIVERGED  # noqa: E402
from prime_testkit import slot_chain_problems  # noqa: E402

CHECKS = ("one_hash_per_outer_step", "no_rollback", "slot_chains", "commit_gaps",
          "processes_exit_0", "no_namespace_or_process_left")  # fmt: skip


SETTLE_S = 30.0  # a node that arrived this long ago counts as a member holding the state


def draw(seed: int, events: int, nodes: int, heartbeat_timeout: float) -> str:
    """A schedule of `events` events for a run of `nodes` nodes (at most one more running at
    a time), the same for the same arguments. A member that has held the state for a while
    (`SETTLE_S`) always stays up and awake: a run whose every member is gone has nobody to
    hand its state to the nodes still joining."""
    rng = random.Random(seed)
    arrived = dict.fromkeys(range(nodes), -SETTLE_S)  # running node -> when it (re)started
    down: list[int] = []
    spare, coordinator, now, wait = nodes, False, 0.0, 0.0
    items: list[str] = []

    def when() -> str:
        nonlocal now
        if not items:
            return "o3"
        gap = wait + rng.uniform(3, 9)
        now += gap
        return f"+{gap:.1f}"

    def arrive() -> None:  # a stopped node run again, else a fresh one
        nonlocal spare
        if down:
            k = down.pop(rng.randrange(len(down)))
            items.append(f"{when()}:restart:{k}")
        else:
            k, spare = spare, spare + 1
            items.append(f"{when()}:add")
        arrived[k] = now

    def may_leave() -> list[int]:  # those whose leaving keeps a settled member up
        settled = [k for k, t in arrived.items() if now - t >= SETTLE_S]
        return sorted(k for k in arrived if set(settled) - {k})

    def leave(k: int, how: str, gap: float) -> None:
        nonlocal now
        now += gap
        items.append(f"+{gap:.1f}:{how}:{k}")
        del arrived[k]
        down.append(k)

    while len(items) + len(down) < events - 1:
        leavers = may_leave()
        kinds = ["kill", "term", "stall", "leave-while-listening"] if leavers else []
        kinds += ["arrive"] * (len(arrived) <= nodes)
        kinds += ["coordinator"] * (not coordinator and len(items) + len(down) < events - 3)
        kind, stalled = rng.choice(kinds), 0.0
        if kind in ("kill", "term"):
            gap = wait + rng.uniform(3, 9) if items else 0.0
            if not items:
                items.append(f"o3:{kind}:{rng.choice(leavers)}")
                down.append(int(items[-1].rsplit(":", 1)[1]))
                del arrived[down[-1]]
            else:
                leave(rng.choice(leavers), kind, gap)
        elif kind == "stall":  # past the heartbeat timeout: evicted, it rejoins by itself
            stalled = heartbeat_timeout + rng.uniform(1, 4)
            k = rng.choice(leavers)
            items.append(f"{when()}:stall:{k}:{stalled:.1f}")
            arrived[k] = now + stalled  # it rejoins: a member again once settled
        elif kind == "arrive":
            arrive()
        elif kind == "leave-while-listening":  # a node comes; a member leaves while it listens
            arrive()
            leave(rng.choice(leavers), rng.choice(["kill", "term"]), rng.uniform(3, 6))
        else:
            coordinator = True
            items.append(f"{when()}:kill-coordinator")
            gap = rng.uniform(2, 5)
            now += gap
            items.append(f"+{gap:.1f}:restart-coordinator")
        wait = stalled
    while down:
        arrive()
    return " ".join([*items, "back:stop"])


PERTURB, NAN = "PRIME_TRAIN_FAULT_PERTURB_OUTER_AT", "PRIME_TRAIN_FAULT_NAN_AT"


def draw_faults(seed: int, nodes: int, kinds: str = "both") -> dict[int, dict[str, str]]:
    """Two of the first nodes misbehave once per process (prime_train.faults): one's outer
    weights are perturbed after an outer step (the vote must find it; it rejoins), another's
    pseudo-gradient holds a NaN (left out of that round). `kinds`: "both", "nan" or "none".
    A perturbed node is found by the majority of the contributors' hashes: in a round with
    two contributors there is none, and the longest-standing member's hash wins, whichever
    is the perturbed one."""
    rng = random.Random(f"faults-{seed}")
    perturbed, nan = rng.sample(range(nodes), 2)
    at = rng.randint(5, 12), rng.randint(5, 12)
    drawn = {perturbed: {PERTURB: str(at[0])}, nan: {NAN: str(at[1])}}
    keep = {"both": (PERTURB, NAN), "nan": (NAN,), "none": ()}[kinds]
    return {k: env for k, env in drawn.items() if next(iter(env)) in keep}


def split_hashes(job) -> dict[int, list[str]]:
    """Outer steps whose rows carry more than one hash, leaving out the row of the one outer
    step at which the perturbed node's weights were changed by the fault hook (that row shows
    the injected difference; every later one must agree)."""
    injected = {(k, int(env[PERTURB])) for k, env in job.faults.items() if PERTURB in env}
    hashes: dict[int, set[str]] = {}
    for r in job.outer_rows():
        if (r["node"], r["outer_step"]) not in injected:
            hashes.setdefault(r["outer_step"], set()).add(r["outer_sha256"])
    return {k: sorted(v) for k, v in hashes.items() if len(v) > 1}


def commit_gaps(job, limit: float) -> list[str]:
    """Stretches without a commit longer than `limit` seconds."""
    times = [t for t, _, _ in report.commits(job.outer_rows())]
    return [f"{b - a:.1f} s without a commit before {b - job.t0:.1f} s"
            for a, b in zip(times, times[1:], strict=False) if b - a > limit]  # fmt: skip


def check(job, left: list[str], sync_timeout: float) -> dict[str, object]:
    lost = report.nothing_lost(job, {}, left)
    exits = {f"node{k} pid {p.pid}": p.returncode
             for k, p in job.every_proc if p.pid not in job.killed}  # fmt: skip
    chains, gaps = slot_chain_problems(job.outer_rows()), commit_gaps(job, sync_timeout)
    split = split_hashes(job)
    return {
        "one_hash_per_outer_step": not split and bool(lost["outer_steps"]),
        "split_hashes": split,
        "no_rollback": lost["no_rollback"],
        "rollbacks": lost["rollbacks"],
        "slot_chains": not chains,
        "slot_problems": chains[:10],
        "commit_gaps": not gaps,
        "long_gaps": gaps,
        "processes_exit_0": all(c == 0 for c in exits.values()),
        "exits": exits,
        "no_namespace_or_process_left": not left,
        "leftovers": left,
        "outer_steps": lost["outer_steps"],
    }


LEFT_OUT = "pseudo-gradient is left out of the round"  # prime_train.diloco.contribution's


def fired(folder: Path) -> str:
    """How often the drawn fault hooks showed in the nodes' logs (a node stopped before its
    hook's outer step never fires it): rounds left out for a NaN, perturbed nodes told."""
    logs = [p.read_text(errors="replace") for p in sorted(folder.glob("node*.log"))]
    return (f"{sum(t.count(LEFT_OUT) for t in logs)} round(s) left out, "
            f"{sum(t.count(DIVERGED) for t in logs)} node(s) told their weights differ")  # fmt: skip


def run_seed(seed: int, args, workdir: Path) -> dict:
    text = draw(seed, args.events, args.nodes, args.heartbeat_timeout)
    args.faults = draw_faults(seed, args.nodes, args.faults_drawn)
    faults = ", ".join(f"node{k} {n}={v}" for k, env in args.faults.items() for n, v in env.items())
    print(f"\n== seed {seed}: {text}\n   fault hooks: {faults}", flush=True)
    events = schedule.parse(text, args.nodes)
    try:
        job, _, left = run_job(f"seed{seed}", events, args.nodes, args, workdir)
    except (TimeoutError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"seed {seed}: FAILED to run: {e}", flush=True)
        return {"seed": seed, "schedule": text, "held": False, "error": str(e)}
    checks = check(job, left, args.sync_timeout)
    held = all(checks[c] for c in CHECKS)
    for c in CHECKS:
        print(f"  {'ok  ' if checks[c] else 'FAIL'} {c.replace('_', ' ')}")
    print(f"  fault hooks that fired: {fired(job.dir)}")
    if not held:
        detail = {k: v for k, v in checks.items() if k not in CHECKS and v}
        print(f"  details: {detail}")
    return {"seed": seed, "schedule": text, "held": held, "checks": checks, "dir": str(job.dir)}


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--runs", type=int, default=20, help="seeds to run, from --seed (default 20)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="these seeds instead of --seed and --runs")  # fmt: skip
    ap.add_argument("--events", type=int, default=12, help="events per run (default 12)")
    ap.add_argument("--quick", action="store_true", help="6 events a run (CI)")
    ap.add_argument("--nodes", type=int, default=3, help="nodes at the start (default 3)")
    ap.add_argument("--mbit", type=float, default=8.0, help="link rate, Mbit/s (default 8)")
    ap.add_argument("--serve-mbit", type=float, default=4.0, help="each donor's cap (default 4)")
    ap.add_argument("--inner-steps", type=int, default=10, help="H (default 10)")
    ap.add_argument("--slots", type=int, default=16, help="data slots (default 16)")
    ap.add_argument("--sync-timeout", type=float, default=30.0, help="diloco.sync_timeout_s")
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--heartbeat-timeout", type=float, default=4.0)
    ap.add_argument("--coordinator-grace", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on each run, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the working folders")
    ap.add_argument(
        "--faults", dest="faults_drawn", choices=("both", "nan", "none"), default="both",
        help="fault hooks drawn: a perturbed node and a NaN node (default), the NaN only, none",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.events = 6
    if args.seeds is None:
        args.seeds = list(range(args.seed, args.seed + args.runs))
    args.runs = len(args.seeds)
    # what wan_chaos_job.Job reads: the run never ends by itself, the schedule's stop ends it
    args.model, args.steps, args.eval_every, args.rerun = "debug", 100_000, 100_000, False
    args.extra_args = ["--data.slots", str(args.slots),
                       "--diloco.sync_timeout_s", str(args.sync_timeout)]  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = bed_workdir("churn")
    if workdir is None:
        return 0
    results = []
    started = time.time()
    try:
        for seed in args.seeds:
            results.append(run_seed(seed, args, workdir))
    finally:
        held = [r["seed"] for r in results if r["held"]]
        failed = [r["seed"] for r in results if not r["held"]]
        print(f"\nchurn: {len(held)} of {len(results)} run(s) held in "
              f"{time.time() - started:.0f} s ({args.events} events, {args.nodes} nodes, "
              f"{args.mbit:g} Mbit/s)")  # fmt: skip
        if failed:
            print(f"failed seeds: {failed} (replay one: benchmarks/churn.py --seed N --runs 1)")
        if failed or len(results) < args.runs or args.keep:
            print(f"working folders kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if results and len(held) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
