"""The package example: a plain PyTorch loop with prime-ckpt, killed and resumed."""

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_loop.py"


def test_example_resumes_after_sigkill_to_the_same_weights(tmp_path, capsys):
    run = str(tmp_path / "run")
    cmd = [sys.executable, str(EXAMPLE), "--ckpt-dir", run, "--every", "4", "--steps", "30"]
    first = subprocess.run([*cmd, "--kill-at", "18"], capture_output=True, text=True, timeout=180)
    assert first.returncode == -signal.SIGKILL, first.stderr

    spec = importlib.util.spec_from_file_location("train_loop", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    resumed = mod.train(30, run, every=4)  # restart after the crash
    out = capsys.readouterr().out
    assert "resumed from step 16" in out or "resumed from step 12" in out, out
    reference = mod.train(30, None)  # the same loop without checkpoints, never interrupted
    got, want = resumed.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for name in want:  # bit-identical, not merely close
        assert torch.equal(got[name], want[name]), f"{name} differs after the resume"
