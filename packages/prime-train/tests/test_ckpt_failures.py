"""A checkpoint that cannot be written does not stop training: through the CLI, a disk that
fills up and a remote that cannot be written to. The run finishes, says each failure in one
line of its log, and counts them in its metrics rows (`ckpt_errors`)."""

import json
from contextlib import ExitStack

import pytest
import torch

from prime_testkit import small_disk_at
from prime_train.config_load import load_config
from prime_train.hf_import import run_model_args
from prime_train.model import Transformer, num_params
from prime_train.tokens import make_tokenizer

EVERY, STEPS = 10, 50
DISK_FAILS = [20, 30, 40, 50]  # step 10 fills the disk: every later one fails


def checkpoint_bytes(args: list[str]) -> int:
    """About one checkpoint of the run: fp32 weights and AdamW's two moments."""
    cfg = load_config(args[1], args[2:], env={})
    with torch.device("meta"):
        model = Transformer(run_model_args(cfg, make_tokenizer(cfg.data.tokenizer).vocab_size))
    return 3 * 4 * num_params(model)


@pytest.fixture
def small_disk(tmp_path):
    """`small_disk(size)`: a tmpfs of `size` bytes when we may mount one (root), else a
    folder and the environment that injects ENOSPC at the steps that would not fit."""
    with ExitStack() as disks:
        yield lambda size: disks.enter_context(small_disk_at(tmp_path, size, DISK_FAILS))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failed_saves_and_uploads_are_one_line_each_and_counted(
    tmp_path, small_disk, run_cli, tiny_cli_args
):
    blocker = tmp_path / "a-file"
    blocker.write_text("the remote folder's parent is a file: no upload can succeed")
    args = tiny_cli_args(tmp_path / "runs", "--train.steps", str(STEPS), "--ckpt.every", str(EVERY))
    disk, env = small_disk(checkpoint_bytes(args) * 3 // 2)  # one checkpoint fits, not two
    r = run_cli(
        *args,
        "--ckpt.dir", str(disk / "ckpt"),
        "--ckpt.shm_dir", str(tmp_path / "shm"),
        "--ckpt.remote", f"file://{blocker / 'remote'}",
        env=env,
        timeout=500,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert f"done: {STEPS}/{STEPS} steps" in r.stdout
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    for step in DISK_FAILS:  # one line per failed save, in the node's own log format
        said = [e for e in errors if f"checkpoint step {step} was not saved to disk" in e]
        assert len(said) == 1, errors
        assert said[0].startswith("[node 0 rank 0] error: ") and "No space left" in said[0]
    uploads = [e for e in errors if "upload of step 10 to file://" in e]
    # said and counted at its first failure (the run may end before the retries do)
    assert len(uploads) == 1 and "older remote copies are kept; retrying" in uploads[0], errors
    assert len(errors) == len(DISK_FAILS) + 1, errors

    rows = [json.loads(line) for line in (tmp_path / "runs/debug/metrics.jsonl").open()]
    progress = [row for row in rows if "loss" in row]
    assert all("ckpt_errors" in row for row in progress)
    # save(30) waits for save(20), so every row after step 30 counts step 20's failure
    assert all(row["ckpt_errors"] >= 1 for row in progress if row["step"] > 30), progress
    assert progress[-1]["ckpt_errors"] >= 2  # 20 and 30, written before save(50) waits for 40
    assert [p.name for p in (disk / "ckpt").iterdir()] == ["step-0000000010"]
