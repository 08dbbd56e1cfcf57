"""benchmarks/wan_chaos.py --quick, run as a user runs it: a DiLoCo job on the WAN bed loses a
node, gets it back, has a straggler and a new node, and nothing is lost."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prime_netbed import bed_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.wan,
    pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason())),
]


@pytest.mark.timeout(900)
def test_quick_chaos_schedule_loses_nothing(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "wan_chaos.py"), "--quick",
         "--out", str(tmp_path), "--timeout", "360"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    result = json.loads((tmp_path / "wan_chaos.json").read_text())
    checks = result["checks"]
    for key in ("no_rollback", "one_hash_per_outer_step", "all_outer_steps_committed",
                "nodes_exit_0", "no_namespace_or_process_left"):  # fmt: skip
        assert checks[key] is True, (key, checks, out[-4000:])
        assert f"ok   {key.replace('_', ' ')}" in out
    assert checks["outer_steps"] == result["outer_steps"] == 30
    assert result["undisturbed_left"] == []
    # (a joiner whose fetch outlasted a round exits asking to be rerun, and the script reruns
    # it, as a supervisor would: that is reported, not a fault of the schedule)
    kinds = [e["kind"] for e in result["timeline"] if e["kind"] != "rerun"]
    assert kinds == ["kill", "restart", "stall", "add"], result["timeline"]
    events = {e["event"].split()[0]: e for e in result["events"]}
    assert events["kill"]["commit_again_s"] is not None  # the survivor went on
    assert events["restart"]["contributes_again_s"] is not None  # the killed node came back
    assert events["add"]["contributes_again_s"] is not None  # the new node contributed
    assert result["tokens"]["chaos"] > 0 and result["heldout_loss"]["ratio"] is not None
    assert 0 < result["bytes"]["ratio"] < 0.5  # uint8 pseudo-gradients: about a quarter of fp32
    assert (tmp_path / "wan_chaos.png").stat().st_size > 10_000
