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
            ("6", "ram:r0", "yes"),  # the RAM tier holds one checkpoint by default
            ("5", "disk", "yes"),
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


def read_safetensors(path: Path) -> tuple[dict, dict]:
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    codes = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16, "BOOL": torch.bool}
    body = raw[8 + n :]
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        buf = torch.frombuffer(bytearray(body[a:b]), dtype=torch.uint8)
        out[name] = buf.view(codes[h["dtype"]]).reshape(h["shape"])
    assert max(h["data_offsets"][1] for h in header.values()) == len(body)
    return out, meta


def test_export_safetensors_and_torch_from_dir_and_url(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {
        "model": model.state_dict(),
        "extra": {"mask": torch.tensor([True, False]), "half": torch.ones(2, dtype=torch.bfloat16)},
        "pos": 12,
    }
    url = f"file://{tmp_path / 'bucket'}"
    with CheckpointManager(tmp_path / "run", shm_dir=tmp_path / "shm", remote=url) as mgr:
        mgr.save(7, state).wait(60)
        assert mgr.wait_remote(60)
    out = tmp_path / "w.safetensors"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert "exported step 7 (6 tensors)" in capsys.readouterr().out
    tensors, meta = read_safetensors(out)
    assert meta["prime_ckpt_step"] == "7"
    assert set(tensors) == {
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
        "extra.mask",
        "extra.half",
    }
    for k, v in model.state_dict().items():
        assert torch.equal(tensors[f"model.{k}"], v)
    assert torch.equal(tensors["extra.mask"], state["extra"]["mask"])

    pt = tmp_path / "w.pt"
    assert main(["export", url, "7", "--out", str(pt)]) == 0  # from the remote copy
    loaded = torch.load(pt, weights_only=True)
    assert loaded["pos"] == 12 and torch.equal(loaded["model"]["1.bias"], model[1].bias)

    capsys.readouterr()
    assert main(["ls", url]) == 0
    text = capsys.readouterr().out
    assert "remote" in text and "yes" in text and "step-0000000007" in text
    assert main(["verify", url]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "no" / "x.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
