"""The loading half of CheckpointManager: which copies exist (`list`), and loading the newest
that verifies on every rank (RAM, then disk, then remote)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prime_ckpt.bounded import bounded
from prime_ckpt.collectives import all_reduce_int
from prime_ckpt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    NotCovered,
    StateMismatch,
)
from prime_ckpt.manifest import committed_steps, step_dirname
from prime_ckpt.reader import CheckpointSource, Plan, apply_plan, plan_load
from prime_ckpt.records import TIERS, CheckpointInfo, checkpoint_info
from prime_ckpt.remote import REMOTE_LIST_TIMEOUT_S
from prime_ckpt.remote_load import open_remote, settle_remote
from prime_ckpt.uploader import remote_listing
from prime_ckpt.writer import TMP_PREFIX, disk_steps


class Loading:
    """Mixed into CheckpointManager, whose attributes it reads (`_stager`, `disk_dir`,
    `_remote`, `_uploader`, `_failures`, `_lock`, `group`, `rank`, `world`, `_nonce`) and
    whose `wait_staged()` it calls."""

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
            return self._remote.listing.call(
                self._remote.steps, REMOTE_LIST_TIMEOUT_S, f"listing {self._remote.url}"
            )
        except Exception as e:  # an unreachable remote must not stop a local restore
            warnings.warn(f"cannot list {self._remote.url}: {e}", CheckpointWarning, stacklevel=4)
            return []

    @property
    def remote_unreachable(self) -> str | None:
        """Why the remote's listing fails at once for now (it failed or passed its bound a
        moment ago), or None: a caller about to list the same remote otherwise can skip it."""
        error = None if self._remote is None else self._remote.listing.tripped
        return None if error is None else str(error)

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
        self.wait_staged()  # (the load writes the tensors a background staging may read)
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
        self.wait_staged()
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
            steps = self._remote_steps()
            try:
                out += bounded(
                    lambda: remote_listing(self._remote, steps, self._uploader),
                    REMOTE_LIST_TIMEOUT_S,
                    f"reading the manifests of {self._remote.url}",
                )
            except Exception as e:  # as an unreachable remote's listing: warned, left out
                warnings.warn(
                    f"cannot list {self._remote.url}: {e}", CheckpointWarning, stacklevel=2
                )
        return sorted(out, key=lambda c: (-c.step, c.tier != "ram"))
