"""The `prime-train` command end to end: the debug config, the plot command, bad input."""

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"


def test_missing_config_is_one_clear_line(tmp_path, run_cli):
    missing = tmp_path / "nope.toml"
    r = run_cli("--config", str(missing))
    assert r.returncode == 2
    assert str(missing) in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_data_path_is_clear(tmp_path, run_cli):
    r = run_cli(
        "--config",
        str(DEBUG),
        "--run.runs_dir",
        str(tmp_path),
        "--data.path",
        str(tmp_path / "none" / "*.txt"),
    )
    assert r.returncode == 2, r.stderr
    assert "matches no files" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        (["--model.dim", "130"], "divisible by n_heads"),
        (["--model.vocab_size", "100"], "set model.vocab_size >= 257"),
        (["--train.device", "cuda"], "no CUDA device"),
        (  # nothing is sent: the check comes before any connection
            ["--mesh.coordinator", "192.0.2.1:29500", "--mesh.host", "127.0.0.1"],
            "--mesh.host: host '127.0.0.1' is reachable from this machine only",
        ),
    ],
)
def test_combined_settings_errors_are_clear(tmp_path, override, expect, run_cli):
    if "cuda" in override and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: 'cuda' is valid here")
    r = run_cli("--config", str(DEBUG), "--run.runs_dir", str(tmp_path), *override)
    assert r.returncode == 2, r.stderr[-2000:]
    assert expect in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2


def check_debug_run(r, run_dir, steps):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "[node 0 rank 0] step 0/" in r.stdout and "tok/s" in r.stdout
    assert f"done: {steps}/{steps} steps" in r.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    # "learns": the final held-out loss is at most 0.7x the step-0 held-out loss
    assert summary["heldout_loss"] <= 0.7 * summary["initial_heldout_loss"], summary
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "loss.png").is_file()
    return summary


def test_debug_config_short(tmp_path, run_cli):
    r = run_cli(
        "--config",
        str(DEBUG),
        "--run.runs_dir",
        str(tmp_path),
        "--train.steps",
        "120",
        "--eval.every",
        "60",
        "--ckpt.every",
        "60",
        "--launch.local_nodes",
        "1",
    )
    check_debug_run(r, tmp_path / "debug", 120)
    # progress rows count the checkpoints saved so far (step 60's, after its own row) and the
    # seconds the loop waited for them
    rows = [json.loads(x) for x in (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()]
    progress = [row for row in rows if "loss" in row]
    assert [row["ckpt_saves"] for row in progress] == [int(row["step"] > 60) for row in progress]
    blocked = [row["ckpt_blocked_s"] for row in progress]
    assert blocked == sorted(blocked) and blocked[0] == 0.0 < blocked[-1] < 60, blocked
    # a different config in the same run folder is refused, nothing overwritten
    r2 = run_cli(
        "--config", str(DEBUG), "--run.runs_dir", str(tmp_path), "--train.steps", "99",
        "--launch.local_nodes", "1",
    )  # fmt: skip
    assert r2.returncode == 2 and "different config" in r2.stderr and "train.steps" in r2.stderr
    assert "Traceback" not in r2.stderr
    # prime-train plot RUN_DIR redraws the curve for any run
    out = tmp_path / "again.png"
    r3 = run_cli("plot", str(tmp_path / "debug"), "--out", str(out))
    assert r3.returncode == 0 and out.stat().st_size > 1000, r3.stderr
    r4 = run_cli("plot", str(tmp_path / "nothing"))
    assert r4.returncode == 2 and "no metrics.jsonl" in r4.stderr


@pytest.mark.slow
def test_debug_config_full(tmp_path, run_cli):
    r = run_cli("--config", str(DEBUG), "--run.runs_dir", str(tmp_path), timeout=290)
    summary = check_debug_run(r, tmp_path / "debug", 500)
    assert summary["tokens"] == 500 * 16 * 128  # per node
    assert "[node 1 rank 0] done: 500/500 steps" in r.stdout
    assert summary["diloco"]["outer_steps"] == 10 and summary["diloco"]["nodes_now"] == 2
