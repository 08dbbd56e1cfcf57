"""`ram=`: where the RAM tier stages a checkpoint. "shm" (default) in /dev/shm, "disk" in a
folder on disk, "off" nowhere (save() writes straight into the disk tier)."""

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.faults import ENV
from prime_ckpt.manifest import verify_dir
from prime_ckpt.staging import default_shm_dir, disk_staging_dir
from prime_testkit import small_state


def staged_bins(folder) -> list:
    return sorted(folder.rglob("*.bin")) if folder.exists() else []


def test_disk_stages_in_a_folder_of_the_disk_dir_not_in_ram(tmp_path):
    disk = tmp_path / "ckpt"
    with CheckpointManager(disk, ram="disk") as mgr:
        assert mgr.shm_dir == disk_staging_dir(disk, 0) == disk / ".staging-r0"
        mgr.save(1, small_state(1.0)).wait(60)
        mgr.save(2, small_state(2.0)).wait(60)
        assert len(staged_bins(mgr.shm_dir)) == 1  # one slot, reused
        assert not default_shm_dir(disk, 0).exists()  # nothing in /dev/shm
        ram = [c for c in mgr.list() if c.tier == "ram"]
        assert [(c.step, c.path) for c in ram] == [(2, str(disk / ".staging-r0" / "slot-0"))]
        assert mgr.committed_steps(["disk"]) == [1, 2]  # the staging folder is never a step
        target = small_state(0.0)
        assert mgr.load_latest(target) == 2 and target["w"][0] == 2.0
    assert not (disk / ".staging-r0").exists()  # freed at close: everything is on disk


def test_off_writes_straight_to_disk_with_no_staging_copy(tmp_path):
    disk = tmp_path / "ckpt"
    with CheckpointManager(disk, ram="off") as mgr:
        assert mgr.shm_dir is None
        s = small_state(1.0)
        h = mgr.save(1, s)
        s["w"].fill_(99.0)  # training goes on at once: the checkpoint already has its copy
        h.wait(60)
        assert verify_dir(disk / "step-0000000001") == []
        assert not default_shm_dir(disk, 0).exists() and not disk_staging_dir(disk, 0).exists()
        assert [c.tier for c in mgr.list()] == ["disk"]
        mgr.save(2, small_state(2.0)).wait(60)  # no RAM copy: loadable once on disk
        target = small_state(0.0)
        assert mgr.load_latest(target) == 2 and target["w"][0] == 2.0 and target["n"] == 3
        assert mgr.load(1, target) == 1 and target["w"].eq(1.0).all()
    assert [p.name for p in disk.iterdir()] == ["step-0000000001", "step-0000000002"]


def test_switching_away_from_shm_frees_the_ram_folder(tmp_path):
    disk = tmp_path / "ckpt"
    shm = default_shm_dir(disk, 0)
    # a process SIGKILLed once step 1 is on disk: its RAM folder stays behind
    code = (
        "import torch; from prime_ckpt import CheckpointManager\n"
        f"CheckpointManager({str(disk)!r}).save(1, {{'w': torch.ones(1 << 16)}}).wait(60)"
    )
    env = {**os.environ, ENV: "after_rename@1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    try:
        assert r.returncode == -signal.SIGKILL and staged_bins(shm)
        with CheckpointManager(disk, ram="off") as mgr:
            assert not shm.exists()  # it held nothing newer than the disk
            target = {"w": torch.zeros(1 << 16)}
            assert mgr.load_latest(target) == 1 and target["w"][0] == 1.0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_bad_ram_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="ram must be 'shm'.*'disk'.*'off'.*got 'tmpfs'"):
        CheckpointManager(tmp_path / "a", ram="tmpfs")
    with pytest.raises(ValueError, match="shm_dir=.*has no use with ram='off'"):
        CheckpointManager(tmp_path / "b", ram="off", shm_dir=tmp_path / "shm")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_off_on_a_full_disk_fails_the_save_without_raising(tmp_path):
    d = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)]
    if subprocess.run(mount).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with CheckpointManager(d / "ckpt", ram="off", on_error=lambda f: None) as mgr:
            mgr.save(1, {"w": torch.ones(300 * 256)}).wait(60)
            h = mgr.save(2, {"w": torch.ones(800 * 256)})  # does not fit beside step 1
            assert h.done() and "No space left on device" in h.error
            assert "older checkpoints are intact" in h.error and mgr.errors == 1
            assert mgr.committed_steps() == [1]
            assert not [p for p in (d / "ckpt").iterdir() if p.name.startswith(".tmp")]
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
