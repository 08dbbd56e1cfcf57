import hashlib

import blake3
import pytest
import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.errors import CheckpointError, ManifestError
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    file_digest,
    is_leased,
    parse_step_dirname,
    read_manifest,
    step_dirname,
    verify_dir,
    write_lease,
)


def test_step_names_round_trip():
    assert parse_step_dirname(step_dirname(42)) == 42
    assert parse_step_dirname("step-0000000042.tmp-abc") is None
    with pytest.raises(ValueError):
        step_dirname(-1)


def test_manifest_detects_flipped_byte(tmp_path):
    d = tmp_path / step_dirname(3)
    d.mkdir()
    (d / "a.bin").write_bytes(b"x" * 1000)
    m = Manifest(step=3, files={"a.bin": FileEntry(1000, file_digest(d / "a.bin"))})
    (d / "manifest.msgpack").write_bytes(m.to_bytes())
    assert verify_dir(d) == []
    assert Manifest.from_bytes(m.to_bytes()).digest() == m.digest()
    raw = bytearray((d / "a.bin").read_bytes())
    raw[500] ^= 1
    (d / "a.bin").write_bytes(bytes(raw))
    assert "checksum mismatch" in verify_dir(d)[0]
    with pytest.raises(ManifestError):
        Manifest.from_bytes(b"\x00garbage")


def test_lease(tmp_path):
    assert not is_leased(tmp_path, 5)
    write_lease(tmp_path, 5, 30)
    assert is_leased(tmp_path, 5)
    write_lease(tmp_path, 5, -1)
    assert not is_leased(tmp_path, 5)


def _saved(root, value: float) -> dict:
    """A checkpoint of step 5 saved under `root` on disk only; the state it holds."""
    state = {"w": torch.full((1000,), value), "step": 5}
    ckpt = CheckpointManager(root / "ckpt", ram="off")
    ckpt.save(5, state)
    ckpt.close()
    return state


def test_files_are_hashed_with_blake3_and_format_1_checkpoints_still_load(tmp_path):
    _saved(tmp_path, 1.5)
    step_dir = tmp_path / "ckpt" / step_dirname(5)
    m = read_manifest(step_dir)
    assert m.format == 2 and m.files
    for name, entry in m.files.items():
        assert entry.digest == blake3.blake3((step_dir / name).read_bytes()).hexdigest()

    # the same checkpoint as format 1 wrote it (SHA-256 of each file) loads and verifies
    old = {n: FileEntry(e.size, hashlib.sha256((step_dir / n).read_bytes()).hexdigest())
           for n, e in m.files.items()}  # fmt: skip
    v1 = Manifest(m.step, old, m.world_size, m.extra, m.user, format=1)
    (step_dir / MANIFEST_NAME).write_bytes(v1.to_bytes())
    assert verify_dir(step_dir) == []
    state = {"w": torch.zeros(1000), "step": 0}
    assert CheckpointManager(tmp_path / "ckpt", ram="off").load_latest(state) == 5
    assert torch.equal(state["w"], torch.full((1000,), 1.5))

    # a format-1 file whose bytes changed is caught as it is with BLAKE3
    data = next(n for n in m.files if n.endswith(".bin"))
    raw = bytearray((step_dir / data).read_bytes())
    raw[-1] ^= 1
    (step_dir / data).write_bytes(bytes(raw))
    assert "checksum mismatch" in verify_dir(step_dir)[0]
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        CheckpointManager(tmp_path / "ckpt", ram="off").load(5, state)


def test_a_manifest_of_an_unknown_format_is_refused_with_the_formats_read(tmp_path):
    m = Manifest(step=1, files={}, format=3)
    with pytest.raises(ManifestError, match="format 3 is not supported .*formats 1, 2"):
        Manifest.from_bytes(m.to_bytes())
