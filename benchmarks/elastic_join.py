"""A node joining a running DiLoCo job on the WAN bed (root): start-up, snapshot, replay and
admission, against the donors' capped serving rate and the members' rounds.

    uv run python benchmarks/elastic_join.py                    # debug model, 10 Mbit/s links
    uv run python benchmarks/elastic_join.py --mbit 100 --model 150M --steps 200

Two nodes train (benchmarks/wan_chaos_job.py's job: each node in its own namespace behind a
`tc tbf` link of --mbit, the coordinator in another); after outer step --join-at (default 4,
so that several rounds show the members' usual) a third node runs the same command. The
members serve at --serve-mbit (default half the link: `mesh.serve_mbit`).
Prints the joiner's timeline from its `joined` metrics row (start-up, snapshot bytes and
seconds, replayed rounds and seconds, admission), the snapshot's bytes over the capped serving
rate, and the members' round time before and during the join; checks the goals:
- joiner start to its first contribution <= 1.2 x (snapshot bytes / capped rate) + 2 rounds
  + start-up;
- the members' longest round during the join <= 1.5 x their usual at the size they have
  during it (with the joiner, admitted at once): their compute before the join (median) plus
  their outer step once the joiner contributes (median), so that a bigger membership's
  longer all-reduce, paid every round after, and the joiner's training on the same cores
  (an artefact of one machine) are not counted as the join's cost. Printed too, not
  checked: the longest round over their usual round before the join, one node fewer
  (`longest_over_usual`);
- the joiner's outer weights' hash equals the members' at every outer step it took.
Writes elastic_join.json into --out (default: a new temporary folder). Exits 1 when a goal
fails; without root it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "support")]

import wan_chaos_schedule as schedule  # noqa: E402
from wan_chaos import run_job  # noqa: E402


def figures(job, args) -> dict:
    """The join's figures from what the nodes wrote."""
    from prime_train.metrics import read_metrics

    joiner = 2
    rows = read_metrics(job.node_dir(joiner) / "runs" / "debug" / "metrics.jsonl")
    joined = next((r for r in rows if r.get("joined")), None)
    if joined is None:  # it listened until the run completed: nothing to measure
        return {"checks": {"joiner_entered_before_the_run_ended (raise --steps)": False}}
    started = job.lives[joiner][0]
    mine = [r for r in rows if "outer_step" in r]
    first_contrib = next(
        (r for r in mine if r["contributors"] == r["nodes"] and r["outer_step"] > 0), None
    )
    member = [r for r in job.rows[0].values() if "outer_step" in r]
    member.sort(key=lambda r: r["time"])
    before = [r["round_s"] for r in member if r["time"] < started and r.get("round_s")]
    # the joined row is written once the entry round committed, `admitted_seconds` after the
    # join began; start-up is the process's, from its start to the join (interpreter, torch,
    # model, data and registration included)
    join_began = joined["time"] - joined["admitted_seconds"]
    startup = join_began - started
    during = [r["round_s"] for r in member if started <= r["time"] <= joined["time"] + 1e-3]
    usual = statistics.median(before[1:] or before) if before else None
    # the members' usual round at the size they have during the join (the joiner is one of
    # them from its admission) without a transfer: their compute before the join plus their
    # collective once it contributes. A bigger membership costs every round (a ring moves
    # 2(N-1)/N of the bytes in 2(N-1) steps), which is no cost of the join; the compute after
    # it is not used, as there the joiner trains on the same cores (separate machines would
    # not share them)
    compute = [r["compute_s"] for r in member if r["time"] < started and r.get("compute_s")]
    after = [r["outer_seconds"] for r in member
             if first_contrib and r["time"] > first_contrib["time"] + 1e-3]  # fmt: skip
    usual_bigger = (
        statistics.median(compute[1:] or compute) + statistics.median(after)
        if compute and after
        else None
    )
    rate = args.serve_mbit * 1e6 / 8
    snapshot_ideal = joined["fetch_bytes"] / rate
    to_contrib = first_contrib["time"] - started if first_contrib else None
    goal_s = 1.2 * snapshot_ideal + 2 * (usual or 0.0) + startup
    theirs = {r["outer_step"]: r["outer_sha256"] for r in member}
    return {
        "startup_s": startup,
        "startup_after_imports_s": joined["startup_seconds"],
        "snapshot_bytes": joined["fetch_bytes"],
        "snapshot_s": joined["fetch_seconds"],
        "snapshot_MB_s": joined["fetch_bytes"] / 1e6 / joined["fetch_seconds"],
        "snapshot_over_capped_rate_s": snapshot_ideal,
        "snapshot_rounds": joined["fetch_seconds"] / usual if usual else None,
        "load_s": joined["load_seconds"],
        "replayed_rounds": joined["replayed"],
        "replay_bytes": joined["replay_bytes"],
        "replay_s": joined["replay_seconds"],
        "late_admissions": joined["late_admissions"],
        "listened_rounds": joined.get("listened", 0),
        "listened_while_snapshot_came": joined.get("snapshot_rounds", 0),
        "listened_while_fetching": joined.get("listened_fetching", 0),
        "backlog_s": joined.get("backlog_seconds", 0.0),
        "admitted_s": joined["admitted_seconds"],
        "start_to_first_contribution_s": to_contrib,
        "goal_start_to_contribution_s": goal_s,
        "members_usual_round_s": usual,
        "members_longest_round_during_join_s": max(during) if during else None,
        "members_usual_round_one_more_node_s": usual_bigger,
        "longest_over_usual": max(during) / usual if during and usual else None,
        "longest_over_usual_one_more_node": max(during) / usual_bigger
        if during and usual_bigger
        else None,
        "members_rounds_during_join_s": during,
        "checks": {
            "joiner_exit_0": job.procs[joiner].returncode == 0,
            "hash_matches": all(theirs.get(r["outer_step"]) == r["outer_sha256"] for r in mine),
            "start_to_contribution": to_contrib is not None and to_contrib <= goal_s,
            "members_round_during_join": bool(during)
            and usual_bigger is not None
            and max(during) <= 1.5 * usual_bigger,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mbit", type=float, default=10.0, help="link rate, Mbit/s (default 10)")
    ap.add_argument("--serve-mbit", type=float, default=None, help="donors' cap (default half)")
    ap.add_argument("--model", default="debug", help="model preset (default debug)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps of the run")
    ap.add_argument("--inner-steps", type=int, default=10, help="H, inner steps per outer step")
    ap.add_argument("--join-at", type=int, default=4, help="outer step the joiner starts at")
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--heartbeat-timeout", type=float, default=4.0)
    ap.add_argument("--coordinator-grace", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on the job, seconds")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: a temporary one)")
    args = ap.parse_args(argv)
    args.serve_mbit = args.serve_mbit or args.mbit / 2
    args.eval_every = 0  # the job passes --serve-mbit to every node as mesh.serve_mbit

    from prime_netbed import bed_unavailable_reason

    reason = bed_unavailable_reason()
    if reason:
        print(f"elastic_join: not running: {reason}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="elastic_join-"))
    t0 = time.time()
    job, exits, left = run_job("join", schedule.parse(f"o{args.join_at}:add", 2), 2, args, work)
    result = {"args": vars(args),
              "exits": exits, "leftovers": left, **figures(job, args),
              "wall_s": time.time() - t0}  # fmt: skip
    result["checks"]["nodes_exit_0"] = set(exits.values()) == {0}
    result["checks"]["nothing_left"] = left == []
    print(json.dumps({k: v for k, v in result.items() if k not in ("args",)}, indent=2))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="elastic_join-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "elastic_join.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'elastic_join.json'}; logs in {work}")
    failed = [k for k, ok in result["checks"].items() if not ok]
    for k, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {k.replace('_', ' ')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
