"""The joining side: pick the newest checkpoint the donors offer, download it, commit it.

The download goes into `dest/.peer-step-<step>-<digest prefix>.partial/` (a name that no
checkpoint reader treats as committed), which is kept when a transfer fails so that a rerun
resumes it. Once every file matches its hash the folder is fsynced and renamed to
`dest/step-<step>/`, so `CheckpointManager(disk_dir=dest)` sees either nothing or all of it.

With `shared` key prefixes (`fetch_checkpoint`), donors of the same step whose checkpoints
differ (each node's own optimizer moments) help with the tensors they hold alike
(`peer/shared.py`), and when every donor of the chosen digest dies mid-transfer another
donor's checkpoint is taken, keeping the shared bytes already downloaded.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prime_ckpt.errors import (
    ManifestError,
    NoPeerError,
    PeerAuthError,
    PeerBusy,
    PeerError,
    PeerFailed,
    PeerGoneError,
)
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    fsync_dir,
    read_manifest,
    step_dirname,
    verify_dir,
)
from prime_ckpt.peer.auth import resolve_token
from prime_ckpt.peer.catalog import Offer
from prime_ckpt.peer.client import Connection, normalize_url
from prime_ckpt.peer.journal import JOURNAL, Journal
from prime_ckpt.peer.shared import meta_files, read_file, shared_plan
from prime_ckpt.peer.transfer import Download

log = logging.getLogger("prime_ckpt.peer")

DEFAULT_CHUNK_BYTES = 8 << 20
_PARTIAL_RE = re.compile(r"^\.peer-step-(\d{10})-[0-9a-f]{16}\.partial$")


def partial_dirname(step: int, digest: str) -> str:
    return f".peer-{step_dirname(step)}-{digest[:16]}.partial"


def ask_donors(urls: list[str], token: bytes, timeout: float) -> list[Offer]:
    """Every reachable donor's offer (`.step`, `.digest`, `.url`), asked in parallel with
    `token` (bytes: see resolve_token) and `timeout` seconds each; NoPeerError /
    PeerAuthError when there is none."""

    def ask(url: str) -> Offer | Exception:
        conn = Connection(url, token, timeout)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    return conn.index()
                except PeerBusy as e:  # verifying a fresh checkpoint: worth waiting for
                    if time.monotonic() + 0.5 > deadline:
                        return e
                    time.sleep(0.5)
                except (PeerFailed, PeerError) as e:
                    return e
        finally:
            conn.close()

    with ThreadPoolExecutor(len(urls), thread_name_prefix="prime-ckpt-index") as pool:
        answers = list(pool.map(ask, urls))
    offers = [a for a in answers if isinstance(a, Offer)]
    for url, a in zip(urls, answers, strict=True):
        if not isinstance(a, Offer) and offers:
            log.warning("donor %s skipped: %s", url, a)
    if offers:
        return offers
    auth = [a for a in answers if isinstance(a, PeerAuthError)]
    if auth:
        raise PeerAuthError("; ".join(map(str, auth)))
    reasons = "\n  ".join(f"{u}: {a}" for u, a in zip(urls, answers, strict=True))
    raise NoPeerError(
        f"no peer could offer a checkpoint (tried {len(urls)}):\n  {reasons}\ncheck that the "
        "donors are running (server.url) and reachable from this machine"
    )


def choose(offers: list[Offer], differ: bool = False) -> tuple[Offer, list[str]]:
    """The newest step; among donors of that step, the digest most of them offer (ties: the
    first in the given order). Returns that offer and every URL offering the same digest.
    `differ`: the donors' checkpoints are expected to differ (each holds its own state)."""
    newest = max(o.step for o in offers)
    same_step = [o for o in offers if o.step == newest]
    counts = Counter(o.digest for o in same_step)
    best = max(same_step, key=lambda o: (counts[o.digest], -same_step.index(o)))
    if len(counts) > 1:
        (log.info if differ else log.warning)(
            "donors disagree on step %d (%d digests); taking %s... offered by %d",
            newest,
            len(counts),
            best.digest[:16],
            counts[best.digest],
        )
    return best, [o.url for o in same_step if o.digest == best.digest]


def _already_have(target: Path, offer: Offer) -> bool:
    """True if `target` already holds this exact checkpoint; refuses to overwrite another."""
    if not target.exists():
        return False
    try:
        same = read_manifest(target).digest() == offer.digest
    except ManifestError:
        same = False
    problems = verify_dir(target, offer.manifest) if same else []
    if same and not problems:
        return True
    what = f"fails its checksums ({problems[0]})" if same else "holds another checkpoint"
    raise PeerError(
        f"{target} already exists and {what}, while the donors offer digest "
        f"{offer.digest[:16]}...; refusing to overwrite it: move it away or fetch into another dest"
    )


