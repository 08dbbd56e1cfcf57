"""One authenticated HTTP/1.1 keep-alive connection to a donor (standard library http.client)."""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import quote, urlsplit

import msgpack

from prime_ckpt.errors import ManifestError, PeerAuthError, PeerBusy, PeerFailed, PeerGone
from prime_ckpt.manifest import Manifest
from prime_ckpt.peer.auth import H_NONCE, H_RESP_AUTH, check_response, sign_request
from prime_ckpt.peer.catalog import Offer, safe_relpath

_READ = 1 << 20
_RING = 3  # read buffers per connection: one being received, the others being hashed


class _Window:
    """The receive window and read size of a paced connection (`pace` given): about `AHEAD_S`
    of the rate it reached lately, so that a paused reader stops its donor within about that
    long (what is in flight is at most the window), while a fast link is not throttled by a
    small window (16 KiB windows and reads held a loopback transfer to ~20 MB/s). The rate is
    measured over wall time, pace waits included, so a capped or held transfer keeps a small
    window; it starts small and grows by at most `AHEAD_S` / RTT per update."""

    AHEAD_S = 0.1
    MIN, MAX = 64 << 10, 4 << 20  # below 64 KiB, loopback stalled 0.2 s at a time

    @property
    def read(self) -> int:
        """A quarter of the window: the donor keeps sending while a read is written."""
        return min(_READ, self.size // 4)

    def __init__(self) -> None:
        self.size = self.MIN
        self._bytes = 0
        self._since = 0.0

    def start(self, sock: socket.socket) -> None:
        """A new connection: back to the smallest window (its rate is not known yet)."""
        self.size = self.MIN
        self._bytes, self._since = 0, time.monotonic()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.size)

    def count(self, sock: socket.socket, n: int) -> None:
        """`n` bytes were read; resize the window from the rate since the last resize, every
        `AHEAD_S` or every 8 windows read (a fast link gets its window at once; what was
        already buffered when the rate began to count is at most one window of the 8)."""
        self._bytes += n
        now = time.monotonic()
        if now - self._since < self.AHEAD_S and self._bytes < 8 * self.size:
            return
        want = self._bytes / (now - self._since) * self.AHEAD_S
        size = max(self.MIN, min(self.MAX, 1 << max(0, int(want).bit_length() - 1)))
        self._bytes, self._since = 0, now
        if size != self.size:
            self.size = size
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
            except OSError:  # the connection is going away; the next read says so
                pass


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port[/]' -> 'http://host:port'; clear error otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(
            f"peer URL must be a non-empty string like 'http://host:port', got {url!r}"
        )
    u = url.strip()
    if "://" not in u:
        u = "http://" + u
    parts = urlsplit(u)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(
            f"peer URL {url!r} is not of the form 'http://host:port' (from server.url)"
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"peer URL {url!r} has no valid port; use server.url of the donor")
    return f"http://{parts.netloc}"


