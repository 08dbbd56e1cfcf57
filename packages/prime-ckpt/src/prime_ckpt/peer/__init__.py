"""Live peer transfer: a joining node downloads the newest checkpoint from running donors.

server = serve_directory(disk_dir, "127.0.0.1", token=...)   # on a donor
step = fetch_from_peer([server.url], dest, token=...)         # on the joiner
"""

from prime_ckpt.errors import NoPeerError, PeerAuthError, PeerError, PeerGoneError
from prime_ckpt.peer.auth import resolve_token
from prime_ckpt.peer.fetch import PeerFetch, ask_donors, fetch_checkpoint, fetch_from_peer
from prime_ckpt.peer.guard import Limits
from prime_ckpt.peer.ratelimit import LinkGate
from prime_ckpt.peer.server import PeerServer, serve_directory
from prime_ckpt.peer.side_files import SideFileHold, fetch_side_file, list_side_files

__all__ = [
    "NoPeerError",
    "PeerAuthError",
    "PeerError",
    "PeerGoneError",
    "Limits",
    "LinkGate",
    "PeerFetch",
    "PeerServer",
    "SideFileHold",
    "ask_donors",
    "fetch_checkpoint",
    "fetch_from_peer",
    "fetch_side_file",
    "list_side_files",
    "resolve_token",
    "serve_directory",
]
