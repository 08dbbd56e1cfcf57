"""Side files a donor serves beside its checkpoints: small immutable files in one folder (a
training job's log of committed updates, say), listed and downloaded by name.

Donor: `serve_directory(..., files_dir=DIR)` adds two routes (authenticated like the others,
and under the same upload cap):
- `/v1/files[?hold=NAME|?release=NAME]`: signed msgpack `{"files": {name: size}}` of the plain files in DIR
  (names of letters, digits, `.`, `-`, `_`, not starting with `.`: a file being written under a
  hidden name and renamed is never listed half-written). `hold=NAME` asks the donor to keep
  NAME and every file sorting after it for `lease_s` seconds (renewed by asking again):
  `PeerServer.held_from()` tells the donor's own pruning where to stop; `release=NAME` drops
  that hold when the fetcher is done.
- `/v1/files/<name>`: the file's bytes (Range supported). A file pruned meanwhile is a 410.

Fetcher: `list_side_files(url, token, timeout, hold=None)` and `fetch_side_file(url, name,
token, timeout) -> bytes`; `SideFileHold` keeps a hold on every donor while it runs. A side file carries no checksum of its own on the wire: its
content says how to check it (the caller's format).
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import msgpack

from prime_ckpt.errors import PeerAuthError, PeerError, PeerFailed, PeerGone
from prime_ckpt.peer.auth import H_RESP_AUTH, check_response, resolve_token
from prime_ckpt.peer.client import Connection, normalize_url

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")


class SideFiles:
    """The donor's view of its side-file folder, with the fetchers' holds; thread-safe."""

    def __init__(self, folder: str | Path, lease_s: float = 120.0) -> None:
        self.folder = Path(folder)
        self.lease_s = float(lease_s)
        self._holds: dict[str, float] = {}  # name -> monotonic expiry
        self._lock = threading.Lock()

    def listing(self) -> dict[str, int]:
        """{name: size} of the files offered now."""
        out: dict[str, int] = {}
        try:
            entries = list(self.folder.iterdir())
        except FileNotFoundError:
            return out
        for p in entries:
            if NAME_RE.match(p.name):
                try:
                    st = p.stat()
                except FileNotFoundError:  # pruned between listing and stat
                    continue
                if p.is_file():
                    out[p.name] = st.st_size
        return out

    def hold(self, name: str) -> None:
        """Keep `name` and the files sorting after it for `lease_s` seconds."""
        if not NAME_RE.match(name):
            raise ValueError(f"bad side-file name {name!r}")
        with self._lock:
            self._holds[name] = time.monotonic() + self.lease_s

    def release(self, name: str) -> None:
        """Drop the hold on `name` (the fetcher is done; another renews its own within its
        renewal interval)."""
        with self._lock:
            self._holds.pop(name, None)

    def held_from(self) -> str | None:
        """The first name any live hold keeps (None: nothing is held)."""
        now = time.monotonic()
        with self._lock:
            for k in [k for k, t in self._holds.items() if t < now]:
                del self._holds[k]
            return min(self._holds) if self._holds else None

    def resolve(self, name: str) -> tuple[Path, int]:
        """Path and size of side file `name`; PeerGone when it is not (or no longer) there."""
        if not NAME_RE.match(name):
            raise PeerGone(f"{name!r} is not a side-file name")
        path = self.folder / name
        try:
            if path.is_file():
                return path, path.stat().st_size
        except OSError:
            pass
        raise PeerGone(f"side file {name!r} is no longer on this donor (pruned)")


def route(path: str) -> tuple[str, str | None] | None:
    """("list", hold), ("release", name) or ("file", name) for a side-file request path;
    None for another route."""
    parts = urlsplit(path)
    if parts.path == "/v1/files":
        query = parse_qs(parts.query)
        if "release" in query:
            return "release", query["release"][0]
        return "list", query.get("hold", [None])[0]
    if parts.path.startswith("/v1/files/"):
        return "file", parts.path[len("/v1/files/") :]
    return None


def list_side_files(
    url: str,
    token: str | bytes | None = None,
    timeout: float = 20.0,
    hold: str | None = None,
    release: str | None = None,
) -> dict[str, int]:
    """{name: size} of the side files the donor at `url` offers (signed answer); `hold`: ask
    it to keep that name and the ones after it (see module doc), `release`: to drop such a
    hold. PeerError when it cannot."""
    conn = Connection(normalize_url(url), resolve_token(token), timeout)
    path = "/v1/files"
    if release:
        path += f"?release={quote(release)}"
    elif hold:
        path += f"?hold={quote(hold)}"
    try:
        resp, nonce = conn.get(path)
        body = resp.read()
        if not check_response(conn.token, nonce, body, resp.getheader(H_RESP_AUTH)):
            raise PeerAuthError(f"peer {url} listed its side files without a valid signature")
        files = msgpack.unpackb(body, raw=False)["files"]
        return {str(k): int(v) for k, v in files.items()}
    except PeerError:
        raise
    except (PeerFailed, OSError, http.client.HTTPException, KeyError, ValueError) as e:
        raise PeerError(f"{url}: listing side files failed: {e}") from e
    finally:
        conn.close()


def fetch_side_file(
    url: str, name: str, token: str | bytes | None = None, timeout: float = 20.0
) -> bytes:
    """The bytes of side file `name` from the donor at `url`; PeerError when it cannot."""
    if not NAME_RE.match(name):
        raise ValueError(f"bad side-file name {name!r}")
    conn = Connection(normalize_url(url), resolve_token(token), timeout)
    try:
        resp, _ = conn.get(f"/v1/files/{quote(name)}")
        length = int(resp.getheader("Content-Length") or -1)
        body = resp.read()
        if length >= 0 and len(body) != length:
            raise PeerError(f"{url}: side file {name} cut off at {len(body)} of {length} bytes")
        return body
    except PeerError:
        raise
    except (PeerFailed, OSError, http.client.HTTPException, ValueError) as e:
        raise PeerError(f"{url}: fetching side file {name} failed: {e}") from e
    finally:
        conn.close()


class SideFileHold:
    """A fetcher's hold on the side files from `name` on, on every donor `donors()` lists
    (their urls), while it runs (`with`): asked again every `renew_s` (well within the
    donors' lease, so a fetcher that dies lets its holds lapse), moved on by `hold_from`, and
    released on exit. A donor that does not answer is asked again at the next renewal."""

    def __init__(
        self,
        donors: Callable[[], list[str]],
        token: str | bytes | None,
        name: str,
        renew_s: float = 10.0,
        timeout: float = 20.0,
    ) -> None:
        self.name = name
        self._donors, self._token = donors, token
        self._renew_s, self._timeout = renew_s, timeout
        self._stop = threading.Event()
        self._held: set[tuple[str, str]] = set()  # (url, name) holds asked for
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="prime-ckpt-hold", daemon=True)

    def __enter__(self) -> SideFileHold:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._timeout + 5)
        with self._lock:
            for url, name in self._held:  # done: the donors may prune again, not a lease later
                try:
                    list_side_files(url, self._token, 5.0, release=name)
                except PeerError:
                    pass
            self._held.clear()

    def hold_from(self, name: str, now: bool = True) -> None:
        """Hold from `name` on instead; `now`: ask every donor at once (else at the next
        renewal)."""
        self.name = name
        if now:
            self.renew()

    def renew(self) -> None:
        """Ask every donor now (failures are the next renewal's)."""
        with self._lock:
            try:
                urls = self._donors()
            except Exception:  # the caller's list is briefly unavailable: the next renewal
                urls = []
            for url in urls:
                self._ask(url, self.name)

    def _ask(self, url: str, name: str) -> None:
        try:
            list_side_files(url, self._token, self._timeout, hold=name)
        except PeerError:
            return
        for old in [h for h in self._held if h[0] == url and h[1] != name]:
            try:  # the hold moved on: drop the older one
                list_side_files(url, self._token, self._timeout, release=old[1])
                self._held.discard(old)
            except PeerError:
                pass
        self._held.add((url, name))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.renew()
            self._stop.wait(self._renew_s)
