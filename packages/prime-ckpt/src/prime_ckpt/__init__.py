"""prime_ckpt: checkpoints that never stall training.

RAM (shared memory) first, then disk in the background, every file checksummed, committed
atomically, resharded on load.
"""

from prime_ckpt.manager import CheckpointInfo, CheckpointManager, CheckpointWarning, SaveHandle
from prime_ckpt.reader import CheckpointError, CorruptCheckpoint, StateMismatch

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
