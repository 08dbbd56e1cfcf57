"""What the manager hands back: save handles, checkpoint listings, retention settings."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_ckpt.errors import CheckpointError
from prime_ckpt.manifest import Manifest, verify_dir
from prime_ckpt.reader import CheckpointSource

TIERS = ("ram", "disk", "remote")
# RAM: one checkpoint (20 B/param of a DiLoCo node); 2 keeps a second staging slot
DEFAULT_KEEP: dict[str, int | None] = {"ram": 1, "disk": 3, "remote": None}


class SaveHandle:
    """What `save()` returns: the step, and a way to wait until it is durable on disk.

    A wait without a timeout is bounded by the manager's `disk_timeout`: past it the save is
    reported failed (logged, counted) and the wait returns or raises; it is never endless."""

    def __init__(
        self,
        step: int,
        on_report: Any = None,
        bound: float | None = None,
        on_expire: Any = None,
    ) -> None:
        self.step = step
        self.error: str | None = None
        self.expired = False  # given up on: its write passed the bound
        self._done = threading.Event()  # ended for the caller: committed, failed or expired
        self._ended = threading.Event()  # the writer thread is finished with it
        self._staged = threading.Event()  # the state's tensors were copied (or never will be)
        self._copied: dict[str, threading.Event] = {}  # the same, by top-level key of the state
        self._lock = threading.Lock()
        self._on_report = on_report
        self._bound = bound
        self._on_expire = on_expire

    def done(self) -> bool:
        """True once the background save has ended, committed on disk or failed (`error`)."""
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Block until the background save has ended, committed or failed, without raising;
        False if it is still running after `timeout` seconds (None: the manager's
        `disk_timeout`, past which the save is reported failed)."""
        if timeout is not None or self._bound is None:
            return self._done.wait(timeout)
        if not self._done.wait(self._bound) and self._on_expire is not None:
            self._on_expire(self)
        return self._done.is_set()

    def staged(self, timeout: float | None = None, keys: Iterable[str] | None = None) -> bool:
        """Whether the save is done with the state's tensors (copied into its staging slot, or
        given up on): from then on the caller may change them. `keys`: only the tensors under
        these top-level keys of the state (copied in the state's order). False past
        `timeout`."""
        if keys is None:
            return self._staged.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for key in keys:
            event = self._copied.get(key)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if event is not None and not event.wait(left):
                return False
        return True

    def expect_copies(self, keys: Iterable[str]) -> None:
        """The top-level keys whose tensors a background copy will mark (by the manager)."""
        self._copied = {key: threading.Event() for key in keys}

    def mark_copied(self, key: str) -> None:
        """The tensors under top-level key `key` were copied (by the manager's stager)."""
        if key in self._copied:
            self._copied[key].set()

    def mark_staged(self) -> None:
        """The save no longer reads the state's tensors (by the manager)."""
        self._staged.set()
        for event in self._copied.values():
            event.set()

    def finish(self, error: str | None = None) -> None:
        """Mark the save ended (by the manager's writer thread); `error` says why it failed."""
        with self._lock:
            if error is not None and not self._done.is_set():
                self.error = error
            self._done.set()
        self.mark_staged()
        self._ended.set()

    def fail(self, error: str, counted: Callable[[], None] | None = None) -> bool:
        """Mark the save failed now, even before the writer is done with it (a bound passed);
        False if it had ended already (its outcome stands). `counted` runs first, so that a
        wait on the handle returns with the failure already counted."""
        with self._lock:
            if self._done.is_set():
                return False
            self.error = error
            if counted is not None:
                counted()
            self._done.set()
            return True

    def ended(self, timeout: float | None) -> bool:
        """Whether the writer thread is finished with this save (its staging slot is free)."""
        return self._ended.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed on disk; CheckpointError if that failed,
        TimeoutError past `timeout` (None: past the manager's `disk_timeout` the save is
        reported failed and CheckpointError raised)."""
        if timeout is not None and not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step} not durable after {timeout}s")
        self.join()
        if self.error:
            if self._on_report:
                self._on_report(self.step)
            raise CheckpointError(self.error)


@dataclass
class CheckpointInfo:
    """One copy of one checkpoint, as `list()` reports it."""

    step: int
    tier: str  # "ram", "disk" or "remote"
    path: str | None
    size: int
    status: str  # "ok", "corrupt" or "failed"
    verified: bool | None = None  # None: not checked
    detail: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # what save(metadata=...) stored


def parse_keep(keep: int | Mapping[str, int | None] | None) -> dict[str, int | None]:
    """How many checkpoints each tier keeps, from `CheckpointManager(keep=...)`: an int (the
    disk count) or a dict of tier -> count over the defaults; ValueError/TypeError naming a
    bad value."""
    out = dict(DEFAULT_KEEP)
    if isinstance(keep, int):
        out["disk"] = keep
    elif isinstance(keep, Mapping):
        unknown = set(keep) - set(TIERS)
        if unknown:
            raise ValueError(f"keep: unknown tiers {sorted(unknown)}; use ram, disk, remote")
        out.update(keep)
    elif keep is not None:
        raise TypeError(f"keep must be an int or a dict of tier -> count, got {keep!r}")
    if out["ram"] not in (1, 2):
        raise ValueError(
            f"keep['ram'] must be 1 or 2 (staging buffers in RAM), got {out['ram']}; to hold "
            "the RAM tier on disk instead, pass ram='disk' (or ram='off': no staging copy)"
        )
    if out.get("remote") is not None and out["remote"] < 1:
        raise ValueError(
            f"keep['remote'] must be None (keep all) or at least 1, got {out['remote']}"
        )
    if out["disk"] < 1:
        raise ValueError(f"keep['disk'] must be at least 1, got {out['disk']}")
    return out


def checkpoint_info(
    step: int, tier: str, path: Path, verify: bool, m: Manifest | None = None
) -> CheckpointInfo:
    """The listing row of one committed copy (`path`: a step folder or a RAM slot), its
    files hashed against the manifest when `verify`; an unreadable manifest is "corrupt"."""
    try:
        m = m or CheckpointSource.open(tier, path).manifest
    except CheckpointError as e:
        return CheckpointInfo(step, tier, str(path), 0, "corrupt", False, str(e))
    size = sum(f.size for f in m.files.values())
    if not verify:
        return CheckpointInfo(step, tier, str(path), size, "ok", metadata=dict(m.user))
    problems = verify_dir(path, m)
    status = "corrupt" if problems else "ok"
    return CheckpointInfo(
        step, tier, str(path), size, status, not problems, "; ".join(problems), dict(m.user)
    )