class Connection:
    """Signed GET requests over one keep-alive connection; reopened after an error. `pace`,
    if given, is called with the size of each read of a file's bytes before it, and may block
    (while the caller's own traffic has the link, or to cap the rate); reads are then small
    and the receive window too."""

    def __init__(
        self, url: str, token: bytes, timeout: float, pace: Callable[[int], object] | None = None
    ) -> None:
        self.url = url
        self._pace = pace
        parts = urlsplit(url)
        self._host, self._port = parts.hostname, parts.port
        self.token = token
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._bufs = [memoryview(bytearray(_READ)) for _ in range(_RING)]
        self._window = _Window() if pace is not None else None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def get(self, path: str, range_header: str = "") -> tuple[http.client.HTTPResponse, str]:
        """A signed GET of `path` (with a Range header if given): (the response, the request's
        nonce, which the response's signature covers)."""
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            if self._window is not None:
                try:
                    self._conn.connect()
                    self._window.start(self._conn.sock)
                except OSError as e:
                    self.close()
                    raise PeerFailed(f"{self.url}: {type(e).__name__}: {e}") from e
        headers = sign_request(self.token, "GET", path, range_header)
        if range_header:
            headers["Range"] = range_header
        try:
            self._conn.request("GET", path, headers=headers)
            resp = self._conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise PeerFailed(f"{self.url}: {type(e).__name__}: {e}") from e
        if resp.status in (200, 206):
            return resp, headers[H_NONCE]
        body = resp.read(4096).decode(errors="replace").strip()
        self.close()
        if resp.status in (401, 403):
            raise PeerAuthError(
                f"peer {self.url} refused authentication (HTTP {resp.status}: {body}); every "
                "node must use the same run token (token=... or PRIME_TOKEN)"
            )
        if resp.status == 410:
            raise PeerGone(f"{self.url}: {body}")
        if resp.status == 503:
            raise PeerBusy(f"{self.url}: {body}")
        raise PeerFailed(f"{self.url} answered HTTP {resp.status}: {body}")

    def index(self) -> Offer:
        """The donor's newest checkpoint, with the manifest checked against its digest."""
        resp, nonce = self.get("/v1/index")
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise PeerFailed(f"{self.url}: index cut off: {e}") from e
        if not check_response(self.token, nonce, body, resp.getheader(H_RESP_AUTH)):
            raise PeerAuthError(
                f"peer {self.url} answered without a valid signature: it does not hold the run "
                "token, or something between us altered the answer"
            )
        try:
            d = msgpack.unpackb(body, raw=False)
            step, digest, mbytes = int(d["step"]), str(d["digest"]), bytes(d["manifest"])
            manifest = Manifest.from_bytes(mbytes)
        except (ManifestError, ValueError, KeyError, TypeError) as e:
            raise PeerFailed(f"{self.url}: malformed index answer: {e}") from e
        if hashlib.sha256(mbytes).hexdigest() != digest or manifest.step != step:
            raise PeerFailed(f"{self.url}: index answer does not match its own digest or step")
        bad = [n for n in manifest.files if not safe_relpath(n)]
        if bad:
            raise PeerFailed(f"{self.url}: manifest lists unsafe paths {bad[:3]}; refused")
        return Offer(step, digest, mbytes, manifest, self.url)

    def read_range(
        self,
        step: int,
        digest: str,
        name: str,
        start: int,
        end: int,
        fd: int,
        sink: Callable[[memoryview], object] | None = None,
        marks: Sequence[int] = (),
        done: Callable[[int], object] | None = None,
    ) -> int:
        """Download bytes [start, end) of file `name` into `fd` at the same offsets, passing
        them in order to `sink` too (a running hash) if given. One request for the whole
        range; `done(mark)` is called as the bytes up to each of `marks` (ascending, inside
        the range) are written, so a caller keeps what arrived before a failure."""
        path = f"/v1/ckpt/{step}/{digest}/{quote(name)}"
        resp, _ = self.get(path, f"bytes={start}-{end - 1}")
        expect = f"bytes {start}-{end - 1}/"
        if resp.status != 206 or not (resp.getheader("Content-Range") or "").startswith(expect):
            self.close()
            raise PeerFailed(f"{self.url}: answered {resp.status} without the requested range")
        pending = [m for m in marks if start < m < end]
        pending.reverse()
        # `sink` (a file hash, which releases the GIL) runs on its own thread over a ring of
        # buffers, so hashing one read overlaps receiving and writing the next
        with ThreadPoolExecutor(1, thread_name_prefix="prime-ckpt-hash") as hashing:
            running: list[Future | None] = [None] * _RING
            pos, i = start, 0
            try:
                while pos < end:
                    if running[i] is not None:
                        running[i].result()  # that buffer is free again
                    n = self._read_into(resp, self._bufs[i], end - pos, pos - start)
                    os.pwrite(fd, self._bufs[i][:n], pos)  # a local error: not the donor's fault
                    if sink is not None:
                        running[i] = hashing.submit(sink, self._bufs[i][:n])
                    pos += n
                    i = (i + 1) % _RING
                    while pending and pending[-1] <= pos and done is not None:
                        done(pending.pop())
            finally:
                for f in running:  # no buffer may be hashed after this call returns
                    if f is not None:
                        f.result()
        return end - start

    def _read_into(self, resp, buf: memoryview, left: int, got: int) -> int:
        """One read of at most `left` bytes of the response body into `buf`, paced."""
        want = min(_READ if self._window is None else self._window.read, left)
        if self._pace is not None:
            self._pace(want)
        try:
            n = resp.readinto(buf[:want])
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise PeerFailed(f"{self.url}: {type(e).__name__}: {e}") from e
        if not n:
            self.close()
            raise PeerFailed(f"{self.url}: connection closed after {got} bytes")
        if self._window is not None and self._conn is not None:
            self._window.count(self._conn.sock, n)
        return n
