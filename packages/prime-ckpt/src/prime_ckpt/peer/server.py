"""The donor side: an HTTP server (standard library) that hands out the newest checkpoint.

Routes (all GET, all authenticated, see `auth`):
- `/v1/index`: msgpack {"step", "digest", "manifest"} of the newest committed step that
  verifies, re-evaluated on every call; the response is signed back with the run token.
- `/v1/ckpt/<step>/<digest>/<file>`: bytes of one file of that exact checkpoint, with Range
  support. A step that was pruned, or whose manifest no longer has that digest, is a 410.
- `/v1/files[?hold=NAME]`, `/v1/files/<name>`: side files, when served (`side_files`).

Every index or file request writes or renews a lease on the step (`manifest.write_lease`), so
the donor's CheckpointManager does not prune a step while a peer is downloading it.
"""

from __future__ import annotations

import io
import logging
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import msgpack

from prime_ckpt.errors import PeerAuthError, PeerBusy, PeerGone, PeerRefused
from prime_ckpt.peer.auth import H_RESP_AUTH, Verifier, resolve_token, sign_response
from prime_ckpt.peer.catalog import Catalog
from prime_ckpt.peer.guard import Admission, HandshakeRefused, Limits, RefusalLog, RequestReader
from prime_ckpt.peer.ratelimit import RateLimit
from prime_ckpt.peer.side_files import SideFiles, route

log = logging.getLogger("prime_ckpt.peer")

