"""The uploader: one background thread copying the newest committed disk step to the remote
(`prime_ckpt.remote.RemoteStore`), with retries; an upload that moves no data for
`UPLOAD_STALL_S` (a remote that hangs fails no try) counts as a failure once, so a run shows
it while it goes on. And the `list()` rows of the remote tier, with the uploader's state."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prime_ckpt.bounded import bounded
from prime_ckpt.manifest import step_dirname
from prime_ckpt.records import CheckpointInfo
from prime_ckpt.remote import REMOTE_LIST_TIMEOUT_S, RemoteStore

log = logging.getLogger("prime_ckpt")
UPLOAD_STALL_S = 120.0  # an upload that moves no byte this long counts as failed (once)


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
        self._busy_since = 0.0  # when the upload in flight began
        self.stall_s = UPLOAD_STALL_S
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

    def check_stalled(self) -> None:
        """Count the upload in flight as failed (once, `on_failure`) when it has moved no data
        for `stall_s`: a remote that hangs fails no try, and its run would show nothing until
        its way out. The upload goes on; one that ends later still lands."""
        with self._cond:
            step = self._busy
            if step is None or step in self._told:
                return
            quiet = time.monotonic() - max(self._busy_since, self.store.moved_at)
            if quiet < self.stall_s:
                return
            self._told.add(step)
        self.on_failure(
            step,
            f"the upload of step {step} to {self.store.url} has moved no data for {quiet:.0f} s "
            "(a remote that does not answer?); older remote copies are kept and it goes on",
        )

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
                self._busy_since = time.monotonic()
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
