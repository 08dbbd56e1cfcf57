"""CheckpointManager: save to RAM now, to disk in the background, load the newest good copy."""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prime_ckpt.collectives import agree_nonce, all_reduce_int, group_info
from prime_ckpt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    NotCovered,
    StateMismatch,
)
from prime_ckpt.failures import CheckpointFailure, Failures
from prime_ckpt.faults import fault
from prime_ckpt.manifest import Manifest, committed_steps, data_name, meta_name, step_dirname
from prime_ckpt.reader import CheckpointSource, Plan, apply_plan, plan_load
from prime_ckpt.records import TIERS, CheckpointInfo, SaveHandle, checkpoint_info, parse_keep
from prime_ckpt.remote import RemoteStore, Uploader, remote_listing
from prime_ckpt.remote_load import open_remote, settle_remote
from prime_ckpt.staging import Stager, clean_stale, default_shm_dir
from prime_ckpt.state import assign_offsets, flatten, pack_meta
from prime_ckpt.writer import TMP_PREFIX, DiskCommitter, copy_hashed, disk_steps


class CheckpointManager:
    """Tiered asynchronous checkpoints of one rank's state.

    `save()` copies the state into a shared-memory staging slot and returns; a background
    thread hashes it, writes it to `disk_dir` with fsync and commits it by rename. At most one
    disk copy is in flight: a `save()` issued while the previous one is still being written
    waits for it, so RAM use stays at two staged copies. With `group` (default: the default
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
        if shm_dir is None:
            self.shm_dir = default_shm_dir(self.disk_dir, self.rank)
            clean_stale(self.shm_dir.parent)
        else:
            self.shm_dir = Path(shm_dir)
        self._stager = Stager(self.shm_dir, self.disk_dir, self.rank, self.keep["ram"])
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

    def save(self, step: int, state: dict, metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Stage `state` in RAM and return; the disk copy is written in the background.

        Waits first if the previous save is still being written to disk. `metadata` (plain
        values) is stored in the manifest. Raises TypeError naming the key of an unsupported
        value; a failed earlier background save is reported here as a CheckpointWarning.
        """
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointManager")
        step_dirname(step)  # validates
        skeleton, items = flatten(state)  # before touching any slot: a TypeError loses nothing
        total = assign_offsets(items)
        meta = pack_meta(skeleton, items, step=step, rank=self.rank, world_size=self.world)
        if self._inflight is not None:
            self._inflight.join()
        self._report_warnings()
        try:
            slot = self._stager.stage(step, items, total, meta)
        except OSError as e:
            raise CheckpointError(
                f"staging step {step} in {self.shm_dir} failed: {e}; older checkpoints are "
                "intact (free space in /dev/shm or pass shm_dir= on a larger filesystem)"
            ) from None
        handle = SaveHandle(step, self._errors.reported)
        self._inflight = handle
        self._jobs.put((handle, slot, dict(metadata or {})))
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save is durable; CheckpointError for failures not yet reported."""
        if self._inflight is not None and not self._inflight.join(timeout):
            raise TimeoutError(f"step {self._inflight.step} not durable after {timeout}s")
        failed = self._errors.take_unreported()
        if failed:
            raise CheckpointError("; ".join(f.message for f in failed))

    @property
    def errors(self) -> int:
        """How many background saves (disk) and uploads (remote) failed so far."""
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
                self._write(handle.step, slot, user)
            except Exception as e:  # the thread must survive anything: report, keep running
                msg = f"checkpoint step {handle.step} was not saved to disk: {e}"
                if isinstance(e, OSError):
                    msg += f" (check free space and permissions of {self.disk_dir})"
                msg += "; older checkpoints are intact"
                try:
                    self._committer.abort(handle.step, msg)
                except Exception:
                    pass
                handle.error = msg  # finish() below marks it done
                with self._lock:
                    self._failures[handle.step] = msg
                self._errors.add(handle.step, "disk", msg)
            finally:
                handle.finish()

    def _write(self, step: int, slot: int, user: dict) -> None:
        src = self._stager.slots[slot]
        tmp = self._committer.tmp_dir(step)
        err: OSError | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = e
        entries = {}
        for name, point in ((data_name(self.rank), "disk_write"), (meta_name(self.rank), None)):
            entries[name], e = copy_hashed(src / name, None if err else tmp / name, step, point)
            err = err or e
        fault("ram_commit", step)
        extra = {"rank": self.rank, "tier": "ram"}
        self._stager.commit(slot, Manifest(step, entries, self.world, extra=extra, user=user))
        if err is not None:
            raise err
        self._committer.commit(step, entries, user)
        with self._lock:
            self._failures.pop(step, None)

    # ---- loading ------------------------------------------------------------------------

    def _copies(self, step: int) -> list[tuple[str, Path]]:
        out = [("ram", self._stager.slots[i]) for s, i in self._stager.committed() if s == step]
        d = self.disk_dir / step_dirname(step)
        if d.is_dir():
            out.append(("disk", d))
        if step in self._remote_steps():
            out.append(("remote", d))
        return out

    def _remote_steps(self) -> list[int]:
        if self._remote is None:
            return []
        try:
            return self._remote.steps()
        except Exception as e:  # an unreachable remote must not stop a local restore
            warnings.warn(f"cannot list {self._remote.url}: {e}", CheckpointWarning, stacklevel=4)
            return []

    def committed_steps(self, tiers: Iterable[str] = TIERS) -> list[int]:
        """Steps this rank holds a committed copy of in any of `tiers` ("ram", "disk",
        "remote"), oldest first. Local only (no collective) and not verified: `load()`
        verifies the copy it uses. An unreachable remote is warned about and counts as empty.
        """
        tiers = set(tiers)
        if tiers - set(TIERS):
            raise ValueError(f"unknown tiers {sorted(tiers - set(TIERS))}; use {TIERS}")
        steps: set[int] = set()
        if "ram" in tiers:
            steps.update(s for s, _ in self._stager.committed())
        if "disk" in tiers:
            steps.update(committed_steps(self.disk_dir))
        if "remote" in tiers:
            steps.update(self._remote_steps())
        return sorted(steps)

    def _open(self, tier: str, path: Path, step: int) -> CheckpointSource:
        if tier != "remote":
            return CheckpointSource.open(tier, path)
        tmp = self.disk_dir / f"{TMP_PREFIX}remote-{step_dirname(step)}-{self._nonce}-r{self.rank}"
        return open_remote(self._remote, step, tmp, owner=self.rank == 0)

    def _finish(self, plan: Plan | Any, loaded: bool) -> None:
        """A remote copy, once loaded, becomes the disk copy (rank 0); else it is removed."""
        if isinstance(plan, Plan) and plan.source.tier == "remote":
            settle_remote(plan.source, self.disk_dir, adopt=loaded and self.rank == 0)

    def _plan(self, step: int, state: dict, strict: bool) -> tuple[int, Plan | Exception | None]:
        """(1, plan) when loadable, (0, reason) when no copy verifies, (-1, error) on mismatch."""
        reasons = []
        for tier, path in self._copies(step):
            try:
                return 1, plan_load(
                    state, self._open(tier, path, step), self.rank, self.world, strict
                )
            except NotCovered as e:
                reasons.append(str(e))
            except CorruptCheckpoint as e:
                warnings.warn(
                    f"skipping {tier} copy of step {step}: {e}", CheckpointWarning, stacklevel=4
                )
                reasons.append(f"{tier}: {e}")
            except (StateMismatch, TypeError) as e:
                return -1, e
        return 0, CheckpointError(
            f"no copy of step {step} verifies: " + ("; ".join(reasons) or "not found")
        )

    def _agree(self, code: int, result: Any) -> bool:
        agreed = all_reduce_int(code, "min", self.group)
        if agreed == -1:
            if isinstance(result, Exception) and code == -1:
                raise result
            raise StateMismatch(
                "another rank's state does not match the checkpoint (see its error)"
            )
        return agreed == 1

    def load_latest(self, state: dict, strict: bool = True) -> int | None:
        """Load, in place, the newest checkpoint that verifies (RAM first, then disk).

        Returns its step, or None when there is none. Corrupt copies are skipped with a
        warning. Raises StateMismatch naming missing/unexpected keys, shapes or dtypes.
        """
        bound = 2**62
        while True:
            mine = max((s for s in self.committed_steps() if s < bound), default=-1)
            step = all_reduce_int(mine, "max", self.group)
            if step < 0:
                return None
            code, result = self._plan(step, state, strict)
            agreed = False
            try:
                agreed = self._agree(code, result)
                if agreed:
                    apply_plan(result)
                    return step
            finally:
                self._finish(result, agreed)
            bound = step

    def load(self, step: int, state: dict, strict: bool = True) -> int:
        """Load one step in place; CheckpointError if it is missing or fails verification."""
        code, result = self._plan(step, state, strict)
        agreed = False
        try:
            agreed = self._agree(code, result)
            if not agreed:
                raise (
                    result if code == 0 else CheckpointError(f"step {step} failed on another rank")
                )
            apply_plan(result)
            return step
        finally:
            self._finish(result, agreed)

    def discard_after(self, step: int) -> list[int]:
        """Remove every committed copy of a step newer than `step` (this rank's RAM copies;
        on rank 0 the disk and remote ones) and return those steps. After resuming from
        `step` (0: from scratch) they belong to a future the run makes again: kept, retention
        would prune the new steps instead. Call it after loading, before the next save."""
        if self._inflight is not None:
            self._inflight.join()
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

    def list(self, verify: bool = False) -> list[CheckpointInfo]:
        """Every copy of every checkpoint (newest first), and background failures."""
        out = []
        for s, i in self._stager.committed():
            out.append(checkpoint_info(s, "ram", self._stager.slots[i], verify))
        for s, m in disk_steps(self.disk_dir):
            out.append(checkpoint_info(s, "disk", self.disk_dir / step_dirname(s), verify, m))
        with self._lock:
            failures = dict(self._failures)
        for s, msg in failures.items():
            out.append(CheckpointInfo(s, "disk", None, 0, "failed", False, msg))
        if self._remote is not None:
            out += remote_listing(self._remote, self._remote_steps(), self._uploader)
        return sorted(out, key=lambda c: (-c.step, c.tier != "ram"))

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
        timeout. Uploads never make `save()` wait; this is for the end of a run and tests."""
        if self._inflight is not None:
            self._inflight.join(timeout)
        return self._uploader.wait(timeout) if self._uploader is not None else True

    def close(self, remote_timeout: float | None = None) -> None:
        """Finish the in-flight save and its upload, and stop. The RAM copy is freed when the
        newest staged checkpoint is durable on disk, and kept (for the next process) otherwise."""
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            self._inflight.join()  # the final checkpoint reaches disk (the writer's own waits
            # are bounded: commit_timeout for the other ranks, the disk for the bytes)
        self._jobs.put(None)
        self._worker.join()
        if self._uploader is not None:
            # remote_timeout bounds the upload on the way out; the next start finishes it
            self._uploader.close(remote_timeout)
        on_disk = [s for s, _ in disk_steps(self.disk_dir)]
        newest = max(on_disk, default=-1)
        if all(s <= newest for s, _ in self._stager.committed()):
            self._stager.remove()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointManager"]
