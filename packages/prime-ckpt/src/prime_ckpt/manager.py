"""CheckpointManager: save to RAM now, to disk in the background, load the newest good copy."""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prime_ckpt.collectives import agree_nonce, group_info
from prime_ckpt.errors import CheckpointError, CheckpointWarning
from prime_ckpt.failures import CheckpointFailure, Failures
from prime_ckpt.faults import fault
from prime_ckpt.loading import Loading
from prime_ckpt.manifest import Manifest, committed_steps, data_name, meta_name, step_dirname
from prime_ckpt.records import SaveHandle, parse_keep
from prime_ckpt.remote import RemoteStore
from prime_ckpt.staging import DirectWriter, PendingStage, StagingFailed, ram_tier, staging_failure
from prime_ckpt.state import assign_offsets, flatten, pack_meta
from prime_ckpt.uploader import Uploader
from prime_ckpt.writer import (
    DISK_TIMEOUT_S,
    DiskCommitter,
    copy_hashed,
    disk_steps,
    hash_and_sync,
)

log = logging.getLogger("prime_ckpt")
# `close()` and `wait_remote()` without a timeout wait this long for an upload at most
UPLOAD_WAIT_S = 600.0


class CheckpointManager(Loading):
    """Tiered asynchronous checkpoints of one rank's state.

    `save()` copies the state into a shared-memory staging slot and returns; a background
    thread hashes it, writes it to `disk_dir` with fsync and commits it by rename. At most one
    disk copy is in flight: a `save()` issued while the previous one is still being written
    waits for it (at most `disk_timeout` s), so RAM holds one staged copy (two with
    `keep={"ram": 2}`). `ram="disk"` stages in a folder on disk instead; `ram="off"` copies
    the state straight into the disk tier's temporary folder, with no staging copy. With `group` (default: the default
    process group when torch.distributed is initialized) every rank writes its own shard and
    rank 0 commits once all shards are on disk.

    A save or upload that fails in the background is logged (one ERROR line on the
    `prime_ckpt` logger), counted in `errors`, listed by `failures()` and handed to
    `on_error(CheckpointFailure)` (called on the background thread: keep it short). Training
    is never interrupted by one. Without `on_error`, a failed disk save is also raised by
    `wait()` or warned at the next `save()` unless its handle's `wait()` raised it.
    """

    def __init__(
        self,
        disk_dir: str | Path,
        shm_dir: str | Path | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, Any] | None = None,
        keep: int | Mapping[str, int] | None = None,
        group: Any = None,
        commit_timeout: float = 600.0,
        remote_compression: str | None = None,
        remote_retries: int = 5,
        remote_backoff: float = 0.5,
        on_error: Callable[[CheckpointFailure], None] | None = None,
        ram: str = "shm",
        disk_timeout: float = DISK_TIMEOUT_S,
    ) -> None:
        self._errors = Failures(on_error)
        self.keep = parse_keep(keep)
        self._remote = RemoteStore(remote, remote_options, remote_compression) if remote else None
        self.disk_dir = Path(disk_dir)
        try:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {self.disk_dir}: {e}") from None
        self.group, self.rank, self.world = group_info(group)
        self._nonce = nonce = agree_nonce(self.group)
        if not disk_timeout > 0:
            raise ValueError(
                f"disk_timeout must be a positive number of seconds, got {disk_timeout}"
            )
        self.disk_timeout = float(disk_timeout)
        self.ram = ram
        self._stager, self.shm_dir = ram_tier(
            ram, shm_dir, self.disk_dir, self.rank, self.keep["ram"]
        )
        self._committer = DiskCommitter(
            self.disk_dir, self.rank, self.world, nonce, self.keep["disk"], commit_timeout
        )
        self._committer.clean_leftovers()
        self._uploader = None
        if self._remote is not None and self.rank == 0:
            self._uploader = Uploader(
                self._remote,
                self.disk_dir,
                self.keep.get("remote"),
                self._committer.pins,
                retries=remote_retries,
                backoff=remote_backoff,
                on_failure=lambda step, msg: self._errors.add(step, "remote", msg),
            )
            self._committer.on_commit = self._uploader.submit
            on_disk = committed_steps(self.disk_dir)
            if on_disk:  # an upload the last run did not finish: finished now, in the background
                self._uploader.resume(on_disk[-1])
        self._inflight: SaveHandle | None = None
        self._failures: dict[int, str] = {}  # disk saves that failed, until one succeeds
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="prime-ckpt-writer", daemon=True)
        self._worker.start()

    # ---- saving -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict,
        metadata: Mapping[str, Any] | None = None,
        stage_in_background: bool = False,
    ) -> SaveHandle:
        """Stage `state` in RAM and return; the disk copy is written in the background.

        Waits first if the previous save is still being written to disk. `metadata` (plain
        values) is stored in the manifest. Raises TypeError naming the key of an unsupported
        value; a failed earlier background save is reported here as a CheckpointWarning.
        `stage_in_background`: the copy into RAM is made by the background thread too, and
        `save()` returns at once (its plain values are taken now): the caller must not change
        the state's tensors until `wait_staged()` returns (a load waits for it by itself).
        Then a failed staging is a failed save (logged, counted), not an exception.
        """
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointManager")
        step_dirname(step)  # validates
        skeleton, items = flatten(state)  # before touching any slot: a TypeError loses nothing
        total = assign_offsets(items)
        meta = pack_meta(skeleton, items, step=step, rank=self.rank, world_size=self.world)
        prev = self._inflight
        handle = SaveHandle(step, self._errors.reported, self.disk_timeout, self._expire)
        if prev is not None and not self._settle(prev):
            # the writer still holds the slot: staging over it would tear step `prev`
            self._record(
                handle,
                f"checkpoint step {step} was not saved: the disk write of "
                f"step {prev.step} {self._stuck}",
            )
            handle.finish()
            return handle
        self._report_warnings()
        slot: int | PendingStage | None = None
        if isinstance(self._stager, DirectWriter):
            if not self._write_direct(handle, items, total, meta):
                return handle
        elif stage_in_background:
            slot = PendingStage(items, total, meta)
            handle.expect_copies(dict.fromkeys(it.path[0] for it in items))
        else:
            try:
                slot = self._stager.stage(step, items, total, meta)
            except OSError as e:
                raise CheckpointError(staging_failure(step, self.shm_dir, e)) from None
        if not isinstance(slot, PendingStage):
            handle.mark_staged()
        self._inflight = handle
        self._jobs.put((handle, slot, dict(metadata or {})))
        return handle

    def wait_staged(self, keys: Iterable[str] | None = None) -> None:
        """Block until the last save is done with the state's tensors (`save`'s
        `stage_in_background`), or with those under top-level `keys` (copied in the state's
        order). Past `disk_timeout` that save is given up on (reported failed); then this
        returns."""
        handle = self._inflight
        if handle is not None and not handle.staged(self.disk_timeout, keys):
            self._expire(handle)

    def _write_direct(self, handle: SaveHandle, items: list, total: int, meta: bytes) -> bool:
        """`ram="off"`: the files go straight into the disk tier's temporary folder. A failure
        (a full disk) is a failed save, as in the background, not an exception."""
        try:
            self._stager.write(
                self._committer.tmp_dir(handle.step), handle.step, items, total, meta
            )
            return True
        except OSError as e:
            msg = self._disk_failure(handle.step, e)
        self._committer.abort(handle.step, msg)
        self._record(handle, msg)
        handle.finish()
        return False

    @property
    def _stuck(self) -> str:
        return (
            f"has not ended after {self.disk_timeout:g} s (disk_timeout: a hung or very slow "
            f"disk at {self.disk_dir}); older checkpoints are intact"
        )

    def _settle(self, handle: SaveHandle) -> bool:
        """Wait, at most `disk_timeout` s, until the writer is done with `handle`; past that
        its save is reported failed and False returned. Once a save has been given up on,
        later calls do not wait for it again."""
        if handle.ended(0.0 if handle.expired else self.disk_timeout):
            return True
        self._expire(handle)
        return False

    def _expire(self, handle: SaveHandle) -> None:
        handle.expired = True
        self._record(
            handle, f"checkpoint step {handle.step} was not saved to disk: its write " + self._stuck
        )

    def _record(self, handle: SaveHandle, msg: str) -> None:
        """A failed save: its handle fails (unless it has ended already), and the failure is
        listed, logged and counted once, before a wait on the handle returns."""

        def count() -> None:
            with self._lock:
                self._failures[handle.step] = msg
            self._errors.add(handle.step, "disk", msg)

        if not handle.fail(msg, count):
            log.info("prime-ckpt: %s", msg)

    def _disk_failure(self, step: int, e: Exception) -> str:
        msg = f"checkpoint step {step} was not saved to disk: {e}"
        if isinstance(e, OSError):
            msg += f" (check free space and permissions of {self.disk_dir})"
        return msg + "; older checkpoints are intact"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save is durable; CheckpointError for failures not yet reported.
        TimeoutError past `timeout`; without one, past `disk_timeout` the save is reported
        failed (a CheckpointError here unless `on_error` was told)."""
        if self._inflight is not None:
            if timeout is None:
                self._settle(self._inflight)
            elif not self._inflight.join(timeout):
                raise TimeoutError(f"step {self._inflight.step} not durable after {timeout}s")
        failed = self._errors.take_unreported()
        if failed:
            raise CheckpointError("; ".join(f.message for f in failed))

    @property
    def errors(self) -> int:
        """How many background saves (disk) and uploads (remote, a stalled one too) failed."""
        if self._uploader is not None:
            self._uploader.check_stalled()
        return self._errors.count

    def failures(self) -> list[CheckpointFailure]:
        """The background failures so far (the newest 100), oldest first."""
        return self._errors.recent()

    def _report_warnings(self) -> None:
        for f in self._errors.take_unreported():
            warnings.warn(f.message, CheckpointWarning, stacklevel=3)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handle, slot, user = job
            try:
                self._write(handle, slot, user)
            except Exception as e:  # the thread must survive anything: report, keep running
                msg = str(e) if isinstance(e, StagingFailed) else self._disk_failure(handle.step, e)
                try:
                    self._committer.abort(handle.step, msg)
                except Exception:
                    pass
                self._record(handle, msg)
            finally:
                handle.finish()

    def _write(self, handle: SaveHandle, slot: int | PendingStage | None, user: dict) -> None:
        step = handle.step
        if isinstance(slot, PendingStage):  # save()'s copy into RAM, made here
            try:
                slot = self._stager.stage(step, slot.items, slot.total, slot.meta,
                                          handle.mark_copied)  # fmt: skip
            except OSError as e:
                raise StagingFailed(staging_failure(step, self.shm_dir, e)) from None
            finally:
                handle.mark_staged()
            if handle.done():  # given up on while it was staged: the tensors may have moved
                self._stager.invalidate(slot)
                return
        if slot is None:  # ram="off": save() wrote the files; hash, fsync and commit them
            tmp = self._committer.tmp_dir(step)
            names = (data_name(self.rank), meta_name(self.rank))
            self._committer.commit(step, {n: hash_and_sync(tmp / n) for n in names}, user)
            return
        src = self._stager.slots[slot]
        tmp = self._committer.tmp_dir(step)
        err: OSError | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = e
        entries = {}
        for name, point in ((data_name(self.rank), "disk_write"), (meta_name(self.rank), None)):
            entries[name], e = copy_hashed(
                src / name, None if err else tmp / name, step, point, self.disk_timeout
            )
            err = err or e
        fault("ram_commit", step)
        extra = {"rank": self.rank, "tier": "ram"}
        self._stager.commit(slot, Manifest(step, entries, self.world, extra=extra, user=user))
        if err is not None:
            raise err
        self._committer.commit(step, entries, user)
        with self._lock:
            self._failures.pop(step, None)

    def discard_after(self, step: int) -> list[int]:
        """Remove every committed copy of a step newer than `step` (this rank's RAM copies;
        on rank 0 the disk and remote ones) and return those steps. After resuming from
        `step` (0: from scratch) they belong to a future the run makes again: kept, retention
        would prune the new steps instead. Call it after loading, before the next save.
        CheckpointError if a disk write is still running after `disk_timeout` s."""
        if self._inflight is not None and not self._settle(self._inflight):
            raise CheckpointError(
                f"cannot remove the steps after {step}: the disk write of step "
                f"{self._inflight.step} {self._stuck}"
            )
        removed = {s for s, i in self._stager.committed() if s > step}
        for s, i in self._stager.committed():
            if s > step:
                self._stager.invalidate(i)
        if self.rank == 0:
            removed.update(s for s in committed_steps(self.disk_dir) if s > step)
            for s in sorted(removed):
                self._committer.discard(s)
            if self._uploader is not None:
                removed.update(self._uploader.discard_after(step))
        return sorted(removed)

    # ---- inspection and lifecycle --------------------------------------------------------

    def serve(
        self, host: str, port: int = 0, token: str | None = None, advertise_host: str | None = None
    ):
        """Share the newest committed disk checkpoint with joining peers (see prime_ckpt.peer)."""
        from prime_ckpt.peer import serve_directory

        return serve_directory(
            self.disk_dir, host=host, port=port, token=token, advertise_host=advertise_host
        )

    def wait_remote(self, timeout: float | None = None) -> bool:
        """Block until the newest committed step is uploaded (or its upload failed); False on
        timeout. Uploads never make `save()` wait; this is for the end of a run and tests.
        Without `timeout`: the disk write for `disk_timeout` s at most, the upload for
        `UPLOAD_WAIT_S` (600 s)."""
        if self._inflight is not None:
            self._inflight.join(timeout)
        if self._uploader is None:
            return True
        return self._uploader.wait(UPLOAD_WAIT_S if timeout is None else timeout)

    def close(self, remote_timeout: float | None = None) -> None:
        """Finish the in-flight save and its upload, and stop. The RAM copy is freed when the
        newest staged checkpoint is durable on disk, and kept (for the next process) otherwise.
        Bounded: the disk write is waited for `disk_timeout` s at most (past it, reported as a
        failed save and left), the upload `remote_timeout` s (None: `UPLOAD_WAIT_S`)."""
        if self._closed:
            return
        self._closed = True
        # the writer's own waits are bounded too: commit_timeout for the other ranks,
        # disk_timeout for a write that makes no progress
        settled = self._inflight is None or self._settle(self._inflight)
        self._jobs.put(None)
        self._worker.join(self.disk_timeout if settled else 0.0)
        if self._uploader is not None:
            # the upload is bounded on the way out; the next start finishes it
            self._uploader.close(UPLOAD_WAIT_S if remote_timeout is None else remote_timeout)
        if self._worker.is_alive():  # stuck on the disk: its files stay, the next start cleans
            return
        on_disk = [s for s, _ in disk_steps(self.disk_dir)]
        newest = max(on_disk, default=-1)
        if all(s <= newest for s, _ in self._stager.committed()):
            self._stager.remove()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointManager"]
