"""The checkpoint manifest and on-disk layout shared by every tier and by peer transfer.

A committed checkpoint is a folder `step-<10 digits>` holding its data files and
`manifest.msgpack`. The manifest lists every file with its size and BLAKE3 hash (SHA-256 in
manifests of format 1, which still load; BLAKE3 hashes at ~4x its speed); a folder whose
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

import blake3
import msgpack

from prime_ckpt.errors import ManifestError

FORMAT_VERSION = 2  # 1: files hashed with SHA-256; 2: with BLAKE3
_READS = (1, 2)  # the formats this version loads
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
    """One data file of a checkpoint: its size in bytes and hex hash (`file_hasher`)."""

    size: int
    digest: str


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
                "files": {k: [v.size, v.digest] for k, v in sorted(self.files.items())},
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
            if d["format"] not in _READS:
                raise ManifestError(
                    f"manifest format {d['format']} is not supported (this prime-ckpt reads "
                    f"formats {', '.join(map(str, _READS))}); upgrade prime-ckpt"
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

    def hasher(self):
        """A new hasher of this manifest's files (`file_hasher` of its format)."""
        return file_hasher(self.format)

    def file_problem(self, name: str, path: Path) -> str | None:
        """Why the file at `path` is not this manifest's `name` (size or hash), or None."""
        entry = self.files[name]
        if not path.is_file():
            return f"{path}: missing"
        if (size := path.stat().st_size) != entry.size:
            return f"{path}: size {size}, manifest says {entry.size}"
        if file_digest(path, self.format) != entry.digest:
            return f"{path}: checksum mismatch (corrupted)"
        return None


def fsync_dir(path: str | Path) -> None:
    """Make a rename or new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_hasher(format: int = FORMAT_VERSION):  # noqa: A002 - the manifest's field
    """A new hasher (`update`, `copy`, `hexdigest`; releases the GIL) of a data file in a
    manifest of `format`: BLAKE3, or SHA-256 for format 1."""
    return hashlib.sha256() if format == 1 else blake3.blake3()


def file_digest(path: str | Path, format: int = FORMAT_VERSION) -> str:  # noqa: A002
    """Hex hash of a file (`file_hasher`), read in large chunks."""
    h = file_hasher(format)
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(_CHUNK))
        while n := f.readinto(buf):
            h.update(buf[:n])
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
    problems = (manifest.file_problem(name, step_dir / name) for name in manifest.files)
    return [p for p in problems if p]


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
