"""Authenticated msgpack framing for the membership channel.

Every TCP connection starts with a nonce exchange (server nonce, then client nonce). After that
each message travels as ``[counter, body, mac]`` where ``body`` is msgpack and ``mac`` is
HMAC-SHA256 keyed by the run token over (protocol tag, direction, both nonces, counter, body).
The body carries the node id and epoch, so the MAC covers them too. Counters start at 1 and
must grow by exactly one per message in each direction, so a message replayed inside a
connection is refused; a message replayed into another connection fails its MAC because the
nonces differ. Nothing is encrypted: the token authenticates, it does not hide.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
from typing import Any

import msgpack

from prime_mesh.errors import MeshAuthError

PROTOCOL = b"prime-mesh/1"
MAX_FRAME = 4 << 20
# The client's hello is {"nonce": 16 bytes}: a few dozen bytes. A server reads no more than
# this before the peer proved it holds the token (its first authenticated message).
HELLO_MAX = 256
_LEN = struct.Struct("!I")


def resolve_token(token: str | bytes | None) -> bytes:
    """The run's shared secret: `token`, else env PRIME_TOKEN; a clear error when neither is set."""
    if token is None:
        token = os.environ.get("PRIME_TOKEN")
    if not token:
        raise MeshAuthError(
            "no token: pass token=... or set the PRIME_TOKEN environment variable to the run's "
            "shared secret (never pass it on the command line)"
        )
    return token.encode() if isinstance(token, str) else bytes(token)


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def frame_bytes(payload: bytes) -> bytes:
    """`payload` with its length prefix."""
    return _LEN.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    """The payload length a 4-byte frame header announces."""
    return _LEN.unpack(header)[0]


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(frame_bytes(payload))


def read_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(read_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise MeshAuthError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    return read_exact(sock, n)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as e:  # any malformed input is a protocol error, never a crash
        raise MeshAuthError(f"malformed message ({type(e).__name__})") from None


class Channel:
    """One authenticated, replay-protected, ordered message stream over a connected socket."""

    def __init__(
        self,
        sock: socket.socket,
        key: bytes,
        send_dir: bytes,
        server_nonce: bytes,
        client_nonce: bytes,
    ) -> None:
        self.sock = sock
        self._key = key
        self._send_dir = send_dir
        self._recv_dir = b"C" if send_dir == b"S" else b"S"
        self._nonces = server_nonce + client_nonce
        self._send_counter = 0
        self._recv_counter = 0
        self._send_lock = threading.Lock()

    def _mac(self, direction: bytes, counter: int, body: bytes) -> bytes:
        msg = PROTOCOL + direction + self._nonces + struct.pack("!Q", counter) + body
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def _next_frame(self, msg: dict) -> bytes:
        body = msgpack.packb(msg, use_bin_type=True)
        self._send_counter += 1
        c = self._send_counter
        return frame_bytes(msgpack.packb([c, body, self._mac(self._send_dir, c, body)]))

    def pack(self, msg: dict) -> bytes:
        """`msg` as the next length-prefixed frame of this stream (its counter taken): bytes to
        write as they are, for a server that writes without blocking."""
        with self._send_lock:
            return self._next_frame(msg)

    def send(self, msg: dict) -> None:
        with self._send_lock:  # held while writing: frames reach the socket in counter order
            self.sock.sendall(self._next_frame(msg))

    def recv(self) -> dict:
        return self.unpack(read_frame(self.sock))

    def unpack(self, payload: bytes) -> dict:
        """The message in one frame's payload, verified (else MeshAuthError)."""
        frame = _unpack(payload)
        if isinstance(frame, dict) and "error" in frame:
            # Unauthenticated refusal: the peer could not verify us, so it cannot sign its answer.
            raise MeshAuthError(f"peer refused the connection: {frame['error']}")
        if not (isinstance(frame, list) and len(frame) == 3):
            raise MeshAuthError("malformed frame (expected [counter, body, mac])")
        counter, body, mac = frame
        if not (isinstance(counter, int) and isinstance(body, bytes) and isinstance(mac, bytes)):
            raise MeshAuthError("malformed frame fields")
        if not hmac.compare_digest(mac, self._mac(self._recv_dir, counter, body)):
            raise MeshAuthError(
                "bad message authentication code: wrong token, or a forged or replayed message"
            )
        if counter != self._recv_counter + 1:
            raise MeshAuthError(
                f"replayed or out-of-order message (counter {counter}, expected {self._recv_counter + 1})"
            )
        self._recv_counter = counter
        msg = _unpack(body)
        if not isinstance(msg, dict):
            raise MeshAuthError("malformed message body (expected a map)")
        return msg

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def server_hello() -> tuple[bytes, bytes]:
    """The server's nonce and its greeting frame (the first bytes of every connection)."""
    nonce = secrets.token_bytes(16)
    return nonce, frame_bytes(msgpack.packb({"hello": PROTOCOL.decode(), "nonce": nonce}))


def server_channel(sock: socket.socket, key: bytes, server_nonce: bytes, hello: bytes) -> Channel:
    """The server's end of the channel, once the client's hello frame (`hello`) arrived."""
    msg = _unpack(hello)
    nonce = msg.get("nonce") if isinstance(msg, dict) else None
    if not (isinstance(nonce, bytes) and len(nonce) == 16):
        raise MeshAuthError("malformed client hello")
    return Channel(sock, key, b"S", server_nonce, nonce)


def client_handshake(sock: socket.socket, key: bytes) -> Channel:
    hello = _unpack(read_frame(sock))
    if not (isinstance(hello, dict) and hello.get("hello") == PROTOCOL.decode()):
        raise MeshAuthError("the peer is not a prime-mesh coordinator (unexpected greeting)")
    nonce = hello.get("nonce")
    if not (isinstance(nonce, bytes) and len(nonce) == 16):
        raise MeshAuthError("malformed coordinator hello")
    client_nonce = secrets.token_bytes(16)
    write_frame(sock, msgpack.packb({"nonce": client_nonce}))
    return Channel(sock, key, b"C", nonce, client_nonce)


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' (IPv6 as '[::1]:port') -> (host, port), with a clear error when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address {address!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    return host.strip("[]"), int(port)
