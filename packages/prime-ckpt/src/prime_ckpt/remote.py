"""The remote tier: committed disk checkpoints copied to any fsspec URL in the background.

Object stores cannot rename, so a step's data files are uploaded first and its manifest last:
the manifest marks the commit. A step prefix without a manifest is torn and is removed by the
uploader; a step whose files fail the manifest is skipped by loads and removed. Files may be compressed
with zstd (recorded in the remote manifest); checksums are always of the uncompressed bytes.
"""

from __future__ import annotations

import gc
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
import zstandard

from prime_ckpt.bounded import Breaker, bounded
from prime_ckpt.errors import CorruptCheckpoint, ManifestError
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    parse_step_dirname,
    read_manifest,
    step_dirname,
)
from prime_ckpt.records import CheckpointInfo

log = logging.getLogger("prime_ckpt")
_CHUNK = 8 << 20
_PART = 8 << 20  # what a remote file buffers before it sends a part (s3fs: 50 MiB; S3's least: 5)
# the longest a listing, a manifest read or a delete of the remote is waited for where a start
# or a stop waits on it (load_latest, list, discard_after): a remote that hangs counts as
# unreachable (an object store lists a prefix in well under a second; 60 s, botocore's own
# read timeout, held every start against a hung endpoint a minute)
REMOTE_LIST_TIMEOUT_S = 20.0


