import pytest

from prime_ckpt.errors import ManifestError
from prime_ckpt.manifest import (
    FileEntry,
    Manifest,
    is_leased,
    parse_step_dirname,
    sha256_file,
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
    m = Manifest(step=3, files={"a.bin": FileEntry(1000, sha256_file(d / "a.bin"))})
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
