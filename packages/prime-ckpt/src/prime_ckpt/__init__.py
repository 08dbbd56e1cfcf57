"""prime_ckpt: checkpoints that never stall training.

RAM (shared memory) first, then disk in the background, every file checksummed, committed
atomically, resharded on load; copied to remote storage (fsspec) and handed to joining
peers over authenticated HTTP.
"""

from prime_ckpt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    NoPeerError,
    PeerAuthError,
    PeerError,
    PeerGoneError,
    StateMismatch,
)
from prime_ckpt.manager import CheckpointManager
from prime_ckpt.manifest import committed_steps
from prime_ckpt.peer import fetch_from_peer, serve_directory
from prime_ckpt.records import TIERS, CheckpointInfo, SaveHandle

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "CorruptCheckpoint",
    "NoPeerError",
    "PeerAuthError",
    "PeerError",
    "PeerGoneError",
    "SaveHandle",
    "StateMismatch",
    "TIERS",
    "committed_steps",
    "fetch_from_peer",
    "serve_directory",
]
