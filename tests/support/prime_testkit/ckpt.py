"""prime-ckpt checkpoints made by hand, and donors serving them, for tests of what reads or
serves them; a small state to save, and a small disk for tests of saves that do not fit."""

from __future__ import annotations

import os
import select
import subprocess
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def small_state(value: float) -> dict:
    """A small checkpoint state: 64 Ki floats, a nested optimizer tensor and a plain int."""
    import torch

    return {"w": torch.full((1 << 16,), value), "opt": {"m": torch.full((7,), value)}, "n": 3}


@contextmanager
def small_disk_at(
    parent: Path, size: int, enospc_at: Iterable[int]
) -> Iterator[tuple[Path, dict[str, str]]]:
    """A new folder in `parent` and the environment its writers need: a tmpfs of `size` bytes
    (no environment) when we may mount one (root), else a plain folder and the prime-ckpt
    fault that injects ENOSPC at the saves `enospc_at`; unmounted on exit."""
    from prime_ckpt.faults import ENV

    d = parent / f"small-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(d)]
    mounted = os.geteuid() == 0 and subprocess.run(mount).returncode == 0
    try:
        yield d, ({} if mounted else {ENV: "enospc@" + ",".join(map(str, enospc_at))})
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)


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