_WILDCARD = {"", "0.0.0.0", "::"}
_FILE_RE = re.compile(r"^/v1/ckpt/(\d{1,10})/([0-9a-f]{64})/(.+)$")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_PIECE = 256 << 10


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "prime-ckpt-peer/1"
    server: _HTTPServer

    def setup(self) -> None:
        limits = self.server.peer.admission.limits
        self.timeout = limits.idle_s
        super().setup()
        # the header and the file go in separate writes: without this, Nagle held the file's
        # first bytes for the fetcher's delayed ACK (40 ms per request)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # requests are read through the guard instead (`guard`)
        self._reader = RequestReader(self.connection, limits)
        self.rfile = io.BufferedReader(self._reader)
        self.server.track(self.connection, True)

    def handle_one_request(self) -> None:
        self._reader.begin()
        try:
            super().handle_one_request()
        except HandshakeRefused as e:
            self.server.peer.refusals.warn(self.client_address[0], str(e))
            self.close_connection = True

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _text(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        body = (message + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _refuse_method(self) -> None:
        self._reader.end()
        self.close_connection = True  # not a fetcher: one request is all it gets
        self._text(405, f"{self.command} is not supported by a prime-ckpt donor; use GET")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _refuse_method

    def do_GET(self) -> None:
        peer: PeerServer = self.server.peer
        self._reader.end()
        try:
            nonce = peer.authenticate("GET", self.path, self.headers)
        except PeerAuthError as e:
            peer.refusals.warn(self.client_address[0], f"{self.path[:200]}: {e}")
            self.close_connection = True  # nothing more before authentication
            return self._text(e.status, str(e))
        self._reader.authenticated = True
        try:
            if self.path == "/v1/index":
                return self._index(peer, nonce)
            side = route(self.path) if peer.side_files is not None else None
            if side is not None:
                return self._side(peer, nonce, *side)
            m = _FILE_RE.match(self.path)
            if not m:
                return self._text(404, f"no such route {self.path!r}")
            step, digest, name = int(m.group(1)), m.group(2), unquote(m.group(3))
            path, size = peer.catalog.resolve(step, digest, name)
            with peer.catalog.serving(step):
                peer.catalog.hold(step)  # renew the lease while the transfer goes on
                self._send_file(peer, path, size)
        except PeerGone as e:
            self._text(410, str(e))
        except PeerRefused as e:
            peer.refusals.warn(self.client_address[0], f"{self.path[:200]}: {e}")
            self._text(e.status, str(e))

    def _index(self, peer: PeerServer, nonce: str) -> None:
        try:
            offer = peer.catalog.newest(peer.index_budget_s)
        except PeerBusy as e:
            return self._text(503, str(e), {"Retry-After": "1"})
        if offer is None:
            return self._text(404, f"no committed checkpoint that verifies in {peer.disk_dir}")
        peer.catalog.hold(offer.step)
        body = msgpack.packb(
            {"step": offer.step, "digest": offer.digest, "manifest": offer.manifest_bytes},
            use_bin_type=True,
        )
        self._send_signed(peer, nonce, body)

    def _side(self, peer: PeerServer, nonce: str, kind: str, arg: str | None) -> None:
        """A side-file route (see `side_files`): the signed listing, or one file."""
        files = peer.side_files
        assert files is not None
        if kind == "file":
            path, size = files.resolve(unquote(arg or ""))
            return self._send_file(peer, path, size)
        if kind == "release" and arg:
            files.release(arg)
        elif arg:
            try:
                files.hold(arg)
            except ValueError as e:
                return self._text(400, str(e))
        body = msgpack.packb({"files": files.listing()}, use_bin_type=True)
        self._send_signed(peer, nonce, body)

    def _send_signed(self, peer: PeerServer, nonce: str, body: bytes) -> None:
        """A msgpack reply signed for the requester's `nonce` (it checks who answered)."""
        self.send_response(200)
        self.send_header("Content-Type", "application/msgpack")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(H_RESP_AUTH, peer.sign(nonce, body))
        self.end_headers()
        self.wfile.write(body)

    def _send_file(self, peer: PeerServer, path: Path, size: int) -> None:
        rng = self.headers.get("Range")
        start, end = 0, size  # end exclusive
        if rng:
            m = _RANGE_RE.match(rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._text(416, f"unsupported Range {rng!r}; use bytes=START-END")
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:  # suffix range: the last N bytes
                start = max(0, size - int(m.group(2)))
            if start >= end:
                return self._text(
                    416,
                    f"Range {rng!r} outside a {size}-byte file",
                    {"Content-Range": f"bytes */{size}"},
                )
        with open(path, "rb") as f:
            if f.seek(0, 2) != size:
                raise PeerGone(f"{path.name} changed size on this donor; start a new transfer")
            self.send_response(206 if rng else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            self._copy(peer, f, start, end - start)

    def _copy(self, peer: PeerServer, f, offset: int, count: int) -> None:
        if peer.rate_limit is None:
            sent = self.connection.sendfile(f, offset, count) if count else 0
            peer.count_sent(sent)
            if sent != count:  # the file shrank: close, rather than leave the reader waiting
                raise ConnectionAbortedError("file shrank while being served")
            return
        f.seek(offset)
        while count > 0:
            piece = f.read(min(_PIECE, count))
            if not piece:
                raise ConnectionAbortedError("file shrank while being served")
            peer.rate_limit.take(len(piece))
            self.connection.sendall(piece)
            peer.count_sent(len(piece))
            count -= len(piece)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # so that close() joins every handler thread
    block_on_close = True
    peer: PeerServer

    def __init__(self, addr, handler) -> None:
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._dropped = False
        super().__init__(addr, handler)

    def verify_request(self, request, client_address) -> bool:
        return self.peer.admission.admit(request, client_address[0])

    def shutdown_request(self, request) -> None:
        self.peer.admission.release(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        # A fetcher that went away mid-file is routine for a donor, not a traceback.
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)
            dropped = self._dropped
        if add and dropped:  # accepted just as close() ran: end it rather than wait it out
            self._shut(conn)

    def drop_connections(self) -> None:
        with self._conns_lock:
            self._dropped = True
            conns = list(self._conns)
        for c in conns:
            self._shut(c)

    @staticmethod
    def _shut(c: socket.socket) -> None:
        try:
            c.shutdown(socket.SHUT_RDWR)  # wakes handler threads blocked in recv/send
        except OSError:
            pass


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class PeerServer:
    """A running donor. Use `serve_directory` to start one; `.url` for fetchers; `.close()`."""

    def __init__(
        self,
        disk_dir: str | Path,
        host: str,
        port: int = 0,
        token: str | bytes | None = None,
        advertise_host: str | None = None,
        max_bytes_per_s: float | None = None,
        lease_s: float = 120.0,
        files_dir: str | Path | None = None,
        limits: Limits | None = None,
    ) -> None:
        self._token = resolve_token(token)
        self.refusals = RefusalLog()
        self.admission = Admission(limits or Limits(), self.refusals)
        self.disk_dir = Path(disk_dir)
        if not self.disk_dir.is_dir():
            raise FileNotFoundError(
                f"checkpoint folder {self.disk_dir} does not exist; pass the disk_dir of a "
                "CheckpointManager that has saved at least once"
            )
        if host in _WILDCARD and not advertise_host:
            raise ValueError(
                f"serving on {host or 'all interfaces'!r} needs advertise_host=... (the address "
                "peers use to reach this machine), since peers cannot connect to a wildcard"
            )
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError(f"max_bytes_per_s must be positive or None, got {max_bytes_per_s}")
        self.catalog = Catalog(self.disk_dir, lease_s)
        # side files (`side_files`): e.g. a job's log of committed updates, under the same cap
        self.side_files = SideFiles(files_dir, lease_s) if files_dir is not None else None
        self.index_budget_s = 5.0  # how long an index request waits for a verification
        self._verifier = Verifier(self._token)
        self._closing = threading.Event()
        self.rate_limit = RateLimit(max_bytes_per_s, self._closing) if max_bytes_per_s else None
        self._sent = 0
        self._sent_lock = threading.Lock()
        cls = _HTTPServer6 if ":" in host else _HTTPServer
        try:
            self._httpd = cls((host, port), _Handler)
        except OSError as e:
            self.catalog.close()
            raise OSError(f"cannot serve checkpoints on {host}:{port}: {e}") from e
        try:
            self.catalog.newest(0.0)  # start verifying the newest step before anyone asks
        except PeerBusy:
            pass
        self._httpd.peer = self
        self.port = self._httpd.server_address[1]
        shown = advertise_host or host
        self.url = (
            f"http://[{shown}]:{self.port}" if ":" in shown else f"http://{shown}:{self.port}"
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"prime-ckpt-peer:{self.port}",
            daemon=True,
        )
        self._thread.start()
        log.info("serving checkpoints of %s at %s", self.disk_dir, self.url)

    @property
    def bytes_sent(self) -> int:
        """File bytes sent so far (all connections)."""
        return self._sent

    def count_sent(self, n: int) -> None:
        """Add `n` file bytes to `bytes_sent` (called by the connection handlers)."""
        with self._sent_lock:
            self._sent += n

    def held_from(self) -> str | None:
        """The first side-file name a fetcher asked this donor to keep (None: none)."""
        return self.side_files.held_from() if self.side_files is not None else None

    def authenticate(self, method: str, path: str, headers) -> str:
        """The nonce of a request that passes authentication; PeerAuthError (with the HTTP
        status to answer) if it does not."""
        return self._verifier.check(method, path, headers)

    def sign(self, nonce: str, body: bytes) -> str:
        """The signature of a response body to the request with `nonce`."""
        return sign_response(self._token, nonce, body)

    def close(self) -> None:
        """Stop accepting, cut open transfers, and join every thread (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._httpd.shutdown()
        self._thread.join(timeout=10)
        self.catalog.close()  # first, so that no handler still waits on a verification
        self._httpd.drop_connections()
        self._httpd.server_close()  # joins the handler threads

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PeerServer({str(self.disk_dir)!r}, url={self.url!r})"


def serve_directory(
    disk_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | bytes | None = None,
    advertise_host: str | None = None,
    max_bytes_per_s: float | None = None,
    files_dir: str | Path | None = None,
    limits: Limits | None = None,
) -> PeerServer:
    """Share the newest committed checkpoint under `disk_dir` with joining peers.

    `token` defaults to $PRIME_TOKEN. Serving on a wildcard address (0.0.0.0, ::) needs
    `advertise_host`, the address put in `.url`. `max_bytes_per_s` caps the upload rate (all
    connections and routes together). `files_dir`: also serve the side files in that folder
    (see `prime_ckpt.peer.side_files`). `limits`: caps on connections and request headers
    (`prime_ckpt.peer.guard.Limits`; the defaults hold 64 connections, 16 per address, a
    10 s deadline on each request header).
    """
    return PeerServer(
        disk_dir,
        host,
        port,
        token,
        advertise_host,
        max_bytes_per_s,
        files_dir=files_dir,
        limits=limits,
    )
