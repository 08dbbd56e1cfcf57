"""One authenticated HTTP/1.1 keep-alive connection to a donor (standard library http.client)."""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
from collections.abc import Callable
from urllib.parse import quote, urlsplit

import msgpack

from prime_ckpt.errors import ManifestError, PeerAuthError, PeerBusy, PeerFailed, PeerGone
from prime_ckpt.manifest import Manifest
from prime_ckpt.peer.auth import H_NONCE, H_RESP_AUTH, check_response, sign_request
from prime_ckpt.peer.catalog import Offer, safe_relpath

_READ = 1 << 20
# Paced reads (`pace` given): small reads and a small receive window, so that a paused reader
# stops its donor within a fraction of a second instead of after megabytes in flight
_PACED_READ = 16 << 10
_PACED_RCVBUF = 16 << 10


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
        self._token = token
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._buf = memoryview(bytearray(_READ))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _get(self, path: str, range_header: str = "") -> tuple[http.client.HTTPResponse, str]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            if self._pace is not None:
                try:
                    self._conn.connect()
                    self._conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PACED_RCVBUF)
                except OSError as e:
                    self.close()
                    raise PeerFailed(f"{self.url}: {type(e).__name__}: {e}") from e
        headers = sign_request(self._token, "GET", path, range_header)
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
        resp, nonce = self._get("/v1/index")
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise PeerFailed(f"{self.url}: index cut off: {e}") from e
        if not check_response(self._token, nonce, body, resp.getheader(H_RESP_AUTH)):
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
    ) -> int:
        """Download bytes [start, end) of file `name` into `fd` at the same offsets, passing
        them in order to `sink` too (a running hash) if given."""
        path = f"/v1/ckpt/{step}/{digest}/{quote(name)}"
        resp, _ = self._get(path, f"bytes={start}-{end - 1}")
        expect = f"bytes {start}-{end - 1}/"
        if resp.status != 206 or not (resp.getheader("Content-Range") or "").startswith(expect):
            self.close()
            raise PeerFailed(f"{self.url}: answered {resp.status} without the requested range")
        pos, piece = start, _READ if self._pace is None else _PACED_READ
        while pos < end:
            want = min(piece, end - pos)
            if self._pace is not None:
                self._pace(want)
            try:
                n = resp.readinto(self._buf[:want])
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise PeerFailed(f"{self.url}: {type(e).__name__}: {e}") from e
            if not n:
                self.close()
                raise PeerFailed(f"{self.url}: connection closed after {pos - start} bytes")
            os.pwrite(fd, self._buf[:n], pos)  # a local error (disk full) is not the donor's fault
            if sink is not None:
                sink(self._buf[:n])
            pos += n
        return end - start
