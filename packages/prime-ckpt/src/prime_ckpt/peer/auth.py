"""Request authentication for peer transfer: an HMAC keyed by the run token, never the token.

Every request carries `X-Prime-Time` (unix seconds), `X-Prime-Nonce` (random hex) and
`X-Prime-Auth`, the HMAC-SHA256 over method, path, Range header, time and nonce. The server
refuses a time more than `MAX_SKEW_S` away from its clock and a nonce it has already seen
within that window, so a captured request cannot be replayed. Responses that carry data the
fetcher trusts (the index) are signed back over the request nonce and the body, so a donor
that does not know the token cannot hand out a forged manifest.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict

from prime_ckpt.errors import PeerAuthError

TOKEN_ENV = "PRIME_TOKEN"
MAX_SKEW_S = 60.0
H_TIME = "X-Prime-Time"
H_NONCE = "X-Prime-Nonce"
H_AUTH = "X-Prime-Auth"
H_RESP_AUTH = "X-Prime-Response-Auth"


class AuthFailure(Exception):
    """A request that failed authentication; `status` is the HTTP code to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def resolve_token(token: str | bytes | None) -> bytes:
    """The run token as bytes: `token` if given, else $PRIME_TOKEN; a clear error if neither."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    if isinstance(token, str):
        token = token.encode()
    if not token:
        raise ValueError(
            "no run token for peer transfer: pass token=... or set the PRIME_TOKEN environment "
            "variable to the run's shared secret (the same on every node)"
        )
    return token


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign_request(
    token: bytes, method: str, path: str, range_header: str = "", now: float | None = None
) -> dict[str, str]:
    """Headers that authenticate one request; a fresh nonce every call."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    return {
        H_TIME: ts,
        H_NONCE: nonce,
        H_AUTH: _mac(token, method.upper(), path, range_header, ts, nonce),
    }


def sign_response(token: bytes, nonce: str, body: bytes) -> str:
    return _mac(token, "response", nonce, hashlib.sha256(body).hexdigest())


def check_response(token: bytes, nonce: str, body: bytes, mac: str | None) -> bool:
    return mac is not None and hmac.compare_digest(sign_response(token, nonce, body), mac)


class NonceCache:
    """Nonces seen within the skew window; a repeat is a replay. Memory is bounded by the
    request rate times the window, since entries older than the window are dropped."""

    def __init__(self, window_s: float = 2 * MAX_SKEW_S) -> None:
        self._window = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, nonce: str) -> bool:
        """Record `nonce`; False when it was already seen (a replay)."""
        now = time.monotonic()
        with self._lock:
            while self._seen:
                oldest, t = next(iter(self._seen.items()))
                if now - t <= self._window:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


class Verifier:
    """Server side: checks signature, clock skew and replay for each request."""

    def __init__(self, token: bytes, max_skew_s: float = MAX_SKEW_S) -> None:
        self._token = token
        self._skew = max_skew_s
        self._nonces = NonceCache(2 * max_skew_s)

    def check(self, method: str, path: str, headers) -> str:
        """Return the request nonce, or raise PeerAuthError naming the problem."""
        ts, nonce, mac = headers.get(H_TIME), headers.get(H_NONCE), headers.get(H_AUTH)
        if not (ts and nonce and mac):
            raise PeerAuthError(
                "unauthenticated request: missing X-Prime-Time/X-Prime-Nonce/X-Prime-Auth "
                "headers (use prime_ckpt.fetch_from_peer with the run token)",
                status=401,
            )
        rng = headers.get("Range", "")
        expect = _mac(self._token, method.upper(), path, rng, ts, nonce)
        if not hmac.compare_digest(expect, mac):
            raise PeerAuthError(
                "authentication failed: bad signature (the fetcher's token differs from this "
                "donor's PRIME_TOKEN)",
                status=401,
            )
        try:
            skew = abs(time.time() - float(ts))
        except ValueError:
            raise PeerAuthError(
                f"authentication failed: malformed timestamp {ts!r}", status=401
            ) from None
        if skew > self._skew:
            raise PeerAuthError(
                f"stale request: timestamp is {skew:.0f}s away from the donor's clock (limit "
                f"{self._skew:.0f}s); synchronise the clocks (NTP) or this is a replay",
                status=403,
            )
        if len(nonce) > 128 or not self._nonces.add(nonce):
            raise PeerAuthError("replayed request: this nonce was already used", status=403)
        return nonce
