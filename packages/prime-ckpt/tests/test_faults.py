"""SIGKILL during a save never loses the previous checkpoint; torn leftovers are cleaned."""

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.faults import POINTS
from prime_ckpt.manifest import verify_dir

DRIVER = Path(__file__).with_name("fault_driver.py")
# where the newest loadable step is after a kill while saving step 2:
# (with the RAM copy of the same machine, from disk alone)
EXPECTED = {
    "stage": (1, 1),
    "ram_commit": (1, 1),
    "disk_write": (1, 1),
    "before_manifest": (2, 1),
    "before_rename": (2, 1),
    "after_rename": (2, 2),
    "prune": (2, 2),
}


def restore(disk: Path, shm: Path) -> int | None:
    target = {"w": torch.zeros(64, 1024), "b": torch.zeros(1000, dtype=torch.int64), "step": -1}
    with CheckpointManager(disk, shm_dir=shm) as mgr:
        step = mgr.load_latest(target)
        leftovers = [p.name for p in disk.iterdir() if p.name.startswith(".")]
        assert leftovers == [], f"torn leftovers not cleaned: {leftovers}"
    if step is not None:
        assert target["step"] == step
        assert torch.equal(target["w"], torch.full((64, 1024), float(step)))
        assert torch.equal(target["b"], torch.arange(1000) * step)
    for d in disk.glob("step-*"):
        assert verify_dir(d) == [], d
    return step


def run_driver(children, root: Path, points: list[str], kills: int) -> dict:
    p = children.python(
        [str(DRIVER), str(root), ",".join(points), str(kills)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    return {(r := json.loads(line))["case"]: r for line in out.splitlines() if line.startswith("{")}


def test_sigkill_at_every_fault_point_and_random_times(children, tmp_path):
    assert set(EXPECTED) == set(POINTS)
    results = run_driver(children, tmp_path, list(POINTS), kills=2)
    for point, (with_ram, disk_only) in EXPECTED.items():
        assert results[point]["signal"] == signal.SIGKILL, f"{point}: the fault point was not hit"
        root = tmp_path / point
        assert restore(root / "disk", tmp_path / f"empty-shm-{point}") == disk_only, point
        assert restore(root / "disk", root / "shm") == with_ram, point
    for i in range(2):
        root = tmp_path / f"random{i}"
        assert results[f"random{i}"]["signal"] == signal.SIGKILL
        step = restore(root / "disk", root / "shm")
        disk_step = restore(root / "disk", tmp_path / f"empty-shm-r{i}")
        assert step is not None and step >= (disk_step or 0)


@pytest.mark.parametrize("what", ["rank-00000.bin", "rank-00000.meta", "manifest.msgpack"])
def test_flipped_byte_skipped_by_load_latest_and_refused_by_load(tmp_path, what):
    disk = tmp_path / "disk"
    with CheckpointManager(disk, shm_dir=tmp_path / "shm") as mgr:
        for s in (1, 2):
            mgr.save(s, {"w": torch.full((100,), float(s)), "step": s}).wait(60)
    f = disk / "step-0000000002" / what
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    target = {"w": torch.zeros(100), "step": 0}
    with CheckpointManager(disk, shm_dir=tmp_path / "shm2") as mgr:
        with pytest.warns(UserWarning, match="skipping disk copy of step 2"):
            assert mgr.load_latest(target) == 1
        assert target["step"] == 1 and torch.equal(target["w"], torch.ones(100))
        with (
            pytest.raises(Exception, match="no copy of step 2 verifies") as e,
            pytest.warns(UserWarning),
        ):
            mgr.load(2, target)
        assert "corrupt" in str(e.value) or "mismatch" in str(e.value)
        assert target["step"] == 1
    # the CLI agrees
    from prime_ckpt.cli import main

    assert main(["verify", str(disk), "1"]) == 0
    assert main(["verify", str(disk)]) == 1
