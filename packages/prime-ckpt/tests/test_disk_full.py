"""A full disk fails the background copy, keeps every older checkpoint, and the run goes on."""

import logging
import os
import threading
import warnings

import pytest
import torch

from prime_ckpt import CheckpointError, CheckpointFailure, CheckpointManager, CheckpointWarning
from prime_ckpt.manifest import verify_dir
from prime_testkit import small_disk_at


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 1 MiB tmpfs when we may mount one (root), else ENOSPC injected past the first save."""
    with small_disk_at(tmp_path, 1 << 20, enospc_at=(2, 3)) as (d, env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield d


def vec(n_kib: int, value: float) -> dict:
    return {"w": torch.full((n_kib * 256,), value), "step_value": value}


def test_disk_full_keeps_older_checkpoints(small_disk, tmp_path):
    disk = small_disk / "ckpt"
    with CheckpointManager(disk, shm_dir=tmp_path / "shm") as mgr:
        mgr.save(1, vec(300, 1.0)).wait(60)
        h2 = mgr.save(2, vec(800, 2.0))  # 300 KiB + 800 KiB does not fit in 1 MiB
        with pytest.raises(CheckpointError, match="No space left on device") as e:
            h2.wait(60)
        assert "older checkpoints are intact" in str(e.value)
        assert verify_dir(disk / "step-0000000001") == []
        assert not [p for p in disk.iterdir() if p.name.startswith(".tmp")], "space not freed"
        listed = [(c.step, c.tier, c.status) for c in mgr.list()]
        assert (2, "disk", "failed") in listed and (1, "disk", "ok") in listed
        assert (2, "ram", "ok") in listed  # the RAM copy of step 2 is still good
        # a failure not waited on is reported at the next save(), which still works
        mgr.save(3, vec(800, 3.0))
        with pytest.warns(CheckpointWarning, match="step 3 was not saved to disk"):
            mgr.save(4, vec(200, 4.0)).wait(60)
        assert [c.step for c in mgr.list() if c.tier == "disk" and c.status == "ok"] == [4, 1]
        mgr.wait(60)  # everything was reported already
    target = vec(200, 0.0)
    with CheckpointManager(disk, shm_dir=tmp_path / "fresh-shm") as mgr:
        assert mgr.load_latest(target) == 4
    assert target["step_value"] == 4.0


def test_background_failures_are_said_once_counted_and_handed_to_on_error(
    small_disk, tmp_path, caplog
):
    """Failed disk saves and uploads that fail after their retries: each is one ERROR line
    of the `prime_ckpt` logger (the retries are INFO), counted in `errors`, listed by
    `failures()` and handed to `on_error` on a background thread; the caller is told through
    the callback only (no warning at the next save, no error from wait())."""
    caplog.set_level(logging.INFO, logger="prime_ckpt")
    blocker = tmp_path / "a-file"
    blocker.write_text("the remote folder's parent is a file: no upload can succeed")
    told: list[tuple[CheckpointFailure, str]] = []

    def on_error(f: CheckpointFailure) -> None:
        told.append((f, threading.current_thread().name))

    kw = dict(remote=f"file://{blocker / 'remote'}", remote_retries=2, remote_backoff=0.01)
    with CheckpointManager(
        small_disk / "ckpt", shm_dir=tmp_path / "shm", on_error=on_error, **kw
    ) as mgr:
        mgr.save(1, vec(300, 1.0)).wait(60)  # on disk; its upload fails
        assert mgr.wait_remote(60)
        h2 = mgr.save(2, vec(800, 2.0))  # 300 KiB + 800 KiB does not fit in 1 MiB
        assert h2.join(60) and h2.error
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            mgr.save(3, vec(10, 3.0))  # the failure went to on_error: no warning here
        mgr.wait(60)  # nor an error here
        assert mgr.wait_remote(60)
        third = (3, "remote") if os.path.ismount(small_disk) else (3, "disk")  # enospc@2,3
        assert mgr.errors == 3
        got = [(f.step, f.tier) for f in mgr.failures()]
        assert got == [(1, "remote"), (2, "disk"), third]
        assert [(f.step, f.tier) for f, _ in told] == got
        assert all(thread != "MainThread" for _, thread in told)
        assert "Not a directory" in told[0][0].message or "exists" in told[0][0].message
        assert "No space left on device" in told[1][0].message
    lines = [r for r in caplog.records if r.name == "prime_ckpt" and r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in lines] == [f"prime-ckpt: {f.message}" for f, _ in told]
    assert {r.levelno for r in lines} == {logging.ERROR}
    # an upload's failure is told (its one ERROR line) at its first failed try; the other
    # tries and the final give-up are INFO
    said = {f"prime-ckpt: {f.message}" for f, _ in told}
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert retries and {r.levelno for r in retries if r.getMessage() not in said} == {logging.INFO}


def test_unwritable_disk_dir_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a folder")
    with pytest.raises(CheckpointError, match="cannot create checkpoint folder"):
        CheckpointManager(f / "ckpt", shm_dir=tmp_path / "shm")


def test_full_shm_fails_save_cleanly(small_disk, tmp_path):
    """A RAM tier too small for the state: save() raises a clear error, nothing is lost."""
    if not os.path.ismount(small_disk):
        pytest.skip("needs root to mount a small tmpfs as the RAM tier")
    with CheckpointManager(tmp_path / "disk", shm_dir=small_disk / "shm") as mgr:
        mgr.save(1, vec(100, 1.0)).wait(60)
        with pytest.raises(CheckpointError, match="staging step 2 .* failed: .*No space left"):
            mgr.save(2, vec(2000, 2.0))  # 2 MB into a 1 MiB /dev/shm
        # the one RAM slot was given to step 2 (step 1 was durable on disk first)
        assert [(c.step, c.tier) for c in mgr.list()] == [(1, "disk")]
        mgr.save(3, vec(100, 3.0)).wait(60)  # the run goes on
        target = vec(100, 0.0)
        assert mgr.load_latest(target) == 3 and target["step_value"] == 3.0
