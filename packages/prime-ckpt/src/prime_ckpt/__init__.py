"""prime_ckpt: checkpoints that never stall training.

RAM (shared memory) first, then disk in the background, every file checksummed, committed
atomically, resharded on load.
"""

from prime_ckpt.manager import CheckpointManager
from prime_ckpt.reader import CheckpointError, CorruptCheckpoint, StateMismatch
from prime_ckpt.records import CheckpointInfo, CheckpointWarning, SaveHandle

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointWarning",
    "CorruptCheckpoint",
    "SaveHandle",
    "StateMismatch",
]
