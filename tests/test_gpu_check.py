"""benchmarks/gpu_check.sh off a GPU: it refuses to pass without CUDA, says what it lacks when
the packages are missing, and its stages and table run on CPU as a dry run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run_gpu_check(tmp_path: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_", "GPU_CHECK_"))}
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**base, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_without_cuda_it_fails_loudly(tmp_path):
    r = run_gpu_check(tmp_path, 120, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu_check: FAILED: no CUDA device visible" in r.stderr
    assert "stage" not in r.stdout  # nothing ran


def test_missing_packages_and_no_wheels_are_named(tmp_path):
    hidden = tmp_path / "hide"  # prime_train made unimportable, as on a bare GPU machine
    (hidden / "prime_train").mkdir(parents=True)
    (hidden / "prime_train" / "__init__.py").write_text("raise ImportError('not installed')\n")
    r = run_gpu_check(tmp_path, 120, GPU_CHECK_DRY_RUN="1", PYTHONPATH=str(hidden),
            GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "prime_train is not importable" in r.stderr and "gpu_wheels.sh" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_on_cpu_runs_every_stage_and_prints_the_table(tmp_path):
    r = run_gpu_check(tmp_path, 560, GPU_CHECK_DRY_RUN="1", GPU_CHECK_STAGE_S="150")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DRY RUN on CPU" in r.stdout
    rows = {
        row["stage"]: row
        for row in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())
    }
    assert sorted(rows) == ["diloco", "node", "offload", "single"]
    for stage in ("single", "node", "diloco"):
        row = rows[stage]
        assert row["status"] == "ok" and row["steps_per_s"] > 0, row
        assert row["loss"][1] < row["loss"][0] and row["heldout"][1] < row["heldout"][0]
    assert rows["diloco"]["hashes_match"] is True and rows["diloco"]["outer_steps"] == 2
    assert rows["offload"]["status"].startswith("skipped")
    header = next(line for line in r.stdout.splitlines() if line.startswith("stage "))
    assert "steps/s" in header and "MFU" in header and "outer hashes" in header
