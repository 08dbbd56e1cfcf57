"""The checkpoint manifest and on-disk layout shared by every tier and by peer transfer.

A committed checkpoint is a folder `step-<10 digits>` holding its data files and
`manifest.msgpack`. The manifest lists every file with its size and SHA-256; a folder whose
manifest is missing, unreadable, or disagrees with a file is torn or corrupt and is never
loaded. On a filesystem the folder is written under a temporary name and renamed; on an object
store the manifest is uploaded last, so its presence marks the commit.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from prime_ckpt.errors import ManifestError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.msgpack"
LEASE_DIR = ".leases"
_STEP_RE = re.compile(r"^step-(\d{10})$")
_CHUNK = 8 << 20
_TRAILER = b"PCK1"


def step_dirname(step: int) -> str:
    """Folder (or object prefix) name of a committed step."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a committed folder name, or None for anything else (temp folders included)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint: its size in bytes and hex SHA-256."""

    size: int
    sha256: str


@dataclass
class Manifest:
    """What a committed checkpoint holds. `extra` is free-form msgpack data for the writer
    (tensor metadata, shard layout); `user` is the caller's metadata."""

    step: int
    files: dict[str, FileEntry]
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    user: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        """msgpack body followed by a SHA-256 trailer, so a flipped byte anywhere is caught."""
        body = msgpack.packb(
            {
                "format": self.format,
                "step": self.step,
                "world_size": self.world_size,
                "created": self.created,
                "files": {k: [v.size, v.sha256] for k, v in sorted(self.files.items())},
                "extra": self.extra,
                "user": self.user,
            },
            use_bin_type=True,
        )
        return body + _TRAILER + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        body, tag, check = data[:-36], data[-36:-32], data[-32:]
        if len(data) < 36 or tag != _TRAILER or hashlib.sha256(body).digest() != check:
            raise ManifestError("manifest checksum mismatch (corrupted or truncated manifest)")
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=False)
            if d["format"] != FORMAT_VERSION:
                raise ManifestError(
                    f"manifest format {d['format']} is not supported (this prime-ckpt reads "
                    f"format {FORMAT_VERSION}); upgrade prime-ckpt"
                )
            files = {k: FileEntry(int(v[0]), str(v[1])) for k, v in d["files"].items()}
            return cls(
                step=int(d["step"]),
                files=files,
                world_size=int(d["world_size"]),
                extra=d.get("extra") or {},
                user=d.get("user") or {},
                created=float(d["created"]),
                format=int(d["format"]),
            )
        except ManifestError:
            raise
        except Exception as e:  # msgpack errors, missing keys, wrong types
            raise ManifestError(f"unreadable manifest: {e}") from e

    def digest(self) -> str:
        """SHA-256 of the manifest bytes: pins one exact checkpoint (used by peer transfer)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Make a rename or new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in large chunks (hashlib releases the GIL)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(step_dir: str | Path) -> Manifest:
    """Read `step_dir/manifest.msgpack`; ManifestError if missing or unreadable."""
    p = Path(step_dir) / MANIFEST_NAME
    try:
        data = p.read_bytes()
    except FileNotFoundError as e:
        raise ManifestError(f"{p}: no manifest (torn or uncommitted checkpoint)") from e
    return Manifest.from_bytes(data)


def verify_dir(step_dir: str | Path, manifest: Manifest | None = None) -> list[str]:
    """Check every file against the manifest; returns the problems found (empty = verified)."""
    step_dir = Path(step_dir)
    try:
        manifest = manifest or read_manifest(step_dir)
    except ManifestError as e:
        return [str(e)]
    problems = []
    for name, entry in manifest.files.items():
        p = step_dir / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != entry.size:
            problems.append(f"{p}: size {p.stat().st_size}, manifest says {entry.size}")
        elif sha256_file(p) != entry.sha256:
            problems.append(f"{p}: checksum mismatch (corrupted)")
    return problems


def lease_path(root: str | Path, step: int) -> Path:
    """A lease file keeps a step from being pruned while a peer downloads it."""
    return Path(root) / LEASE_DIR / f"{step_dirname(step)}.lease"


def write_lease(root: str | Path, step: int, seconds: float) -> None:
    """Hold `step` under `root` for `seconds` (at most 600) from now; renewing extends it."""
    p = lease_path(root, step)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{time.monotonic_ns()}")
    tmp.write_text(repr(time.time() + min(seconds, 600.0)))
    tmp.replace(p)


def release_lease(root: str | Path, step: int) -> None:
    """Drop the lease on `step` (the pruner may take it again); nothing if there is none."""
    lease_path(root, step).unlink(missing_ok=True)


def is_leased(root: str | Path, step: int) -> bool:
    """True while an unexpired lease holds `step` under `root`."""
    try:
        return float(lease_path(root, step).read_text()) > time.time()
    except (FileNotFoundError, ValueError):
        return False


def data_name(rank: int) -> str:
    """Raw tensor bytes of one rank's shard."""
    return f"rank-{rank:05d}.bin"


def meta_name(rank: int) -> str:
    """msgpack skeleton and tensor table of one rank's shard."""
    return f"rank-{rank:05d}.meta"


def committed_steps(root: str | Path) -> list[int]:
    """Steps committed on disk under `root` (a CheckpointManager's disk_dir), oldest first:
    folders named step-<10 digits> that hold a manifest. Not verified (loading verifies);
    a missing folder has none. `CheckpointManager.committed_steps()` adds RAM and remote."""
    try:
        names = [p.name for p in Path(root).iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = [s for n in names if (s := parse_step_dirname(n)) is not None]
    return sorted(s for s in steps if (Path(root) / step_dirname(s) / MANIFEST_NAME).is_file())
