"""benchmarks/churn.py: its seeded schedules and its checks (quick), and two short seeds run as
a user runs them on the WAN bed (wan): every node ends with one weight hash per outer step,
every slot's reads one chain from 0, no long stretch without a commit, every process exit 0.
The two seeds together draw every kind of event: a joiner and a member SIGKILLed while it
listens, SIGTERM, SIGSTOP past the heartbeat timeout, a coordinator SIGKILL and restart,
reruns; and a NaN node."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prime_netbed import bed_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import churn  # noqa: E402
import wan_chaos_schedule as schedule  # noqa: E402


@pytest.mark.parametrize("seed", range(30))
def test_a_seed_draws_one_valid_schedule_of_its_events(seed):
    text = churn.draw(seed, 12, 3, 4.0)
    assert text == churn.draw(seed, 12, 3, 4.0)  # --seed replays it
    events = schedule.parse(text, 3)  # restarts follow stops, the coordinator comes back
    assert events[-1].kind == "stop" and 12 <= len(events) <= 14
    assert {e.kind for e in events} <= {"kill", "term", "restart", "stall", "add", "stop",
                                        "kill-coordinator", "restart-coordinator"}  # fmt: skip
    for e in events:
        if e.kind == "stall":
            assert e.seconds > 4.0  # past the heartbeat timeout


def test_the_draws_cover_every_kind_of_event():
    kinds = {e.kind for s in range(20) for e in schedule.parse(churn.draw(s, 12, 3, 4.0), 3)}
    assert kinds == {"kill", "term", "restart", "stall", "add", "stop", "kill-coordinator",
                     "restart-coordinator"}  # fmt: skip


def job_of(rows: list[dict], faults: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        outer_rows=lambda: sorted(rows, key=lambda r: r["time"]), t0=0.0, faults=faults or {}
    )


def row(node, k, t, data):
    return {"node": node, "outer_step": k, "time": t, "nodes": 2, "data": data}


def test_one_hash_per_outer_step_but_the_injected_row():
    faults = churn.draw_faults(3, 3)
    assert faults == churn.draw_faults(3, 3) and len(faults) == 2  # two nodes, replayable
    assert [n for env in churn.draw_faults(3, 3, "nan").values() for n in env] == [churn.NAN]
    assert churn.draw_faults(3, 3, "none") == {}
    (p,) = [k for k, env in faults.items() if churn.PERTURB in env]
    at = int(faults[p][churn.PERTURB])
    rows = [{**row(k, s, float(s), {}), "outer_sha256": f"h{s}"} for k in range(3)
            for s in range(1, at + 3)]  # fmt: skip
    rows[[i for i, r in enumerate(rows) if (r["node"], r["outer_step"]) == (p, at)][0]][
        "outer_sha256"
    ] = "perturbed"
    assert churn.split_hashes(job_of(rows, faults)) == {}  # the fault's own row is not a split
    rows.append({**row(p, at + 3, 99.0, {}), "outer_sha256": "still differs"})
    rows.append({**row((p + 1) % 3, at + 3, 99.0, {}), "outer_sha256": f"h{at + 3}"})
    assert churn.split_hashes(job_of(rows, faults)) == {at + 3: [f"h{at + 3}", "still differs"]}


def test_commit_gaps_find_a_stretch_without_a_commit():
    rows = [row(0, 1, 1.0, {}), row(0, 2, 3.0, {}), row(0, 3, 40.0, {})]
    assert churn.commit_gaps(job_of(rows), 30.0) == ["37.0 s without a commit before 40.0 s"]
    assert churn.commit_gaps(job_of(rows), 40.0) == []


CI_SEEDS = (0, 7)


def test_the_ci_seeds_draw_every_kind_of_event_and_a_leave_while_listening():
    drawn = [schedule.parse(churn.draw(s, 6, 3, 4.0), 3) for s in CI_SEEDS]
    assert {e.kind for events in drawn for e in events} == {
        "kill", "term", "restart", "stall", "add", "stop", "kill-coordinator",
        "restart-coordinator"}  # fmt: skip
    first = drawn[0]  # a fresh node, and a member SIGKILLed 3.8 s later while it listens
    assert [e.kind for e in first[:2]] == ["add", "kill"], first


@pytest.mark.wan
@pytest.mark.skipif(bed_unavailable_reason() is not None and not os.environ.get("CI"),
                    reason=str(bed_unavailable_reason()))  # fmt: skip
@pytest.mark.timeout(900)
def test_two_short_seeds_of_random_churn_hold():
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "churn.py"), "--quick", "--seeds",
         *map(str, CI_SEEDS), "--timeout", "360", "--faults", "nan"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "churn: 2 of 2 run(s) held" in out, out[-4000:]
    assert out.count("PRIME_TRAIN_FAULT_NAN_AT=") == 2, out[-4000:]  # a NaN node in each
    for check in churn.CHECKS:
        assert out.count(f"ok   {check.replace('_', ' ')}") == 2, (check, out[-4000:])
    left_out = [
        int(n) for n in re.findall(r"fault hooks that fired: (\d+) round\(s\) left out", out)
    ]
    assert len(left_out) == 2 and sum(left_out) >= 1, out[-4000:]  # the NaN node was left out
