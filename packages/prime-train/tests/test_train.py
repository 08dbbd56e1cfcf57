"""The training loop in-process: it learns, records metrics, and schedules the learning rate."""

import json
import math

import pytest
import torch

from prime_train.config import OptimConfig
from prime_train.metrics import read_metrics
from prime_train.optim import lr_at
from prime_train.seam import OuterStep
from prime_train.trainer import train


def test_train_learns_and_records(tiny, capsys):
    cfg = tiny()
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


def test_options_take_effect(tiny):
    """CPU offload reaches every FSDP2 unit, activation checkpointing recomputes each block's
    forward in backward, and the wsd schedule sets the learning rates it defines."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from prime_train.metrics import Log
    from prime_train.placement import init_placement
    from prime_train.run import Run

    cfg = tiny(
        "--train.steps", "10", "--train.activation_checkpointing", "true",
        "--train.cpu_offload", "true", "--optim.schedule", "wsd", "--optim.warmup_steps", "2",
        "--optim.decay_fraction", "0.4", "--optim.min_lr_ratio", "0.0", "--optim.lr", "1e-3",
    )  # fmt: skip
    placement = init_placement(cfg)
    run = Run(cfg, placement, Log(placement.prefix, primary=False))
    try:
        units = [m for m in run.model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == len(run.model.layers) + 1
        for unit in units:  # no public accessor for a unit's policy: read FSDP2's state
            policy = unit._get_fsdp_state()._fsdp_param_group.offload_policy
            assert isinstance(policy, CPUOffloadPolicy), policy

        calls = [0] * len(run.model.layers)
        for i, block in enumerate(run.model.layers):
            block.attention.register_forward_hook(
                lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)
            )
        lrs = []
        for step in range(1, 11):
            run.inner_step(step)
            lrs.append(run.opt.param_groups[0]["lr"])
        # one forward, one recomputation in backward, per block and step
        assert calls == [20] * len(run.model.layers)
        # wsd: warm up over 2 steps, hold, then decay linearly to 0 over the last 4
        want = [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0]
        assert lrs == pytest.approx(want, abs=1e-12)
    finally:
        run.close()
        placement.close()


def test_synthetic_source(tiny):
    cfg = tiny("--data.source", "synthetic", "--train.steps", "4", "--eval.every", "0")
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
def test_compile_trains(tiny):
    """torch.compile per block (needs a C compiler on CPU; ~1 min to compile)."""
    cfg = tiny("--train.steps", "10", "--train.compile", "true", "--eval.every", "0")
    summary = train(cfg)
    assert summary.steps == 10 and summary.heldout_loss < summary.initial_heldout_loss


class CountingOuter:
    """Stands in for DiLoCo's outer step: records the steps it runs at, checkpoints a count.
    It implements every member of `prime_train.seam.OuterStep`, as a custom outer step must."""

    overlapped = False

    def __init__(self, every):
        self.every = every
        self.calls, self.finished, self.closed = [], 0, 0
        self.count = torch.zeros(1)

    def is_boundary(self, step):
        return step % self.every == 0

    def close(self):
        self.closed += 1

    def start(self, step):
        self.calls.append(step)

    def finish(self):
        self.finished += 1
        self.count += 1

    def add_compute_time(self, seconds):
        assert seconds > 0

    def state_dict(self):
        return {"count": self.count, "calls": list(self.calls)}

    def load_state_dict(self, state):
        self.calls = list(state["calls"])

    def agree_resume_step(self, local_steps):
        return max(local_steps) if local_steps else None

    def summary(self):
        return {"outer_steps": int(self.count)}


def test_outer_step_seam_runs_every_h_steps_and_is_checkpointed(tiny):
    cfg = tiny(
        "--train.steps",
        "12",
        "--diloco.inner_steps",
        "4",
        "--ckpt.every",
        "4",
        "--eval.every",
        "0",
    )
    outer = CountingOuter(every=4)
    assert isinstance(outer, OuterStep)
    summary = train(cfg, outer=outer)
    assert outer.calls == [4, 8, 12] and outer.finished == 3 and outer.closed == 1
    assert summary.diloco == {"outer_steps": 3}
    metrics = (cfg.run_dir / "metrics.jsonl").read_text()
    summary = (cfg.run_dir / "summary.json").read_text()
    again = CountingOuter(every=4)
    train(cfg, outer=again)  # complete: loads the step-12 checkpoint, trains nothing
    assert again.finished == 0
    assert again.calls == [4, 8, 12] and int(again.count) == 3  # its state came back
    assert (cfg.run_dir / "metrics.jsonl").read_text() == metrics
    assert (cfg.run_dir / "summary.json").read_text() == summary


def test_setup_error_releases_the_process_group(tiny):
    import torch.distributed as dist

    from prime_train.config_load import ConfigError

    with pytest.raises(ConfigError, match="model.vocab_size >= 257"):
        train(tiny("--model.vocab_size", "100"))
    assert not dist.is_initialized()  # a later train() in this process can start afresh


def test_readme_library_example_as_written(tmp_path, cli_env):
    """The README's library example, run from a folder laid out like the repository."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    readme = (repo / "packages" / "prime-train" / "README.md").read_text()
    example = re.search(r"Used as a library.*?```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "configs").symlink_to(repo / "configs")
    r = subprocess.run(
        [sys.executable, "-c", example],
        cwd=tmp_path,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ratio = float(re.search(r"held-out loss ([0-9.]+)x step 0's", r.stdout).group(1))
    assert ratio < 1.0
    assert (tmp_path / "runs" / "lib" / "summary.json").is_file()
