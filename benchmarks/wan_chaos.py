"""A DiLoCo job on the WAN bed (root) under a fault schedule, against the same job undisturbed.

    uv run python benchmarks/wan_chaos.py                  # the default schedule
    uv run python benchmarks/wan_chaos.py --quick          # a short one (the wan test)
    uv run python benchmarks/wan_chaos.py --schedule "o2:kill:1 +5:restart:1 o5:add"

Builds network namespaces joined by `tc tbf` links of --mbit (tests/support/prime_netbed.py):
one per node, spares for `add` events, and one for the coordinator. Runs `prime-mesh
coordinator` and every node as `prime-train` (configs/debug.toml, --model for a larger
preset) in its namespace and its own working folder, applies the schedule (see
benchmarks/wan_chaos_schedule.py for its language), then runs the same job undisturbed.

Prints progress, a timeline (time, event, members, outer step), the figures (held-out loss
and wall-clock ratios chaos / undisturbed at the same outer steps, the tokens each consumed,
per event the seconds until the survivors commit again and until the node contributes
again, bytes sent per outer step vs the fp32 ring) and the "nothing lost" checks: no committed
outer step rolled back, one weight hash per outer step across nodes, every node exiting 0,
every namespace and process gone. A node that exits asking to be rerun (a joiner whose fetch
outlasted a round) is rerun once or twice, as a supervisor would, and that is reported.
Writes wan_chaos.json and wan_chaos.png into --out (default: a new temporary folder, so a run
never overwrites the committed results; pass --out benchmarks/results to update those).
Exits 1 when a check fails; without root it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # prime_testkit, prime_netbed

import wan_chaos_report as report  # noqa: E402
import wan_chaos_schedule as schedule  # noqa: E402
from wan_chaos_job import Job  # noqa: E402


def say(job: Job | None, msg: str) -> None:
    t = time.time() - job.t0 if job else 0.0
    print(f"[{t:7.1f}s] {msg}", flush=True)


SOLE_HOLDER_WAIT_S = 60.0  # the longest a leaving event waits for its node not to hold alone
LEAVING = ("kill", "term", "stall")


def due(e: schedule.Event, job: Job, last_event: float) -> bool:
    """Whether `e` is due. A node leaving (killed, stopped, stalled) waits, up to
    `SOLE_HOLDER_WAIT_S` past its time, while it is the only contributor of the newest outer
    step: a fault hook's eviction may leave a member alone, and a run whose every holder of
    the state is gone can only go back to its newest checkpoint (a schedule keeps one settled
    member up; see benchmarks/churn.py's `draw`)."""
    if not _time_of(e, job, last_event):
        return False
    if e.kind not in LEAVING or not job.holds_alone(e.node):
        return True
    return time.time() - last_event > SOLE_HOLDER_WAIT_S


def _time_of(e: schedule.Event, job: Job, last_event: float) -> bool:
    if e.when == "o":
        return job.frontier() >= e.at
    if e.when == "+":
        return time.time() - last_event >= e.at
    if e.when == "b":  # settled: the newest outer step had every running node contributing
        rows = job.outer_rows()
        return (
            bool(rows)
            and rows[-1]["time"] > last_event
            and (rows[-1]["nodes"] == rows[-1]["contributors"] == len(job.running()))
        )
    return job.first_commit is not None and time.time() - job.first_commit >= e.at


def run_job(name: str, events: list[schedule.Event], nodes: int, args, workdir: Path):
    """Build a bed, run the job with its events, tear everything down; return the job,
    the nodes' exit codes and what was left behind (namespaces, processes)."""
    from prime_netbed import WanBed

    from prime_testkit import Children

    spares = sum(e.kind == "add" for e in events)
    children = Children()
    bed = WanBed(nodes + spares + 1, rate_mbit=args.mbit)
    job = None
    try:
        bed.__enter__()
        job = Job(bed, workdir / name, nodes, args, children)
        job.dir.mkdir(parents=True)
        say(job, f"{name}: {nodes} node(s) + {spares} spare(s) + coordinator, "
                 f"{args.mbit:g} Mbit/s links, logs in {job.dir}")  # fmt: skip
        job.start()
        pending, last_event = list(events), time.time()
        deadline = time.monotonic() + args.timeout
        while True:
            for r in job.poll_rows():
                if (
                    "outer_step" in r
                    and r["outer_step"] == job.frontier()
                    and r["node"]
                    == min(
                        x["node"] for x in job.outer_rows() if x["outer_step"] == r["outer_step"]
                    )
                ):
                    say(job, f"{name}: outer step {r['outer_step']} committed | "
                             f"{r['nodes']} member(s), {r['contributors']} contributed, "
                             f"epoch {r['epoch']}")  # fmt: skip
            if pending and due(pending[0], job, last_event):
                job.apply(pending.pop(0), lambda m: say(job, f"{name}: {m}"))
                last_event = time.time()
            job.rerun_if_asked(lambda m: say(job, f"{name}: {m}"))
            if not job.running():
                if pending:
                    raise RuntimeError(
                        f"every node exited before the event {pending[0].label()}; "
                        f"see the logs in {job.dir}"
                    )
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} did not finish in {args.timeout:.0f} s; logs in {job.dir}"
                )
            time.sleep(0.25)
        job.poll_rows()
        job.t_end = max((r["time"] for r in job.outer_rows()), default=time.time())
        exits = {k: p.returncode for k, p in job.procs.items()}
        say(job, f"{name}: finished, node exit codes {exits}")
    finally:
        if job is not None:
            job.stop_coordinator()
        children.kill_all()  # every process we started, by pid, before its namespace goes
        bed.close()  # kills what is left in the namespaces, then deletes them (and the veths)
    leftovers = bed.namespaces_left()
    leftovers += [f"pid {p.pid}" for p in children.popens if p.poll() is None]
    return job, exits, leftovers


