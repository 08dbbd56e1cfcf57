"""Parallel, resumable download of one pinned checkpoint into a partial folder.

Files are cut into chunks fetched with Range requests by `connections` worker threads, each
on its own keep-alive connection, spread over the donors that offer the pinned digest. A
chunk is recorded in the folder's journal (`.progress`) once its bytes are written, so a rerun
after a crash only fetches what is missing; the final hash check catches anything the
journal claims but the disk lost. A donor that fails twice in a row, or answers 410, is
dropped and its chunks go to the remaining donors; when none is left the transfer fails.

Helpers (donors of the same step under another digest, `peer/shared.py`) serve only the
byte ranges of the shared tensors (`shared`); the pinned digest's donors serve the rest first,
then help with the shared ranges. Losing every helper only slows the transfer down.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_ckpt.errors import PeerAuthError, PeerError, PeerFailed, PeerGone, PeerGoneError
from prime_ckpt.manifest import Manifest
from prime_ckpt.peer.client import Connection
from prime_ckpt.peer.journal import Journal
from prime_ckpt.peer.writeback import start_writeback

log = logging.getLogger("prime_ckpt.peer")

_STRIKES = 2  # consecutive failures before a donor is dropped
_SPAN = 32 << 20  # the most one request asks for (consecutive chunks; each journaled alone)


@dataclass
class _Chunk:
    name: str
    start: int
    end: int
    tries: int = 0
    shared: bool = False  # inside a range that helpers may serve too


class _Todo:
    """Chunks waiting for a worker. A deque under a lock, polled: a blocking
    `queue.SimpleQueue.get(timeout=...)` was seen to hang past its timeout on CPython 3.11
    while a child process was being stopped (SIGSTOP), so no timed queue wait is used."""

    def __init__(self) -> None:
        self._items: deque[_Chunk] = deque()
        self._lock = threading.Lock()

    def put(self, chunk: _Chunk) -> None:
        with self._lock:
            self._items.append(chunk)

    def take(self, span: int = 1) -> list[_Chunk]:
        """The next chunk and those that follow it in the same file, up to `span` bytes in
        all (one request for them: a request per 1 MiB chunk cost more than the bytes)."""
        with self._lock:
            if not self._items:
                return []
            run = [self._items.popleft()]
            while self._items and run[-1].end - run[0].start < span:
                nxt = self._items[0]
                if nxt.name != run[-1].name or nxt.start != run[-1].end:
                    break
                if nxt.end - run[0].start > span:
                    break
                run.append(self._items.popleft())
            return run


class _Hashes:
    """The hash of each file (`new`: a hasher) computed from the bytes as they arrive, as long as its chunks come
    in order (always with one connection); whatever did not is read back from disk at the end.
    A worker claims a file's stream for one chunk and hashes into a copy of the state, which
    replaces it only if the chunk completes, so a failed chunk leaves no trace."""

    def __init__(self, new: Callable[[], Any]) -> None:
        self._new = new
        self._files: dict[str, list] = {}  # name -> [bytes hashed, hasher, claimed]
        self._lock = threading.Lock()

    def claim(self, name: str, start: int):
        with self._lock:
            st = self._files.setdefault(name, [0, self._new(), False])
            if st[2] or st[0] != start:
                return None
            st[2] = True
            return st[1].copy()

    def release(self, name: str, hasher, end: int | None) -> None:
        with self._lock:
            st = self._files[name]
            st[2] = False
            if end is not None:
                st[0], st[1] = end, hasher

    def finish(self, name: str, path: Path) -> str:
        with self._lock:
            upto, hasher, _ = self._files.pop(name, None) or [0, self._new(), False]
        with open(path, "rb") as f:
            f.seek(upto)
            while chunk := f.read(8 << 20):
                hasher.update(chunk)
        return hasher.hexdigest()


class _Donors:
    """The donors of the pinned digest that are still usable, and why others were dropped."""

    def __init__(self, urls: list[str]) -> None:
        self._alive = list(urls)
        self.count = len(urls)  # donors at the start
        self._strikes = dict.fromkeys(urls, 0)
        self.dropped: dict[str, str] = {}
        self._lock = threading.Lock()

    def alive(self) -> list[str]:
        with self._lock:
            return list(self._alive)

    def ok(self, url: str) -> None:
        self._strikes[url] = 0

    def fail(self, url: str, reason: str, fatal: bool = False) -> None:
        with self._lock:
            self._strikes[url] = self._strikes.get(url, 0) + 1
            if (fatal or self._strikes[url] >= _STRIKES) and url in self._alive:
                self._alive.remove(url)
                self.dropped[url] = reason
                log.warning("dropped donor %s: %s (%d left)", url, reason, len(self._alive))

    def empty(self) -> bool:
        with self._lock:
            return not self._alive


class Download:
    """Fetch the missing chunks of `manifest` into `folder` from `urls` (same digest)."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        digest: str,
        urls: list[str],
        token: bytes,
        connections: int,
        timeout: float,
        chunk_bytes: int,
        helpers: dict[str, str] | None = None,
        shared: dict[str, list[tuple[int, int]]] | None = None,
        pace: Callable[[int], object] | None = None,
    ) -> None:
        self.folder, self.manifest, self.digest = folder, manifest, digest
        self.pace = pace  # called with each read's size before it (`Connection`)
        self.token, self.connections, self.timeout = token, connections, timeout
        self.chunk_bytes = chunk_bytes
        self.donors = _Donors(urls)
        self.helper_digests = dict(helpers or {})  # helper url -> the digest it serves
        self.helpers = _Donors(list(self.helper_digests))
        self.shared = shared or {}
        self.by_donor: dict[str, int] = {}  # bytes each donor served in this run
        self.journal = Journal(folder)
        self.fetched = 0  # bytes downloaded by this run (not counting resumed ones)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._remaining = 0
        self._pending: dict[str, int] = {}  # file -> chunks still to fetch in this run
        self.checked: dict[str, bool] = {}  # file -> matched its hash (hashed right away)
        self._hashes = _Hashes(manifest.hasher)

    def _open_files(self) -> dict[str, int]:
        fds = {}
        for name, entry in self.manifest.files.items():
            p = self.folder / name
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size != entry.size:
                os.ftruncate(fd, entry.size)
            fds[name] = fd
        return fds

    def drop_helpers(self, reason: str) -> None:
        """Serve everything from the pinned digest's donors from now on."""
        for url in self.helpers.alive():
            self.helpers.fail(url, reason, fatal=True)

    def _pieces(self, name: str, size: int) -> list[tuple[int, int, bool]]:
        """[start, end, shared] spans of a file, cut where the shared ranges start and end."""
        out, pos = [], 0
        for s, e in self.shared.get(name, ()) if self.helpers.alive() else ():
            s, e = max(s, pos), min(e, size)
            if s >= e:
                continue
            if pos < s:
                out.append((pos, s, False))
            out.append((s, e, True))
            pos = e
        if pos < size:
            out.append((pos, size, False))
        return out

    def run(self) -> None:
        """Download everything the journal does not list; raises PeerError on failure."""
        done = self.journal.load()
        self._own, self._shared = _Todo(), _Todo()
        total = 0
        for name, entry in sorted(self.manifest.files.items()):
            for lo, hi, shared in self._pieces(name, entry.size):
                for start in range(lo, hi, self.chunk_bytes):
                    end = min(hi, start + self.chunk_bytes)
                    if not Journal.covers(done, name, start, end):
                        (self._shared if shared else self._own).put(
                            _Chunk(name, start, end, shared=shared)
                        )
                        self._remaining += 1
                        self._pending[name] = self._pending.get(name, 0) + 1
                        total += end - start
        if not self._remaining:
            return
        fds = self._open_files()
        count = min(max(self.connections, len(self._all())), self._remaining)
        # runs short enough that every worker gets several: the donors share the work
        self._span = max(self.chunk_bytes, min(_SPAN, total // (4 * count)))
        try:
            workers = [
                threading.Thread(
                    target=self._work,
                    args=(i, fds),
                    daemon=True,
                    name=f"prime-ckpt-fetch-{i}",
                )
                for i in range(count)
            ]
            for w in workers:
                w.start()
            self._watch(workers, total)
        finally:
            for fd in fds.values():
                os.close(fd)
            self.journal.close()
        if self._error is not None:
            raise self._error
        if self._remaining:
            reasons = "; ".join(f"{u}: {r}" for u, r in self.donors.dropped.items())
            raise PeerGoneError(
                f"no donor of step {self.manifest.step} (digest {self.digest[:16]}...) is left "
                f"({reasons}); what was downloaded is kept in {self.folder} and a rerun resumes it"
            )

    def _watch(self, workers: list[threading.Thread], total: int) -> None:
        t0 = last = time.monotonic()
        while any(w.is_alive() for w in workers):
            time.sleep(0.05)
            if time.monotonic() - last >= 2.0:
                last = time.monotonic()
                mb = self.fetched / 1e6
                log.info(
                    "fetching step %d: %.1f / %.1f MB (%.1f MB/s)",
                    self.manifest.step,
                    mb,
                    total / 1e6,
                    mb / max(1e-9, last - t0),
                )

    def _finished(self) -> bool:
        return self._remaining == 0 or self._error is not None or self.donors.empty()

    def _all(self) -> list[str]:
        return self.donors.alive() + self.helpers.alive()

    def _take(self, helper: bool) -> list[_Chunk]:
        """A helper takes shared chunks only; a donor of the pinned digest its own first."""
        if helper:
            return self._shared.take(self._span)
        return self._own.take(self._span) or self._shared.take(self._span)

    def _requeue(self, chunk: _Chunk) -> None:
        (self._shared if chunk.shared else self._own).put(chunk)

    def _chunk_done(self, url: str, chunk: _Chunk, fd: int) -> None:
        """One chunk is written: journal it, count it, and hash its file once complete."""
        start_writeback(fd, chunk.start, chunk.end - chunk.start)
        self.journal.mark(chunk.name, chunk.start, chunk.end)
        with self._lock:
            self.fetched += chunk.end - chunk.start
            self.by_donor[url] = self.by_donor.get(url, 0) + chunk.end - chunk.start
            self._remaining -= 1
            self._pending[chunk.name] -= 1
            complete = self._pending[chunk.name] == 0
        if complete:  # finish the hash now, while other workers keep the network busy
            entry = self.manifest.files[chunk.name]
            digest = self._hashes.finish(chunk.name, self.folder / chunk.name)
            self.checked[chunk.name] = digest == entry.digest

    def _fetch_run(self, conn: Connection, url: str, run: list[_Chunk], fd: int) -> None:
        """Fetch consecutive chunks of one file in one request; the chunks that arrived before
        a failure are kept, the others requeued, and the failure raised."""
        first, last = run[0], run[-1]
        for c in run:
            c.tries += 1
        hasher = self._hashes.claim(first.name, first.start)
        ends = {c.end: c for c in run}
        finished: list[_Chunk] = []

        def done(mark: int) -> None:
            finished.append(ends[mark])
            self._chunk_done(url, ends[mark], fd)

        try:
            conn.read_range(
                self.manifest.step,
                self.helper_digests.get(url, self.digest),
                first.name,
                first.start,
                last.end,
                fd,
                hasher.update if hasher else None,
                marks=[c.end for c in run[:-1]],
                done=done,
            )
        except BaseException:
            # the hash state holds bytes past the last whole chunk: the file is read back
            self._hashes.release(first.name, hasher, None)
            for c in run[len(finished) :]:
                self._requeue(c)
            raise
        self._hashes.release(first.name, hasher, last.end if hasher else None)
        self._chunk_done(url, last, fd)

    def _work(self, slot: int, fds: dict[str, int]) -> None:
        conn: Connection | None = None
        max_tries = 2 * _STRIKES * (self.donors.count + self.helpers.count) + 2
        try:
            while not self._finished():
                alive = self._all()
                if not alive:
                    return
                url = alive[slot % len(alive)]  # the slots spread over the donors left
                helper = url in self.helper_digests
                run = self._take(helper)
                if not run:  # all taken; one may come back if its donor fails
                    time.sleep(0.02)
                    continue
                pool = self.helpers if helper else self.donors
                if conn is None or conn.url != url:
                    if conn is not None:
                        conn.close()
                    conn = Connection(url, self.token, self.timeout, self.pace)
                try:
                    self._fetch_run(conn, url, run, fds[run[0].name])
                except PeerGone as e:
                    pool.fail(url, str(e), fatal=True)
                    continue
                except PeerFailed as e:
                    pool.fail(url, str(e))
                    if run[-1].tries >= max_tries:
                        raise PeerError(
                            f"{run[-1].name}: gave up after {run[-1].tries} tries: {e}"
                        ) from e
                    continue
                pool.ok(url)
        except (PeerAuthError, PeerError, OSError) as e:
            with self._lock:
                self._error = self._error or e
        except Exception as e:  # a bug must end the transfer, never leave a chunk orphaned
            log.exception("fetch worker %d failed", slot)
            with self._lock:
                self._error = self._error or PeerError(f"internal error in a fetch worker: {e!r}")
        finally:
            if conn is not None:
                conn.close()
