"""Figures, checks and the plot of benchmarks/wan_chaos.py, from the rows of two finished jobs."""

from __future__ import annotations

from pathlib import Path
from statistics import median

RECOVERS = ("kill", "stall", "cut", "kill-coordinator")  # the survivors must commit again
RETURNS = (
    "restart",
    "restore",
    "add",
    "stall",
    "restart-coordinator",
    "rerun",
)  # a node comes back


def commits(rows: list[dict]) -> list[tuple[float, int, int]]:
    """(time of the first row, outer step, members) of each committed outer step."""
    first: dict[int, dict] = {}
    for r in rows:
        if r["outer_step"] not in first or r["time"] < first[r["outer_step"]]["time"]:
            first[r["outer_step"]] = r
    return sorted((r["time"], k, r["nodes"]) for k, r in first.items())


def nothing_lost(job, exits: dict[int, int], leftovers: list[str]) -> dict[str, object]:
    """The checks of "nothing lost", each True/False with what was found."""
    rows = job.outer_rows()
    hashes: dict[int, set[str]] = {}
    for r in rows:
        hashes.setdefault(r["outer_step"], set()).add(r["outer_sha256"])
    split = {k: sorted(v) for k, v in hashes.items() if len(v) > 1}
    # a rollback: a node life that writes an outer step the job had committed before it began,
    # or one whose outer steps do not strictly rise
    rollbacks = []
    for k, starts in job.lives.items():
        mine = sorted((r for r in rows if r["node"] == k), key=lambda r: r["time"])
        for i, t in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else float("inf")
            life = [r["outer_step"] for r in mine if t <= r["time"] < end]
            before = max((r["outer_step"] for r in rows if r["time"] < t), default=0)
            if any(b <= a for a, b in zip(life, life[1:], strict=False)) or (
                life and i and life[0] <= before
            ):
                rollbacks.append({"node": k, "life": i, "steps": life, "committed_before": before})
    total = job.args.steps // job.args.inner_steps
    return {
        "no_rollback": not rollbacks,
        "rollbacks": rollbacks,
        "one_hash_per_outer_step": not split and bool(hashes),
        "split_hashes": split,
        "all_outer_steps_committed": sorted(hashes) == list(range(1, total + 1)),
        "outer_steps": len(hashes),
        "nodes_exit_0": all(c == 0 for c in exits.values()),
        "exits": exits,
        "no_namespace_or_process_left": not leftovers,
        "leftovers": leftovers,
    }


def final_eval(job) -> float | None:
    """The held-out loss at the last step (the nodes agree on the weights, so on it too)."""
    last = job.args.steps
    vals = [r["eval_loss"] for rs in job.rows.values() for r in rs.values()
            if r.get("step") == last and "eval_loss" in r]  # fmt: skip
    return median(vals) if vals else None


def tokens(job, tokens_per_step: int) -> int:
    """Tokens that went into the model: each outer step, H inner steps of every contributor."""
    first: dict[int, dict] = {}
    for r in job.outer_rows():
        first.setdefault(r["outer_step"], r)
    return sum(r.get("contributors", r["nodes"]) for r in first.values()) * (
        job.args.inner_steps * tokens_per_step
    )


def event_delays(job, inner_steps: int) -> list[dict]:
    """Per event: seconds until the survivors commit again, and until the node it concerns
    contributes again (its first outer step after the event in which every member
    contributed, i.e. past its entry step); for a node that (re)entered, its snapshot's
    seconds and the rounds the members committed between its snapshot and its entry."""
    rows = job.outer_rows()
    out = []
    for e in job.timeline:
        t = e["t"] + job.t0
        after = [r for r in rows if r["time"] > t]
        d = {"event": e["event"], "t": round(e["t"], 1), "commit_again_s": None,
             "contributes_again_s": None}  # fmt: skip
        if e["kind"] in RECOVERS and after:
            d["commit_again_s"] = round(after[0]["time"] - t, 2)
        if e["kind"] == "restart-coordinator" and after:
            d["commit_again_s"] = round(after[0]["time"] - t, 2)
        if e["kind"] in RETURNS and e["node"] is not None:
            back = [r for r in after if r["node"] == e["node"] and r["contributors"] == r["nodes"]]
            if back:
                d["contributes_again_s"] = round(back[0]["time"] - t, 2)
            entry = [r for r in job.joined_rows() if r["node"] == e["node"] and r["time"] > t]
            if entry:  # how far behind its snapshot left it: the rounds it caught up
                j = entry[0]
                d["snapshot_s"] = round(j["fetch_seconds"], 2)
                d["rounds_caught_up"] = (j["step"] - j["fetched_step"]) // inner_steps
                d["late_admissions"] = j.get("late_admissions", 0)
        out.append(d)
    return out


def bytes_per_step(job, numel: int) -> dict[str, float]:
    """Mean bytes a node sent per outer step, against the fp32 ring of the same members."""
    import prime_comm

    rows = [r for r in job.outer_rows() if r["nodes"] > 1]
    if not rows:
        return {"bytes_per_step": 0.0, "fp32_ring_bytes": 0.0, "ratio": 0.0}
    sent = sum(r["bytes_sent"] for r in rows) / len(rows)
    ring = sum(prime_comm.ring_bytes(numel, r["nodes"]) for r in rows) / len(rows)
    return {"bytes_per_step": sent, "fp32_ring_bytes": ring, "ratio": sent / ring}


def plot(chaos, calm, path: Path) -> None:
    """Loss against wall time for both runs with the events marked; members beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, mem) = plt.subplots(
        2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for job, label, color in ((calm, "undisturbed", "tab:blue"), (chaos, "chaos", "tab:red")):
        t0 = job.t0
        pts = sorted((r["time"] - t0, r["loss"]) for rs in job.train_rows().values() for r in rs)
        if pts:
            ax.plot(
                *zip(*pts, strict=True),
                ".",
                ms=3,
                alpha=0.5,
                color=color,
                label=f"{label}: train loss",
            )
        ev = sorted(
            (r["time"] - t0, r["eval_loss"])
            for rs in job.rows.values()
            for r in rs.values()
            if "eval_loss" in r
        )
        if ev:
            ax.plot(*zip(*ev, strict=True), "o-", color=color, label=f"{label}: held-out loss")
        steps = commits(job.outer_rows())
        if steps:
            xs = [0.0] + [t - t0 for t, _, _ in steps]
            ys = [steps[0][2]] + [n for _, _, n in steps]
            mem.step(xs, ys, where="post", color=color, label=label)
    for e in chaos.timeline:
        for a in (ax, mem):
            a.axvline(e["t"], color="gray", ls="--", lw=0.8)
        ax.annotate(e["event"], (e["t"], 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7)  # fmt: skip
    ax.set_ylabel("loss")
    ax.set_title("DiLoCo on the WAN bed: chaos run vs undisturbed run")
    ax.legend(fontsize=8, loc="upper right")
    mem.set_ylabel("members")
    mem.set_xlabel("wall time since start (s)")
    mem.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
