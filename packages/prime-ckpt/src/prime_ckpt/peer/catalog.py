"""What a donor offers: the newest committed step that verifies, and safe paths inside it.

Verification hashes every file, so it runs on one background thread and its result (good or
bad) is cached per step under a key made of the manifest digest and every file's (size, mtime,
inode): a step is re-hashed only when one of its files changed. An index request waits for it
at most a budget of seconds; meanwhile an older verified step is offered, or, when there is
none, `PeerBusy` (HTTP 503, the fetcher retries). Folders not named exactly `step-<10 digits>`
(temporary or torn writes) are never looked at.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prime_ckpt.errors import ManifestError, PeerBusy, PeerGone, PeerRefused
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    parse_step_dirname,
    release_lease,
    step_dirname,
    write_lease,
)

log = logging.getLogger("prime_ckpt.peer")
_HASH_CHUNK = 8 << 20
ACTIVE_S = 30.0  # a step whose file was served this recently has a transfer going on


@dataclass(frozen=True)
class Offer:
    """A checkpoint a donor offers: its step, the manifest (bytes and parsed) and the
    manifest's digest; `url` names the donor on the fetcher's side ("" on the donor)."""

    step: int
    digest: str
    manifest_bytes: bytes
    manifest: Manifest
    url: str = ""


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
        self._results: dict[int, tuple[tuple, bool]] = {}  # step -> (key, files verified)
        self._jobs: dict[int, tuple[tuple, Future]] = {}  # step -> (key, verification)
        self._manifests: dict[int, tuple[tuple, bytes, str]] = {}  # step -> (stat, bytes, digest)
        self._leased: dict[int, float] = {}  # step -> monotonic time of the last lease write
        self._served: dict[int, float] = {}  # step -> when a file of it was last being served
        self._serving: dict[int, int] = {}  # step -> files of it being served now
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prime-ckpt-peer-verify")

    def close(self) -> None:
        """Stop verifying (a hash in progress stops at its next chunk)."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = [s for s in map(parse_step_dirname, names) if s is not None]
        return sorted(steps, reverse=True)

    def manifest(self, step: int) -> tuple[bytes, str]:
        """Manifest bytes and digest of `step`; PeerGone if the folder or manifest is missing."""
        p = self.root / step_dirname(step) / MANIFEST_NAME
        try:
            st = p.stat()
        except FileNotFoundError:
            raise PeerGone(
                f"step {step} is no longer on this donor (pruned or never committed)"
            ) from None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._manifests.get(step)
        if cached and cached[0] == key:
            return cached[1], cached[2]
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise PeerGone(f"step {step} is no longer on this donor (pruned)") from None
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

    def newest(self, budget_s: float = 5.0) -> Offer | None:
        """The newest committed step whose files verify, waiting at most `budget_s` for a
        verification; None if there is no candidate, PeerBusy if one is still being verified."""
        deadline = time.monotonic() + budget_s
        pending = None
        for step in self._steps():
            step_dir = self.root / step_dirname(step)
            try:
                data, digest = self.manifest(step)
                manifest = Manifest.from_bytes(data)
            except (PeerGone, ManifestError):
                continue
            if manifest.step != step:
                continue
            key = self._verify_key(step_dir, manifest, digest)
            if key is None:
                continue
            # Only the newest unknown step is hashed; older ones are offered if already known.
            ok = self._verified(step, key, manifest, deadline, start=pending is None)
            if ok:
                return Offer(step, digest, data, manifest)
            if ok is None and pending is None:
                pending = step
        if pending is not None:
            raise PeerBusy(f"step {pending} is still being verified on this donor; retry shortly")
        return None

    def _verified(
        self, step: int, key: tuple, manifest: Manifest, deadline: float, start: bool
    ) -> bool | None:
        with self._lock:
            known = self._results.get(step)
            if known and known[0] == key:
                return known[1]
            job = self._jobs.get(step)
            if job is None or job[0] != key:
                if not start or self._closing.is_set():
                    return None
                try:
                    job = (key, self._pool.submit(self._verify, step, key, manifest))
                except RuntimeError:  # closing: the pool takes no more work
                    return None
                self._jobs[step] = job
        try:
            return job[1].result(timeout=max(0.0, deadline - time.monotonic()))
        except (FutureTimeout, CancelledError):  # still running, or cancelled by close()
            return None

    def _verify(self, step: int, key: tuple, manifest: Manifest) -> bool | None:
        problem = self._hash_problem(self.root / step_dirname(step), manifest)
        if problem == "closing":
            return None
        if problem:
            log.warning("not offering step %d: %s", step, problem)
        with self._lock:
            self._results[step] = (key, problem is None)
            self._jobs.pop(step, None)
        return problem is None

    def _hash_problem(self, step_dir: Path, manifest: Manifest) -> str | None:
        """What is wrong with the files of `step_dir` (None: all match the manifest)."""
        for name, entry in manifest.files.items():
            h = manifest.hasher()
            try:
                with open(step_dir / name, "rb") as f:
                    while chunk := f.read(_HASH_CHUNK):
                        if self._closing.is_set():
                            return "closing"
                        h.update(chunk)
            except OSError as e:
                return f"{name}: {e}"
            if h.hexdigest() != entry.digest:
                return f"{name}: checksum mismatch (corrupted)"
        return None

    def resolve(self, step: int, digest: str, name: str) -> tuple[Path, int]:
        """The path and size of file `name` of the pinned (step, digest)."""
        data, have = self.manifest(step)
        if have != digest:
            raise PeerGone(
                f"step {step} on this donor now has manifest digest {have[:16]}..., not the "
                f"pinned {digest[:16]}...; start a new transfer"
            )
        manifest = Manifest.from_bytes(data)
        entry = manifest.files.get(name)
        if entry is None or not safe_relpath(name):
            raise PeerRefused(404, f"{name!r} is not a file of checkpoint step {step}")
        step_dir = (self.root / step_dirname(step)).resolve()
        path = (step_dir / name).resolve()
        if not path.is_relative_to(step_dir):  # a symlink pointing out of the checkpoint
            raise PeerRefused(403, f"{name!r} resolves outside the checkpoint folder; refused")
        if not path.is_file():
            raise PeerGone(f"{name!r} of step {step} is no longer on this donor (pruned)")
        return path, entry.size

    def hold(self, step: int) -> None:
        """Write or renew the lease on `step`; at most every quarter lease to spare the disk.
        Leasing a newer step drops this donor's leases on older ones that no transfer uses
        (an index asked, nothing fetched: a joiner polling for a fresh checkpoint), so that
        polling pins one checkpoint, not every one made while it polled."""
        now = time.monotonic()
        with self._lock:
            idle = [s for s in self._leased if s < step and not self._busy(s, now)]
            for s in idle:
                del self._leased[s]
            last = self._leased.get(step)
            if last is not None and now - last < self.lease_s / 4:
                last = -1.0
            else:
                self._leased[step] = now
        for s in idle:
            try:
                release_lease(self.root, s)
            except OSError:
                pass
        if last == -1.0:
            return
        try:
            write_lease(self.root, step, self.lease_s)
        except OSError:  # a read-only donor cannot lease; it still serves
            pass

    def _busy(self, step: int, now: float) -> bool:
        return self._serving.get(step, 0) > 0 or now - self._served.get(step, -1e9) < ACTIVE_S

    @contextmanager
    def serving(self, step: int) -> Iterator[None]:
        """A file of `step` is being served: its lease is not dropped meanwhile."""
        with self._lock:
            self._serving[step] = self._serving.get(step, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._serving[step] -= 1
                self._served[step] = time.monotonic()