def bed_workdir(name: str) -> Path | None:
    """A new working folder for a run on the WAN bed, with SIGTERM and SIGHUP unwinding
    through the cleanup; None (said why) when the bed cannot be built here (not root)."""
    from prime_netbed import bed_unavailable_reason

    reason = bed_unavailable_reason()
    if reason:
        print(f"{name}: not running: {reason}")
        return None

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    return Path(tempfile.mkdtemp(prefix=f"{name}_"))


def numel(preset: str) -> int:
    import torch

    from prime_train.model import BYTE_VOCAB_SIZE, Transformer, model_args, num_params

    with torch.device("meta"):
        return num_params(Transformer(model_args(preset, vocab_size=BYTE_VOCAB_SIZE)))


def tokens_per_step() -> int:
    cfg = tomllib.loads((ROOT / "configs" / "debug.toml").read_text())
    return cfg["train"]["batch_size"] * cfg["data"]["seq_len"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=3, help="nodes at the start (default 3)")
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate, Mbit/s (default 100)")
    ap.add_argument("--model", default="debug", help="model preset (default debug)")
    ap.add_argument("--steps", type=int, default=800, help="inner steps of the run")
    ap.add_argument("--inner-steps", type=int, default=20, help="H, inner steps per outer step")
    ap.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps")
    ap.add_argument("--schedule", default=None, help="faults (default: every kind, see above)")
    ap.add_argument("--quick", action="store_true", help="2 nodes, a short run and schedule")
    ap.add_argument(
        "--serve-mbit", type=float, default=None,
        help="cap on each node's serving to joiners, Mbit/s (default: mesh.serve_mbit's)",
    )  # fmt: skip
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--heartbeat-timeout", type=float, default=4.0)
    ap.add_argument("--coordinator-grace", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on each job, seconds")
    ap.add_argument(
        "--out", default=None, help="folder for the JSON + PNG (default: a new temporary one)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the working folders")
    args = ap.parse_args(argv)
    if args.quick:
        # short rounds: a joiner whose fetch outlasts rounds replays them (issue #24)
        args.nodes, args.steps, args.inner_steps, args.eval_every = 2, 300, 10, 50

    text = args.schedule or (schedule.QUICK if args.quick else schedule.DEFAULT)
    try:
        events = schedule.parse(text, args.nodes)
    except ValueError as e:
        ap.error(str(e))
    if args.steps % args.inner_steps:
        ap.error("--steps must be a multiple of --inner-steps")

    workdir = bed_workdir("wan_chaos")
    if workdir is None:
        return 0
    ok = False
    try:
        print(f"schedule: {' '.join(text.split())}", flush=True)
        chaos, chaos_exits, chaos_left = run_job("chaos", events, args.nodes, args, workdir)
        calm, calm_exits, calm_left = run_job("undisturbed", [], args.nodes, args, workdir)
        result = summarise(args, text, chaos, chaos_exits, chaos_left, calm, calm_left)
        ok = result["ok"] and not calm_left and all(c == 0 for c in calm_exits.values())
        return 0 if ok else 1
    finally:
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"working folders kept in {workdir}")