def _drop_stale_partials(dest: Path, step: int) -> None:
    """Partial downloads of this or older steps can no longer be useful once `step` is in."""
    for p in dest.iterdir():
        m = _PARTIAL_RE.match(p.name)
        if m and int(m.group(1)) <= step:
            shutil.rmtree(p, ignore_errors=True)


def _verify(folder: Path, offer: Offer, workers: int, checked: dict[str, bool]) -> set[str]:
    """Files that fail their hash; those already hashed (in `checked`) are not read again,
    and the others are added to it."""
    names = sorted(set(offer.manifest.files) - set(checked))

    def bad(name: str) -> bool:
        return offer.manifest.file_problem(name, folder / name) is not None

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="prime-ckpt-verify") as pool:
        checked.update(zip(names, (not b for b in pool.map(bad, names)), strict=True))
    return {n for n, ok in checked.items() if not ok}


def _checked_urls(
    urls: str | Sequence[str], connections: int, timeout: float, chunk_bytes: int
) -> list[str]:
    """The donor URLs, normalized and without repeats; ValueError for bad settings."""
    if isinstance(urls, str):
        urls = [urls]
    urls = list(dict.fromkeys(normalize_url(u) for u in urls))
    if not urls:
        raise ValueError("fetch_from_peer needs at least one donor URL (a server's .url)")
    if not isinstance(connections, int) or not isinstance(chunk_bytes, int):
        raise ValueError("connections and chunk_bytes must be ints")
    if connections < 1 or timeout <= 0 or chunk_bytes < 1:
        raise ValueError("connections and chunk_bytes must be >= 1 and timeout > 0")
    return urls


def _open_partial(dest: Path, offer: Offer, donors: list[str]) -> Path:
    """The partial folder of this offer under `dest`, holding its manifest (kept from an
    earlier run, whose finished chunks the download resumes)."""
    folder = dest / partial_dirname(offer.step, offer.digest)
    folder.mkdir(exist_ok=True)
    (folder / MANIFEST_NAME).write_bytes(offer.manifest_bytes)
    size = sum(e.size for e in offer.manifest.files.values())
    log.info(
        "fetching step %d (%.1f MB, %d files) from %d donor(s)",
        offer.step,
        size / 1e6,
        len(offer.manifest.files),
        len(donors),
    )
    return folder


def _download_verified(download: Download, offer: Offer, workers: int) -> None:
    """Run `download` until every file matches its hash: files that fail are fetched once
    more, then it is a PeerError (the donors serve corrupt files), as is a local write error."""
    folder = download.folder
    try:
        for attempt in range(2):
            download.run()
            bad = _verify(folder, offer, workers, download.checked)
            if not bad:
                return
            if attempt:
                raise PeerError(
                    f"{sorted(bad)[:3]} failed their checksum twice after download; the donors "
                    f"serve corrupt files (partial download kept in {folder})"
                )
            log.warning("%d file(s) failed their checksum; fetching them again", len(bad))
            if download.helpers.alive():  # a helper's bytes differ after all: none of theirs
                download.drop_helpers("a file it helped with failed its checksum")
            download.journal.forget(bad)
            for name in bad:
                del download.checked[name]
                (folder / name).unlink()
    except OSError as e:
        raise PeerError(f"cannot write the checkpoint into {folder}: {e}") from e


def _commit(folder: Path, target: Path, offer: Offer) -> bool:
    """Sync the verified `folder` and rename it to `target`, then drop partials it makes
    useless; False (and `folder` removed) when another fetcher committed it meanwhile."""
    (folder / JOURNAL).unlink(missing_ok=True)
    for name in offer.manifest.files:  # resumed files too: an earlier run never synced them
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in {(folder / n).parent for n in offer.manifest.files} | {folder}:
        fsync_dir(d)
    if _already_have(target, offer):  # another fetcher committed it meanwhile
        shutil.rmtree(folder, ignore_errors=True)
        return False
    os.rename(folder, target)
    fsync_dir(target.parent)
    _drop_stale_partials(target.parent, offer.step)
    return True


