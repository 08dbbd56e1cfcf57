"""prime-ckpt checkpoints made by hand, for tests of what reads or serves them."""

from __future__ import annotations

from pathlib import Path


def make_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> str:
    """A committed step folder in `root`, written directly: `files` (name -> bytes; a name may
    hold a subfolder) plus their manifest, written aside and renamed into place as a committed
    step is; returns the manifest's digest."""
    from prime_ckpt.manifest import FileEntry, Manifest, sha256_file, step_dirname

    tmp = root / f"{step_dirname(step)}.tmp"
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    m = Manifest(
        step=step, files={n: FileEntry(len(b), sha256_file(tmp / n)) for n, b in files.items()}
    )
    (tmp / "manifest.msgpack").write_bytes(m.to_bytes())
    tmp.rename(root / step_dirname(step))
    return m.digest()