def num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def summarise(args, text, chaos, exits, left, calm, calm_left) -> dict:
    """Print the timeline, the figures and the checks; write the JSON and the PNG."""
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="wan_chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    checks = report.nothing_lost(chaos, exits, left)
    n = numel(args.model)
    loss_c, loss_u = report.final_eval(chaos), report.final_eval(calm)
    wall_c, wall_u = chaos.t_end - chaos.t0, calm.t_end - calm.t0
    per = tokens_per_step()
    result = {
        "schedule": " ".join(text.split()),
        "nodes": args.nodes,
        "mbit": args.mbit,
        "model": args.model,
        "params": n,
        "outer_steps": args.steps // args.inner_steps,
        "heldout_loss": {
            "chaos": loss_c,
            "undisturbed": loss_u,
            "ratio": loss_c / loss_u if loss_c and loss_u else None,
        },  # fmt: skip
        "tokens": {"chaos": report.tokens(chaos, per), "undisturbed": report.tokens(calm, per)},
        "wall_s": {"chaos": wall_c, "undisturbed": wall_u, "ratio": wall_c / wall_u},
        "timeline": chaos.timeline,
        "events": report.event_delays(chaos, args.inner_steps),
        "bytes": report.bytes_per_step(chaos, n),
        "checks": checks,
        "reruns": [e for e in chaos.timeline if e["kind"] == "rerun"],
        "undisturbed_left": calm_left,
    }
    result["ok"] = all(checks[k] for k in ("no_rollback", "one_hash_per_outer_step",
                                            "all_outer_steps_committed", "nodes_exit_0",
                                            "no_namespace_or_process_left"))  # fmt: skip
    print("\ntimeline (chaos run)\n| t (s) | event | members | outer step |\n|---|---|---|---|")
    for e in chaos.timeline:
        print(f"| {e['t']:.1f} | {e['event']} | {e['members']} | {e['outer_step']} |")
    print("\n| event | t (s) | survivors commit again (s) | node contributes again (s) "
          "| its snapshot (s) | rounds it caught up |\n|---|---|---|---|---|---|")  # fmt: skip
    for d in result["events"]:
        print(f"| {d['event']} | {d['t']} | {d['commit_again_s'] or '-'} | "
              f"{d['contributes_again_s'] or '-'} | {d.get('snapshot_s', '-')} | "
              f"{d.get('rounds_caught_up', '-')} |")  # fmt: skip
    h, tk, w, b = result["heldout_loss"], result["tokens"], result["wall_s"], result["bytes"]
    ratio = f"{h['ratio']:.3f}" if h["ratio"] else "n/a"
    print(f"\n| figure | chaos | undisturbed | ratio |\n|---|---|---|---|\n"
          f"| held-out loss after {result['outer_steps']} outer steps | {num(loss_c)} | "
          f"{num(loss_u)} | "
          f"{ratio} (goal <= 1.05) |\n"
          f"| tokens into the model | {tk['chaos']:,} | {tk['undisturbed']:,} | "
          f"{tk['chaos'] / max(tk['undisturbed'], 1):.3f} |\n"
          f"| wall clock to the last outer step (s) | {wall_c:.1f} | {wall_u:.1f} | "
          f"{w['ratio']:.3f} |\n"
          f"| bytes sent per outer step per node (chaos) | {b['bytes_per_step']:,.0f} | "
          f"fp32 ring {b['fp32_ring_bytes']:,.0f} | {b['ratio']:.3f} |")  # fmt: skip
    for e in result["reruns"]:
        print(f"\nnote: node{e['node']} exited {e['exit']} at {e['t']:.1f} s and was rerun: "
              f"{e['said']}")  # fmt: skip
    print("\nnothing lost:")
    for key in ("no_rollback", "one_hash_per_outer_step", "all_outer_steps_committed",
                "nodes_exit_0", "no_namespace_or_process_left"):  # fmt: skip
        print(f"  {'ok  ' if checks[key] else 'FAIL'} {key.replace('_', ' ')}")
    (out / "wan_chaos.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    report.plot(chaos, calm, out / "wan_chaos.png")
    print(f"\nwrote {out / 'wan_chaos.json'} and {out / 'wan_chaos.png'}")
    return result


if __name__ == "__main__":
    sys.exit(main())
