"""The training loop in-process: it learns, records metrics, and schedules the learning rate."""

import json
import math

import pytest

from prime_train.config import OptimConfig
from prime_train.config_load import load_config
from prime_train.metrics import read_metrics
from prime_train.optim import lr_at
from prime_train.trainer import train


def tiny(tmp_path, *extra, name="t"):
    return load_config(
        None,
        [
            "--run.runs_dir",
            str(tmp_path / "runs"),
            "--run.name",
            name,
            "--run.log_every",
            "5",
            "--data.path",
            "{stdlib}/[a-c]*.py",
            "--data.seq_len",
            "64",
            "--train.steps",
            "40",
            "--train.batch_size",
            "8",
            "--train.device",
            "cpu",
            "--train.threads",
            "1",
            "--optim.lr",
            "3e-3",
            "--optim.warmup_steps",
            "5",
            "--eval.every",
            "20",
            "--eval.batches",
            "2",
            "--ckpt.every",
            "0",
            *extra,
        ],
        env={},
    )


def test_train_learns_and_records(tmp_path, capsys):
    cfg = tiny(tmp_path)
    summary = train(cfg)
    out = capsys.readouterr().out
    assert "[node 0 rank 0] step 0/40 | held-out loss" in out
    assert "step 40/40 | loss" in out and "tok/s" in out and "done: 40/40 steps" in out
    assert summary.steps == 40 and summary.tokens == 40 * 8 * 64
    assert summary.heldout_loss <= 0.7 * summary.initial_heldout_loss
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(5, 41, 5))
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 20, 40]
    assert all(r["tokens_per_s"] > 0 for r in records if "loss" in r)
    saved = json.loads((cfg.run_dir / "summary.json").read_text())
    assert saved["steps"] == 40 and saved["heldout_loss"] == summary.heldout_loss
    assert (cfg.run_dir / "loss.png").stat().st_size > 1000


def test_options_run(tmp_path):
    """Activation checkpointing, WSD and the CPU-offload policy all train (a few steps)."""
    cfg = tiny(
        tmp_path,
        "--train.steps",
        "6",
        "--train.activation_checkpointing",
        "true",
        "--train.cpu_offload",
        "true",
        "--optim.schedule",
        "wsd",
        "--eval.every",
        "0",
    )
    summary = train(cfg)
    assert summary.steps == 6 and math.isfinite(summary.final_loss)


def test_synthetic_source(tmp_path):
    cfg = tiny(tmp_path, "--data.source", "synthetic", "--train.steps", "4", "--eval.every", "0")
    summary = train(cfg)
    assert summary.steps == 4
    assert summary.initial_heldout_loss == pytest.approx(math.log(257) + 0.5, abs=1.0)


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(1, cos, 100) == pytest.approx(0.1)
    assert lr_at(10, cos, 100) == pytest.approx(1.0)
    assert lr_at(55, cos, 100) == pytest.approx(0.55)
    assert lr_at(100, cos, 100) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, wsd, 100) == 1.0 and lr_at(80, wsd, 100) == 1.0
    assert lr_at(90, wsd, 100) == pytest.approx(0.5) and lr_at(100, wsd, 100) == 0.0
    const = OptimConfig(lr=2.0, warmup_steps=0, schedule="constant")
    assert lr_at(1, const, 10) == lr_at(10, const, 10) == 2.0


@pytest.mark.slow
def test_compile_trains(tmp_path):
    """torch.compile per block (needs a C compiler on CPU; ~1 min to compile)."""
    cfg = tiny(tmp_path, "--train.steps", "10", "--train.compile", "true", "--eval.every", "0")
    summary = train(cfg)
    assert summary.steps == 10 and summary.heldout_loss < summary.initial_heldout_loss


class CountingOuter:
    """Stands in for DiLoCo's outer step: records the steps it runs at."""

    def __init__(self):
        self.calls = []

    def step(self, step):
        self.calls.append(step)


def test_outer_step_seam_runs_every_h_steps(tmp_path):
    cfg = tiny(
        tmp_path,
        "--train.steps",
        "12",
        "--diloco.inner_steps",
        "4",
        "--ckpt.every",
        "4",
        "--eval.every",
        "0",
    )
    outer = CountingOuter()
    train(cfg, outer=outer)
    assert outer.calls == [4, 8, 12]
    metrics = (cfg.run_dir / "metrics.jsonl").read_text()
    summary = (cfg.run_dir / "summary.json").read_text()
    again = CountingOuter()
    train(cfg, outer=again)  # complete: loads the step-12 checkpoint, trains nothing
    assert again.calls == []
    assert (cfg.run_dir / "metrics.jsonl").read_text() == metrics
    assert (cfg.run_dir / "summary.json").read_text() == summary


def test_setup_error_releases_the_process_group(tmp_path):
    import torch.distributed as dist

    from prime_train.config_load import ConfigError

    with pytest.raises(ConfigError, match="model.vocab_size >= 257"):
        train(tiny(tmp_path, "--model.vocab_size", "100"))
    assert not dist.is_initialized()  # a later train() in this process can start afresh