class RemoteStore:
    """List, upload, download and delete checkpoints under one fsspec URL."""

    def __init__(
        self, url: str, options: Mapping[str, Any] | None = None, compression: str | None = None
    ) -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"remote compression must be None or 'zstd', got {compression!r}")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(options or {}))
        except ImportError as e:
            raise ImportError(
                f"remote {url!r} needs an fsspec backend that is not installed: {e} "
                "(for s3:// install prime-ckpt[s3])"
            ) from None
        except ValueError as e:
            raise ValueError(f"remote {url!r} is not a usable fsspec URL: {e}") from None
        self.url = url
        self.root = self.root.rstrip("/")
        self.compression = compression
        self._local = "file" in _protocols(self.fs)
        self.listing = Breaker()  # `steps()` bounded, not asked again for a while once it hung

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):  # nothing there (yet)
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def step_prefixes(self) -> list[int]:
        """Every step with something uploaded, committed or torn."""
        return sorted(s for n in self._names() if (s := parse_step_dirname(n)) is not None)

    def steps(self) -> list[int]:
        """Committed steps (manifest present), newest first."""
        return [
            s
            for s in reversed(self.step_prefixes())
            if self.fs.exists(self.path(step_dirname(s), MANIFEST_NAME))
        ]

    def manifest(self, step: int) -> Manifest:
        try:
            data = self.fs.cat_file(self.path(step_dirname(step), MANIFEST_NAME))
        except FileNotFoundError as e:
            raise ManifestError(f"{self.url}/{step_dirname(step)}: no manifest (torn)") from e
        return Manifest.from_bytes(data)

    def upload(self, local: Path, retry: Callable[[Callable[[], None], str], None]) -> Manifest:
        """Upload a committed local step: data files, then the manifest."""
        m = read_manifest(local)
        prefix = step_dirname(m.step)
        for name in sorted(m.files):
            retry(lambda n=name: self._put(local / n, self.path(prefix, n)), name)
        remote = Manifest(
            m.step,
            m.files,
            m.world_size,
            dict(m.extra, compression=self.compression),
            m.user,
            format=m.format,
        )
        remote.created = m.created
        data = remote.to_bytes()
        retry(lambda: self.fs.pipe_file(self.path(prefix, MANIFEST_NAME), data), MANIFEST_NAME)
        return remote

    def _put(self, src: Path, dst: str) -> None:
        if self._local:
            self.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        part = max(_PART, -(-src.stat().st_size // 9_000))  # (S3 takes at most 10,000 parts)
        with open(src, "rb") as f, self.fs.open(dst, "wb", block_size=part) as out:
            if self.compression == "zstd":
                w = zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False)
                while chunk := f.read(_CHUNK):
                    w.write(chunk)
                w.flush(zstandard.FLUSH_FRAME)
            else:
                shutil.copyfileobj(f, out, _CHUNK)

    def download(self, step: int, dest: Path) -> Manifest:
        """Download and verify one committed step into `dest` (a local folder)."""
        try:
            m = self.manifest(step)
        except ManifestError as e:
            raise CorruptCheckpoint(str(e)) from None
        dest.mkdir(parents=True, exist_ok=True)
        prefix = step_dirname(step)
        compressed = m.extra.get("compression") == "zstd"
        for name, entry in m.files.items():
            h = m.hasher()
            size = 0
            try:
                with (
                    self.fs.open(self.path(prefix, name), "rb") as f,
                    open(dest / name, "wb") as out,
                ):
                    src = zstandard.ZstdDecompressor().stream_reader(f) if compressed else f
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{self.url}/{prefix}/{name}: missing") from None
            except zstandard.ZstdError as e:
                raise CorruptCheckpoint(f"{self.url}/{prefix}/{name}: bad zstd data: {e}") from None
            if size != entry.size or h.hexdigest() != entry.digest:
                raise CorruptCheckpoint(
                    f"{self.url}/{prefix}/{name}: checksum mismatch (corrupted)"
                )
        local = Manifest(m.step, m.files, m.world_size, {"layout": 1}, m.user, format=m.format)
        local.created = m.created
        (dest / MANIFEST_NAME).write_bytes(local.to_bytes())
        return m

    def delete(self, step: int) -> None:
        """Uncommit first (manifest), then remove the files."""
        prefix = self.path(step_dirname(step))
        try:
            self.fs.rm_file(self.path(step_dirname(step), MANIFEST_NAME))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass


def _protocols(fs: Any) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


class Uploader:
    """One background thread uploading the newest committed step; never blocks `save()`."""

    def __init__(
        self,
        store: RemoteStore,
        disk_dir: Path,
        keep: int | None,
        pins: set[int],
        retries: int = 5,
        backoff: float = 0.5,
        on_failure: Callable[[int, str], None] | None = None,
    ) -> None:
        self.store = store
        self.disk_dir = disk_dir
        self.keep = keep
        self.retries = retries
        self.backoff = backoff
        self.pins = pins  # steps the disk pruner must keep while they wait or upload
        self.skipped: set[int] = set()
        self.failed: dict[int, str] = {}
        # a step whose upload failed after every retry, and why (default: logged)
        self.on_failure = on_failure or (lambda step, msg: log.error("prime-ckpt: %s", msg))
        self._pending: int | None = None
        self._busy: int | None = None
        self._told: set[int] = set()  # steps whose upload failure was reported (once each)
        self._if_missing: set[int] = set()  # steps to upload only if the remote lacks them
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="prime-ckpt-upload", daemon=True)
        self._thread.start()

    def resume(self, step: int) -> None:
        """Upload `step` (the newest on disk at a start) unless the remote already has it: a
        run that stopped before its upload ended finishes it at the next start."""
        with self._cond:
            self._if_missing.add(step)
        self.submit(step)

    def submit(self, step: int) -> None:
        with self._cond:
            if self._pending is not None:
                # remote fell behind: only the newest committed step is uploaded
                self.skipped.add(self._pending)
                self.pins.discard(self._pending)
            self.pins.add(step)
            self._pending = step
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._pending is None and self._busy is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or uploading; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Wait for the upload in flight (at most `timeout` s in all, None: until done) and
        stop; an upload still hung past it is left to its daemon thread (the next start
        uploads that step again) and, unless a try of it failed already, is a failure
        (`on_failure`): the run ends without its newest step in the remote store."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait(timeout):
            with self._cond:
                step = self._busy if self._busy is not None else self._pending
                first = step is not None and step not in self._told
                if first:
                    self._told.add(step)
            msg = (
                f"the upload of step {step} to {self.store.url} did not finish within "
                f"{timeout:.0f} s on the way out; the step is on disk and the next start "
                "uploads it"
            )
            if first:  # (a remote that hangs fails no try: this is its one failure)
                self.on_failure(step, msg)
            else:  # counted at its first failed try already
                log.warning("prime-ckpt: %s", msg)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10 if deadline is None else max(0.0, deadline - time.monotonic()))

    def discard_after(self, step: int, timeout: float = REMOTE_LIST_TIMEOUT_S) -> list[int]:
        """Once idle (at most `timeout` s), delete the committed remote steps newer than
        `step`; returns them. A step that cannot be deleted, a remote that cannot be listed
        within `timeout` (each delete too), or an uploader still busy is logged and left: a
        later upload replaces such a step."""
        if not self.wait(timeout):
            log.warning(
                "prime-ckpt: %s still uploading after %.0f s; newer remote steps are left",
                self.store.url,
                timeout,
            )
            return []
        removed: list[int] = []
        try:
            steps = self.store.listing.call(self.store.steps, timeout, f"listing {self.store.url}")
        except Exception as e:  # an unreachable remote must not stop a local start
            log.warning("prime-ckpt: cannot list %s to remove newer steps: %s", self.store.url, e)
            return removed
        for s in steps:
            if s > step:
                try:
                    bounded(lambda s=s: self.store.delete(s), timeout, f"removing step {s}")
                    removed.append(s)
                except Exception as e:
                    log.warning(
                        "prime-ckpt: cannot remove step %d from %s: %s", s, self.store.url, e
                    )
        return removed

    def _retry(self, fn: Callable[[], None], what: str) -> None:
        step = self._busy
        for attempt in range(self.retries + 1):
            try:
                fn()
                return
            except Exception as e:  # network, credentials, full bucket: retry, then give up
                if attempt == self.retries:
                    raise
                delay = min(self.backoff * 2**attempt, 30.0)
                retrying = f"retrying in {delay:.1f}s ({self.retries - attempt} more tries)"
                if step is not None and step not in self._told:
                    # said (and counted) at the first failure, not after the last retry: a
                    # run that ends before the retries do still shows it
                    self._told.add(step)
                    self.on_failure(
                        step,
                        f"upload of step {step} to {self.store.url} failed: {e}; older remote "
                        f"copies are kept; {retrying}",
                    )
                else:
                    log.info("prime-ckpt: upload of %s failed (%s); %s", what, e, retrying)
            # the failed attempt's frames (its file object's part buffer) are freed now, not
            # whenever the cyclic collector runs: a remote that keeps failing held ~5 B/param
            gc.collect()
            time.sleep(delay)

    def _upload(self, step: int) -> None:
        if step in self._if_missing:
            self._if_missing.discard(step)
            have: list[int] = []
            self._retry(lambda: have.extend(self.store.steps()), f"the listing of step {step}")
            if step in have:
                return
            log.info("prime-ckpt: finishing the upload of step %d to %s", step, self.store.url)
        self.store.upload(self.disk_dir / step_dirname(step), self._retry)
        self.failed.pop(step, None)
        self._tidy(step)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._stop and self._pending is None:
                    return
                step, self._pending, self._busy = self._pending, None, self._pending
            try:
                self._upload(step)
            except Exception as e:
                msg = f"upload of step {step} to {self.store.url} failed: {e}; older remote copies are kept"
                self.failed[step] = msg
                if step in self._told:  # said (ERROR) and counted at its first failure already
                    log.info("prime-ckpt: gave up: %s", msg)
                else:
                    self._told.add(step)
                    self.on_failure(step, msg)
            finally:
                with self._cond:
                    self._busy = None
                    self.pins.discard(step)
                    self._cond.notify_all()

    def _tidy(self, just_uploaded: int) -> None:
        """Remove torn prefixes (our own failed uploads) and steps beyond `keep`."""
        try:
            committed = self.store.steps()
            for s in self.store.step_prefixes():
                if s not in committed:
                    self.store.delete(s)
            if self.keep:
                for s in committed[self.keep :]:
                    self.store.delete(s)
        except Exception as e:  # tidying is best effort; the upload itself succeeded
            log.warning("prime-ckpt: could not tidy %s: %s", self.store.url, e)


def remote_listing(
    store: RemoteStore, steps: list[int], uploader: Uploader | None
) -> list[CheckpointInfo]:
    """The `list()` rows of the remote tier: each committed step of `steps`, and the steps
    the uploader (rank 0's) skipped or failed to upload."""
    out = []
    for s in steps:
        try:
            m = store.manifest(s)
            size = sum(f.size for f in m.files.values())
            path = store.path(step_dirname(s))
            out.append(CheckpointInfo(s, "remote", path, size, "ok", metadata=dict(m.user)))
        except Exception as e:
            out.append(CheckpointInfo(s, "remote", None, 0, "corrupt", False, str(e)))
    if uploader is not None:
        newer = "a newer step was uploaded instead"
        for s in sorted(uploader.skipped):
            out.append(CheckpointInfo(s, "remote", None, 0, "skipped", None, newer))
        for s, msg in dict(uploader.failed).items():
            out.append(CheckpointInfo(s, "remote", None, 0, "failed", False, msg))
    return out