def fetch_from_peer(
    urls: str | Sequence[str],
    dest: str | Path,
    token: str | bytes | None = None,
    connections: int = 4,
    timeout: float = 20.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Download the newest checkpoint the donors at `urls` offer into `dest`; returns its step.

    Parallel Range requests over `connections` connections, every file checked against its
    hash (the manifest's), resumable after a crash, failing over only to donors of the same manifest digest.
    `timeout` bounds every connect and read; `token` defaults to $PRIME_TOKEN.
    """
    return fetch_checkpoint(urls, dest, token, connections, timeout, chunk_bytes).step


@dataclass
class PeerFetch:
    """What `fetch_checkpoint` did: the step committed into `dest`, the donor whose checkpoint
    it is (`primary`, its URL: the source of everything not shared), and the bytes each donor
    served (primaries that died mid-transfer included)."""

    step: int
    primary: str
    bytes_by_donor: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    primaries: int = 1  # checkpoints started (> 1: every donor of one died mid-transfer)
    commit_seconds: float = 0.0  # of `seconds`, the fsync and rename once every byte was in


def _primary_metas(
    folder: Path, offer: Offer, donors: list[str], key: bytes, timeout: float
) -> dict[str, bytes]:
    """The tensor tables of the chosen checkpoint, written into its partial folder (and its
    journal, so the download skips them): what the helpers' tables are compared with."""
    metas = {m: read_file(donors, offer, m, key, timeout) for m in meta_files(offer)}
    journal = Journal(folder)
    try:
        for name, data in metas.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
            journal.mark(name, 0, len(data))
    finally:
        journal.close()
    return metas


def _log_fetched(step: int, target: Path, download: Download, seconds: float) -> None:
    log.info(
        "fetched step %d into %s: %.1f MB new in %.1fs (%.1f MB/s) from %d donor(s)",
        step,
        target,
        download.fetched / 1e6,
        seconds,
        download.fetched / 1e6 / max(seconds, 1e-9),
        len(download.by_donor),
    )


def fetch_checkpoint(
    urls: str | Sequence[str],
    dest: str | Path,
    token: str | bytes | None = None,
    connections: int = 4,
    timeout: float = 20.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shared: Sequence[tuple] = (),
    pace: Callable[[int], object] | None = None,
) -> PeerFetch:
    """`fetch_from_peer`, from several donors at once: the tensors under the key prefixes
    `shared` (the same on every donor of a step) come from every donor that lays them out
    alike, the rest from the donors of one checkpoint (the digest most donors offer). When
    all of those die mid-transfer, another donor's checkpoint of the same step is taken (a
    helper's, which its serving leased), keeping the shared bytes already in; if none is
    left, the newest the donors left offer. Every file is checked against the committed
    checkpoint's hash; a file that fails is fetched again from its digest's donors alone.
    `pace`, if given, is called with the size of each read before it and may block to hold
    the transfer or cap its rate (reads and each receive window are then small, so a held
    transfer stops its donors within a moment)."""
    key = resolve_token(token)
    urls = _checked_urls(urls, connections, timeout, chunk_bytes)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    served: Counter[str] = Counter()
    live, previous, pending = list(urls), None, None
    for attempt in range(1, len(urls) + 1):
        # after a primary died: the helpers of that step (serving it leased it on their side)
        offers, pending = pending or ask_donors(live, key, timeout), None
        offer, donors = choose(offers, differ=bool(shared))
        if {MANIFEST_NAME, JOURNAL} & set(offer.manifest.files):
            raise PeerError(f"the manifest offered by {donors} lists reserved file names; refused")
        target = dest / step_dirname(offer.step)
        if _already_have(target, offer):
            log.info("%s already holds step %d; nothing to fetch", dest, offer.step)
            return PeerFetch(offer.step, donors[0], dict(served), time.monotonic() - t0, attempt)
        folder = _open_partial(dest, offer, donors)
        helpers, ranges, metas = {}, {}, {}
        if shared:
            metas = _primary_metas(folder, offer, donors, key, timeout)
            helpers, ranges = shared_plan(folder, offer, offers, metas, shared, key, timeout,
                                          previous)  # fmt: skip
        download = Download(
            folder,
            offer.manifest,
            offer.digest,
            donors,
            key,
            connections,
            timeout,
            chunk_bytes,
            helpers=helpers,
            shared=ranges,
            pace=pace,
        )
        try:
            _download_verified(download, offer, connections)
        except PeerGoneError as e:
            served.update(download.by_donor)
            gone = set(download.donors.dropped) | set(download.helpers.dropped)
            live = [u for u in live if u not in gone]
            if not shared or not live:
                raise
            log.warning("%s; taking another donor's checkpoint (%d left)", e, len(live))
            previous = (folder, offer.step, metas)
            pending = [o for o in offers if o.step == offer.step and o.url in live] or None
            continue
        served.update(download.by_donor)
        t_commit = time.monotonic()
        if _commit(folder, target, offer):
            _log_fetched(offer.step, target, download, time.monotonic() - t0)
        now = time.monotonic()
        return PeerFetch(offer.step, donors[0], dict(served), now - t0, attempt, now - t_commit)
    raise PeerGoneError(f"every donor died during the transfer (tried {len(urls)})")
