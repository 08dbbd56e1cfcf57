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
from prime_ckpt.failures import CheckpointFailure
from prime_ckpt.manager import CheckpointManager
from prime_ckpt.manifest import committed_steps, step_dirname
from prime_ckpt.peer import (
    LinkGate,
    PeerFetch,
    SideFileHold,
    ask_donors,
    fetch_checkpoint,
    fetch_from_peer,
    fetch_side_file,
    list_side_files,
    resolve_token,
    serve_directory,
)
from prime_ckpt.reader import CheckpointSource, read_tensor, tensor_paths
from prime_ckpt.records import TIERS, CheckpointInfo, SaveHandle
from prime_ckpt.state import is_dtensor, shard_rows

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointFailure",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointSource",
    "CheckpointWarning",
    "CorruptCheckpoint",
    "LinkGate",
    "NoPeerError",
    "PeerAuthError",
    "PeerError",
    "PeerFetch",
    "PeerGoneError",
    "SaveHandle",
    "SideFileHold",
    "StateMismatch",
    "TIERS",
    "ask_donors",
    "committed_steps",
    "fetch_checkpoint",
    "fetch_from_peer",
    "fetch_side_file",
    "is_dtensor",
    "list_side_files",
    "read_tensor",
    "resolve_token",
    "serve_directory",
    "shard_rows",
    "step_dirname",
    "tensor_paths",
]
