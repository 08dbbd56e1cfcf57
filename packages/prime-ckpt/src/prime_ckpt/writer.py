"""The disk tier: copy a staged RAM slot to disk, fsync, and commit by rename.

With several ranks every rank copies its own files into a shared temporary folder and drops a
marker file listing their checksums; rank 0 waits for all markers (file polling, never a
collective from this background thread), writes the manifest and renames the folder. Other
ranks consider the step durable once the committed folder appears.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import msgpack

from prime_ckpt.errors import CommitError
from prime_ckpt.faults import fault, injected_enospc
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    committed_steps,
    file_hasher,
    fsync_dir,
    is_leased,
    parse_step_dirname,
    read_manifest,
    step_dirname,
    verify_dir,
)

log = logging.getLogger("prime_ckpt")
_CHUNK = 8 << 20
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
# the longest a disk write may make no progress, and the longest `save()`, `wait()`,
# `discard_after()` and `close()` wait for one (CheckpointManager's `disk_timeout`)
DISK_TIMEOUT_S = 600.0


def copy_hashed(
    src: Path,
    dst: Path | None,
    step: int,
    fault_point: str | None = None,
    stall_timeout: float = DISK_TIMEOUT_S,
):
    """Hash `src` and copy it to `dst` with fsync. Returns (entry, error): the hash is always
    computed (the RAM copy needs it) even when writing `dst` fails. Writing runs on a helper
    thread so that hashing and disk writes overlap (both release the GIL). A write that makes
    no progress for `stall_timeout` s (a hung disk) is an error, and the helper is left to
    close the file whenever its write returns."""
    h = file_hasher()
    size = src.stat().st_size
    err: list[OSError] = []
    out = None
    if dst is not None:
        try:
            out = open(dst, "wb")  # noqa: SIM115 - closed below, or by the writer once stalled
        except OSError as e:
            err.append(e)
    chunks: queue.Queue = queue.Queue(maxsize=4)
    stalled = threading.Event()

    def write() -> None:
        while (chunk := chunks.get()) is not None:
            if not err:
                try:
                    injected_enospc(step)
                    out.write(chunk)
                except OSError as e:
                    err.append(e)
            if stalled.is_set():  # given up on: nobody reads the queue or closes the file
                _close_quietly(out)
                return

    writer = threading.Thread(target=write, name="prime-ckpt-write", daemon=True) if out else None
    if writer:
        writer.start()
    done = 0
    try:
        with open(src, "rb") as f:
            while chunk := f.read(_CHUNK):
                if writer and not stalled.is_set():
                    _put(chunks, chunk, stall_timeout, stalled)
                h.update(chunk)
                done += len(chunk)
                if fault_point and done >= size // 2:
                    fault(fault_point, step)
                    fault_point = None
    finally:
        if writer and not stalled.is_set():
            _put(chunks, None, stall_timeout, stalled)
            writer.join(stall_timeout)
            if writer.is_alive():
                stalled.set()
    if stalled.is_set():
        err.insert(0, _stall_error(dst, stall_timeout))
    elif out is not None:
        _sync_and_close(out, err)
    return FileEntry(done, h.hexdigest()), (err[0] if err else None)


def _sync_and_close(out, err: list[OSError]) -> None:
    """fsync (unless a write failed already) and close; a failure joins `err`."""
    try:
        if not err:
            out.flush()
            os.fsync(out.fileno())
        out.close()
    except OSError as e:
        err.append(e)
        _close_quietly(out)


def _put(chunks: queue.Queue, item, timeout: float, stalled: threading.Event) -> None:
    """Hand `item` to the writer; a writer that takes nothing for `timeout` s has stalled."""
    try:
        chunks.put(item, timeout=timeout)
    except queue.Full:
        stalled.set()


def _stall_error(dst: Path | None, timeout: float) -> OSError:
    return OSError(
        errno.ETIMEDOUT,
        f"writing {dst} made no progress for {timeout:.0f} s (disk_timeout: a hung or very "
        "slow disk)",
    )


def hash_and_sync(path: Path) -> FileEntry:
    """`ram="off"`: the size and hash of a file `save()` wrote, made durable by fsync."""
    h = file_hasher()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return FileEntry(size, h.hexdigest())


def _close_quietly(f) -> None:
    try:
        f.close()
    except OSError:
        pass
    return None


class DiskCommitter:
    """Per-rank view of the disk folder: temporary folders, markers, commit and pruning."""

    def __init__(
        self, disk_dir: Path, rank: int, world: int, nonce: str, keep: int, timeout: float
    ) -> None:
        self.dir = disk_dir
        self.rank = rank
        self.world = world
        self.nonce = nonce
        self.keep = keep
        self.timeout = timeout
        self.pins: set[int] = set()  # steps waiting for or in upload: never pruned
        self.on_commit = None  # called with the step after the rename, before pruning

    def tmp_dir(self, step: int) -> Path:
        return self.dir / f"{TMP_PREFIX}{step_dirname(step)}-{self.nonce}"

    def clean_leftovers(self) -> None:
        """Rank 0 at start-up: remove torn folders of earlier processes."""
        if self.rank != 0:
            return
        for p in self.dir.iterdir():
            stale_tmp = p.name.startswith(TMP_PREFIX) and not p.name.endswith(self.nonce)
            if stale_tmp or p.name.startswith(TRASH_PREFIX):
                log.info("prime-ckpt: removing leftover %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def commit(self, step: int, entries: dict[str, FileEntry], user: dict) -> None:
        tmp = self.tmp_dir(step)
        if self.rank != 0:
            self._write_marker(tmp / f"rank-{self.rank:05d}.done", entries)
            self._await_commit(step)
            return
        files = dict(entries)
        if self.world > 1:
            files.update(self._gather_markers(tmp))
        manifest = Manifest(
            step=step, files=files, world_size=self.world, extra={"layout": 1}, user=user
        )
        fault("before_manifest", step)
        mtmp = tmp / (MANIFEST_NAME + ".tmp")
        with open(mtmp, "wb") as f:
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        mtmp.rename(tmp / MANIFEST_NAME)
        fsync_dir(tmp)
        fault("before_rename", step)
        final = self.dir / step_dirname(step)
        if final.exists():
            if not verify_dir(final):
                log.warning("prime-ckpt: step %d already committed in %s; kept it", step, self.dir)
                shutil.rmtree(tmp, ignore_errors=True)
                return
            self._trash(final)  # a corrupt copy of the same step: replace it
        os.rename(tmp, final)
        fsync_dir(self.dir)
        fault("after_rename", step)
        if self.on_commit is not None:
            self.on_commit(step)
        self.prune(step)

    def abort(self, step: int, reason: str) -> None:
        """Give up on `step`: free its space; rank 0 removes the folder, others mark failure."""
        tmp = self.tmp_dir(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                (tmp / f"rank-{self.rank:05d}.failed").write_text(reason)
            except OSError:
                pass

    def _write_marker(self, path: Path, entries: dict[str, FileEntry]) -> None:
        data = msgpack.packb({k: [v.size, v.digest] for k, v in entries.items()})
        tmp = path.with_suffix(".part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)

    def _gather_markers(self, tmp: Path) -> dict[str, FileEntry]:
        deadline = time.monotonic() + self.timeout
        files: dict[str, FileEntry] = {}
        pending = set(range(1, self.world))
        while pending:
            for r in sorted(pending):
                failed = tmp / f"rank-{r:05d}.failed"
                if failed.exists():
                    raise CommitError(f"rank {r} failed to write its shard: {failed.read_text()}")
                marker = tmp / f"rank-{r:05d}.done"
                if marker.exists():
                    d = msgpack.unpackb(marker.read_bytes(), raw=False)
                    files.update({k: FileEntry(int(v[0]), str(v[1])) for k, v in d.items()})
                    marker.unlink()
                    pending.discard(r)
            if pending and time.monotonic() > deadline:
                raise CommitError(
                    f"ranks {sorted(pending)} did not write their shards within "
                    f"{self.timeout:.0f}s (raise commit_timeout if they are just slow)"
                )
            if pending:
                time.sleep(0.02)
        return files

    def _await_commit(self, step: int) -> None:
        final = self.dir / step_dirname(step) / MANIFEST_NAME
        tmp = self.tmp_dir(step)
        deadline = time.monotonic() + self.timeout
        while not final.exists():
            if not tmp.exists() and not final.exists():
                raise CommitError(f"rank 0 abandoned step {step} (see its log)")
            if time.monotonic() > deadline:
                raise CommitError(f"rank 0 did not commit step {step} within {self.timeout:.0f}s")
            time.sleep(0.02)

    def _trash(self, path: Path) -> None:
        dest = self.dir / f"{TRASH_PREFIX}{path.name}-{time.monotonic_ns()}"
        os.rename(path, dest)
        shutil.rmtree(dest, ignore_errors=True)

    def discard(self, step: int) -> None:
        """Remove one committed step (uncommitted first by the rename aside)."""
        if self.rank == 0 and (self.dir / step_dirname(step)).is_dir():
            self._trash(self.dir / step_dirname(step))

    def prune(self, step: int = -1) -> list[int]:
        """Keep `keep` committed steps: the newest, the leased and pinned ones (a peer's
        transfer, an upload), then the newest of the others; so a lease adds no checkpoint
        beyond `keep` unless leases and pins alone are more than that."""
        if self.rank != 0 or self.keep <= 0:
            return []
        steps = committed_steps(self.dir)
        removed = []
        excess = len(steps) - self.keep
        for s in steps[:-1]:
            if excess <= 0:
                break
            if is_leased(self.dir, s) or s in self.pins:
                continue
            excess -= 1
            dest = self.dir / f"{TRASH_PREFIX}{step_dirname(s)}-{time.monotonic_ns()}"
            os.rename(self.dir / step_dirname(s), dest)
            fault("prune", step)
            shutil.rmtree(dest, ignore_errors=True)
            removed.append(s)
        return removed


def disk_steps(disk_dir: Path) -> list[tuple[int, Manifest | None]]:
    """Committed steps and their manifests (None if unreadable), newest first."""
    out = []
    for s in reversed(committed_steps(disk_dir)):
        try:
            out.append((s, read_manifest(disk_dir / step_dirname(s))))
        except Exception:
            out.append((s, None))
    return out


__all__ = [
    "DISK_TIMEOUT_S",
    "DiskCommitter",
    "copy_hashed",
    "hash_and_sync",
    "disk_steps",
    "parse_step_dirname",
]
