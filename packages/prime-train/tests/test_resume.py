"""Stopping and resuming through the real CLI: SIGTERM, SIGKILL, exact losses, several ranks."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_testkit import losses, wait_until
from prime_train.metrics import read_metrics

STEPS = 30


@pytest.fixture(scope="session")
def args(tiny_cli_args):
    """`args(runs_dir, steps)`: the tiny run, a progress line every step, a checkpoint every 5."""

    def run_args(runs_dir, steps=STEPS):
        return tiny_cli_args(
            runs_dir, "--run.log_every", "1", "--train.batch_size", "4",
            "--train.steps", str(steps), "--eval.every", "10", "--ckpt.every", "5",
        )  # fmt: skip

    return run_args


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run_cli, args):
    """The uninterrupted run every resumed run must reproduce exactly."""
    runs = tmp_path_factory.mktemp("ref")
    r = run_cli(*args(runs))
    assert r.returncode == 0, r.stderr[-2000:]
    train, held = losses(runs / "debug", by_step=True)
    assert sorted(train) == list(range(1, STEPS + 1))
    return train, held


def start_and_signal(children, argv, env, sig, after_step):
    metrics = Path(argv[argv.index("--run.runs_dir") + 1]) / "debug" / "metrics.jsonl"
    proc = children.popen(
        [sys.executable, "-m", "prime_train.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def reached():
        assert proc.poll() is None, proc.communicate()
        return any(r.get("step", 0) >= after_step and "loss" in r for r in read_metrics(metrics))

    wait_until(reached, timeout=180, interval=0.02, what=f"step {after_step}")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(children, tmp_path, args, cli_env):
    rc, out, err = start_and_signal(children, args(tmp_path), cli_env, signal.SIGTERM, 3)
    assert rc == 0, err[-2000:]
    assert "SIGTERM received: stopped after step" in out and "Traceback" not in err
    summary = json.loads((tmp_path / "debug" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and 3 <= summary["steps"] < STEPS


def test_sigterm_then_rerun_resumes_exactly(children, tmp_path, reference, run_cli, args, cli_env):
    rc, out, err = start_and_signal(children, args(tmp_path), cli_env, signal.SIGTERM, 7)
    assert rc == 0, err[-2000:]
    stopped = json.loads((tmp_path / "debug" / "summary.json").read_text())["steps"]
    r = run_cli(*args(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from the step-{stopped} checkpoint" in r.stdout
    # bit-identical train and held-out losses
    assert losses(tmp_path / "debug", by_step=True) == reference


def test_sigkill_then_rerun_resumes_exactly_from_last_checkpoint(
    children, tmp_path, reference, run_cli, args, cli_env
):
    rc, _, _ = start_and_signal(children, args(tmp_path), cli_env, signal.SIGKILL, 12)
    assert rc == -signal.SIGKILL
    r = run_cli(*args(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from the step-" in r.stdout
    # metrics past the checkpoint were dropped and re-recorded: exactly the reference again
    assert losses(tmp_path / "debug", by_step=True) == reference


@pytest.mark.slow
def test_two_ranks_via_torchrun(tmp_path, port, args, cli_env):
    """FSDP2 over 2 CPU ranks (gloo) started by torchrun: shards the model, trains, learns."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "prime_train.cli",
        *args(tmp_path, 20),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=cli_env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FSDP2 over 2 rank(s)" in r.stdout and "done: 20/20 steps" in r.stdout
    summary = json.loads((tmp_path / "debug" / "summary.json").read_text())
    assert summary["tokens"] == 20 * 4 * 64 * 2
    assert summary["heldout_loss"] <= 0.7 * summary["initial_heldout_loss"]
    # both ranks load their shards of the step-20 checkpoint
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=cli_env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from the step-20 checkpoint" in r.stdout
