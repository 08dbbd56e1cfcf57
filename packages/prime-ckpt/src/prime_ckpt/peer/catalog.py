"""What a donor offers: the newest committed step that verifies, and safe paths inside it.

Verification hashes every file, so its result is cached per step under a key made of the
manifest digest and every file's (size, mtime, inode): a step is re-hashed only when one of
its files changed. Folders not named exactly `step-<10 digits>` (temporary or torn writes)
are never looked at.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prime_ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    parse_step_dirname,
    step_dirname,
    verify_dir,
    write_lease,
)


class Gone(Exception):
    """The pinned step or digest is no longer on this donor (answered with 410)."""


class Refused(Exception):
    """A path outside the checkpoint or not in its manifest (answered with 403/404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Offer:
    step: int
    digest: str
    manifest_bytes: bytes


def safe_relpath(name: str) -> bool:
    """A manifest entry that stays inside its step folder: relative, no '..', no empties."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


class Catalog:
    """Reads the checkpoint root of a donor; thread-safe."""

    def __init__(self, root: str | Path, lease_s: float = 120.0) -> None:
        self.root = Path(root)
        self.lease_s = min(float(lease_s), 600.0)
        self._lock = threading.Lock()
        self._verified: dict[int, tuple] = {}  # step -> key that verified
        self._manifests: dict[
            int, tuple[tuple, bytes, str]
        ] = {}  # step -> (stat key, bytes, digest)
        self._leased: dict[int, float] = {}  # step -> monotonic time of the last lease write

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = [s for s in map(parse_step_dirname, names) if s is not None]
        return sorted(steps, reverse=True)

    def manifest(self, step: int) -> tuple[bytes, str]:
        """Manifest bytes and digest of `step`; Gone if the folder or manifest is missing."""
        p = self.root / step_dirname(step) / MANIFEST_NAME
        try:
            st = p.stat()
        except FileNotFoundError:
            raise Gone(
                f"step {step} is no longer on this donor (pruned or never committed)"
            ) from None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._manifests.get(step)
        if cached and cached[0] == key:
            return cached[1], cached[2]
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise Gone(f"step {step} is no longer on this donor (pruned)") from None
        digest = hashlib.sha256(data).hexdigest()
        self._manifests[step] = (key, data, digest)
        return data, digest

    def _verify_key(self, step_dir: Path, manifest: Manifest, digest: str) -> tuple | None:
        stats = []
        for name in sorted(manifest.files):
            if not safe_relpath(name):
                return None
            try:
                st = (step_dir / name).stat()
            except OSError:
                return None
            stats.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
        return (digest, tuple(stats))

    def newest(self) -> Offer | None:
        """The newest committed step whose files verify, or None if there is none."""
        with self._lock:  # one hashing pass at a time, however many fetchers ask
            for step in self._steps():
                step_dir = self.root / step_dirname(step)
                try:
                    data, digest = self.manifest(step)
                    manifest = Manifest.from_bytes(data)
                except (Gone, ManifestError):
                    continue
                if manifest.step != step:
                    continue
                key = self._verify_key(step_dir, manifest, digest)
                if key is None:
                    continue
                if self._verified.get(step) != key:
                    if verify_dir(step_dir, manifest):
                        continue
                    self._verified[step] = key
                return Offer(step, digest, data)
        return None

    def resolve(self, step: int, digest: str, name: str) -> tuple[Path, int]:
        """The path and size of file `name` of the pinned (step, digest)."""
        data, have = self.manifest(step)
        if have != digest:
            raise Gone(
                f"step {step} on this donor now has manifest digest {have[:16]}..., not the "
                f"pinned {digest[:16]}...; start a new transfer"
            )
        manifest = Manifest.from_bytes(data)
        entry = manifest.files.get(name)
        if entry is None or not safe_relpath(name):
            raise Refused(404, f"{name!r} is not a file of checkpoint step {step}")
        step_dir = (self.root / step_dirname(step)).resolve()
        path = (step_dir / name).resolve()
        if not path.is_relative_to(step_dir):  # a symlink pointing out of the checkpoint
            raise Refused(403, f"{name!r} resolves outside the checkpoint folder; refused")
        if not path.is_file():
            raise Gone(f"{name!r} of step {step} is no longer on this donor (pruned)")
        return path, entry.size

    def hold(self, step: int) -> None:
        """Write or renew the lease on `step`; at most every quarter lease to spare the disk."""
        now = time.monotonic()
        last = self._leased.get(step)
        if last is not None and now - last < self.lease_s / 4:
            return
        self._leased[step] = now
        try:
            write_lease(self.root, step, self.lease_s)
        except OSError:  # a read-only donor cannot lease; it still serves
            pass
