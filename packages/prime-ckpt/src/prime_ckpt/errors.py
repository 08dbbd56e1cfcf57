"""Every error and warning prime-ckpt raises, in one place.

Checkpoints: `CheckpointError` and its kinds. Peer transfer: `PeerError` and its kinds (one
except clause catches every failed transfer), plus the per-request outcomes (`PeerFailed`,
`PeerBusy`, `PeerGone`) that the fetcher handles donor by donor and the donor answers with.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, torn or corrupt, or a save that failed."""


class CorruptCheckpoint(CheckpointError):
    """A file disagrees with the manifest, or the manifest is unreadable."""


class StateMismatch(CheckpointError, ValueError):
    """The checkpoint does not fit the given state (keys, shapes, dtypes, layout)."""


class NotCovered(CheckpointError):
    """This source lacks some shards the target needs (e.g. a RAM copy of another layout)."""


class ManifestError(ValueError):
    """A manifest that is missing, unreadable, or from an unknown format."""


class CommitError(RuntimeError):
    """The disk copy of a checkpoint could not be committed."""


class CheckpointWarning(UserWarning):
    """A background save failed; older checkpoints are intact."""


class UsageError(Exception):
    """A user mistake on the `prime-ckpt` command line: printed as one line, exit status 2."""


# ---- peer transfer ----------------------------------------------------------------------


class PeerError(RuntimeError):
    """A peer transfer that could not complete; the message names the peers and reasons."""


class PeerAuthError(PeerError):
    """Authentication failed: a donor refused our requests (wrong run token, clock skew) or
    answered unsigned; on the donor, a request it refuses. `status` is the HTTP code."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


class NoPeerError(PeerError):
    """No donor could be reached, or none had a committed checkpoint to offer."""


class PeerGoneError(PeerError):
    """Every donor of the pinned step and digest died or dropped it mid-transfer."""


class PeerFailed(Exception):
    """One donor failed one request (transport error, bad answer); others may still serve."""


class PeerBusy(PeerFailed):
    """The donor is still verifying its newest checkpoint and has no older verified one
    (HTTP 503): ask again shortly."""


class PeerGone(PeerFailed):
    """The donor no longer has the pinned step or manifest digest (HTTP 410)."""


class PeerRefused(Exception):
    """A donor refuses a path outside the checkpoint or not in its manifest (HTTP 403/404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
