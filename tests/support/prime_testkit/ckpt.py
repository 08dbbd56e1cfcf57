"""prime-ckpt checkpoints made by hand, and donors serving them, for tests of what reads or
serves them."""

from __future__ import annotations

import os
import select
import subprocess
from pathlib import Path
from typing import Any


def make_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> str:
    """A committed step folder in `root`, written directly: `files` (name -> bytes; a name may
    hold a subfolder) plus their manifest, written aside and renamed into place as a committed
    step is; returns the manifest's digest."""
    from prime_ckpt.manifest import FileEntry, Manifest, file_digest, step_dirname

    tmp = root / f"{step_dirname(step)}.tmp"
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    m = Manifest(
        step=step, files={n: FileEntry(len(b), file_digest(tmp / n)) for n, b in files.items()}
    )
    (tmp / "manifest.msgpack").write_bytes(m.to_bytes())
    tmp.rename(root / step_dirname(step))
    return m.digest()


def donor_processes(
    children: Any, token: str, *donors: tuple[Path, float]
) -> list[tuple[subprocess.Popen, str]]:
    """Rate-limited donors (folder, MB/s), each `python -m prime_ckpt.peer serve` in its own
    process (`children`), started together with `token`; returns each process with its URL
    (bounded wait)."""
    env = dict(os.environ, PRIME_TOKEN=token)
    procs = [
        children.python(
            ["-m", "prime_ckpt.peer", "serve", str(root), "--max-mb-per-s", str(rate)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for root, rate in donors
    ]
    out = []
    for p in procs:
        ready, _, _ = select.select([p.stdout], [], [], 30)
        assert ready, "donor process did not print its URL within 30 s"
        url = p.stdout.readline().decode().strip()
        assert url.startswith("http://127.0.0.1:"), url
        out.append((p, url))
    return out
