"""prime_ckpt: checkpoints that never stall training.

RAM (shared memory) first, then disk in the background, every file checksummed, committed
atomically, resharded on load; copied to remote storage (fsspec) and handed to joining
peers over authenticated HTTP.
"""

from prime_ckpt.manager import CheckpointManager
from prime_ckpt.peer import (
    NoPeerError,
    PeerAuthError,
    PeerError,
    PeerGoneError,
    fetch_from_peer,
    serve_directory,
)
from prime_ckpt.reader import CheckpointError, CorruptCheckpoint, StateMismatch
from prime_ckpt.records import CheckpointInfo, CheckpointWarning, SaveHandle

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
    "fetch_from_peer",
    "serve_directory",
]
