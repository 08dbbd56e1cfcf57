"""`prime-ckpt ls` and `prime-ckpt verify`, and torn folders being ignored and cleaned."""

import shutil
import subprocess
from pathlib import Path

import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.cli import main


def test_ls_and_verify(tmp_path, capsys):
    disk = tmp_path / "run"
    mgr = CheckpointManager(disk)  # default shm_dir: /dev/shm, found again by the CLI
    try:
        for s in (5, 6):
            mgr.save(s, {"w": torch.ones(1000) * s}).wait(60)
        torn = disk / ".tmp-step-0000000007-0123456789abcdef"
        torn.mkdir()
        (torn / "rank-00000.bin").write_bytes(b"partial")
        (disk / "step-0000000008").mkdir()  # no manifest: never committed

        exe = shutil.which("prime-ckpt")
        assert exe, "console script prime-ckpt not installed"
        out = subprocess.run([exe, "ls", str(disk)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["step", "tier", "size", "verified", "path"]
        rows = [ln.split() for ln in lines[1:] if ln.strip()[:1].isdigit()]
        assert [(r[0], r[1], r[4]) for r in rows] == [
            ("6", "disk", "yes"),
            ("6", "ram:r0", "yes"),
            ("5", "disk", "yes"),
            ("5", "ram:r0", "yes"),
        ]
        assert "torn (ignored" in out.stdout and ".tmp-step-0000000007" in out.stdout

        f = disk / "step-0000000005" / "rank-00000.bin"
        raw = bytearray(f.read_bytes())
        raw[10] ^= 1
        f.write_bytes(bytes(raw))
        capsys.readouterr()
        assert main(["verify", str(disk)]) == 1
        text = capsys.readouterr().out
        assert "step 6: ok" in text and "step 5: CORRUPT" in text and "checksum mismatch" in text
        assert main(["ls", str(disk), "--quick"]) == 0
        assert main(["verify", str(disk), "6"]) == 0
        assert main(["verify", str(disk), "7"]) == 2
        assert "no committed step 7" in capsys.readouterr().err
    finally:
        mgr.close()
    assert not Path(mgr.shm_dir).exists()  # freed: everything durable on disk
    # a new manager (rank 0) cleans the torn folder of the dead process
    CheckpointManager(disk).close()
    assert not torn.exists()


def test_missing_dir_is_one_line_error(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prime-ckpt: error:") and "no such checkpoint folder" in err
    assert "Traceback" not in err
