"""Byte ranges that several donors hold alike, so that one checkpoint can come from several
donors at once although their checkpoints differ (each node's own optimizer moments, RNG).

The caller names the key prefixes whose tensors are the same on every donor of a step
(`shared`, e.g. `[("model",), ("diloco", "outer")]`). The fetcher takes the manifest and the
tensor tables (`rank-N.meta`) from one donor, the *primary*, whose checkpoint it commits; a
*helper* (another donor of the same step, another digest) may serve the bytes of a shared
tensor whose record (path, dtype, shape, offset, size) in its own tensor table is the same.
Nothing is trusted: the committed folder must match the primary's hash of every file, and
a file that does not is fetched again from the primary's digest alone.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from prime_ckpt.errors import PeerError
from prime_ckpt.peer.catalog import Offer
from prime_ckpt.peer.client import Connection
from prime_ckpt.peer.journal import JOURNAL
from prime_ckpt.state import unpack_meta

log = logging.getLogger("prime_ckpt.peer")

Ranges = dict[str, list[tuple[int, int]]]  # data file -> sorted, disjoint [start, end)
_META, _DATA = ".meta", ".bin"


def _shared_records(meta: bytes, prefixes: Sequence[tuple]) -> dict[tuple, tuple]:
    """path -> (dtype, shape, global shape, row, offset, nbytes) of the written tensors under
    `prefixes` in one tensor table."""
    out = {}
    for rec in unpack_meta(meta)["tensors"]:
        path = tuple(rec[0])
        written = rec[7] and rec[6] > 0
        if written and any(path[: len(p)] == tuple(p) for p in prefixes):
            out[path] = (rec[1], tuple(rec[2]), tuple(rec[3] or ()), rec[4], rec[5], rec[6])
    return out


def common_ranges(mine: bytes, theirs: bytes, prefixes: Sequence[tuple]) -> list[tuple[int, int]]:
    """The data-file byte ranges of the shared tensors laid out alike in two tensor tables."""
    a, b = _shared_records(mine, prefixes), _shared_records(theirs, prefixes)
    spans = sorted((r[4], r[4] + r[5]) for p, r in a.items() if b.get(p) == r)
    merged: list[tuple[int, int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return merged


def meta_files(offer: Offer) -> list[str]:
    """The tensor tables of a checkpoint whose data file it also lists."""
    names = offer.manifest.files
    return sorted(n for n in names if n.endswith(_META) and n[: -len(_META)] + _DATA in names)


def data_file(meta: str) -> str:
    return meta[: -len(_META)] + _DATA


def read_file(urls: Sequence[str], offer: Offer, name: str, token: bytes, timeout: float) -> bytes:
    """One small file of `offer` (a tensor table) from the first of `urls` that serves it."""
    size = offer.manifest.files[name].size
    errors = []
    for url in urls:
        conn = Connection(url, token, timeout)
        try:
            with tempfile.TemporaryFile() as f:
                conn.read_range(offer.step, offer.digest, name, 0, size, f.fileno())
                f.seek(0)
                return f.read()
        except PeerError as e:  # PeerFailed, PeerGone: the next donor
            errors.append(f"{url}: {e}")
        finally:
            conn.close()
    raise PeerError(f"no donor served {name} of step {offer.step}: {'; '.join(errors)}")


def helper_ranges(
    primary: dict[str, bytes],
    helpers: list[Offer],
    prefixes: Sequence[tuple],
    token: bytes,
    timeout: float,
) -> tuple[dict[str, str], Ranges]:
    """The helpers worth asking (url -> their digest) and the ranges they may serve: those
    every usable helper lays out like the primary (`primary`: meta name -> its bytes). A
    helper that cannot be read, or whose layout differs, is left out (logged)."""
    usable: dict[str, str] = {}
    ranges: Ranges | None = None
    for h in helpers:
        if [*meta_files(h)] != [*primary]:
            log.info("donor %s left out as a helper: another shard layout", h.url)
            continue
        try:
            theirs = {m: read_file([h.url], h, m, token, timeout) for m in primary}
        except PeerError as e:
            log.info("donor %s left out as a helper: %s", h.url, e)
            continue
        got = {data_file(m): common_ranges(primary[m], theirs[m], prefixes) for m in primary}
        if not any(got.values()):
            log.info("donor %s left out as a helper: no shared tensor laid out alike", h.url)
            continue
        # ranges every helper may serve: the intersection (the same layout in practice)
        ranges = got if ranges is None else {k: _intersect(ranges[k], got[k]) for k in ranges}
        usable[h.url] = h.digest
    return usable, ranges or {}


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for s1, e1 in a:
        for s2, e2 in b:
            s, e = max(s1, s2), min(e1, e2)
            if s < e:
                out.append((s, e))
    return sorted(out)


def adopt(old: Path, new: Path, ranges: Ranges, journal: str) -> int:
    """Move the finished shared ranges of an abandoned partial download (another digest of
    the same step, `old`) into the new one's folder (`new`): the data files, and the journal
    lines of the ranges wholly inside `ranges` (which the new primary lays out alike). Returns
    the bytes kept; `old` is removed."""
    import shutil

    lines = []
    try:
        text = (old / journal).read_text()
    except FileNotFoundError:
        text = ""
    for line in text.split("\n")[:-1]:
        start, _, rest = line.partition("\t")
        end, _, name = rest.partition("\t")
        if not (start.isdigit() and end.isdigit()) or name not in ranges:
            continue
        s, e = int(start), int(end)
        if any(a <= s and e <= b for a, b in ranges[name]):
            lines.append(line + "\n")
    names = {ln.split("\t", 2)[2].rstrip("\n") for ln in lines}
    for name in sorted(names):
        src = old / name
        if not src.exists() or (new / name).exists():  # the new download already has its own
            lines = [ln for ln in lines if not ln.endswith(f"\t{name}\n")]
            continue
        (new / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, new / name)
    kept = sum(int(ln.split("\t")[1]) - int(ln.split("\t")[0]) for ln in lines)
    if lines:
        with open(new / journal, "a") as f:
            f.writelines(lines)
    shutil.rmtree(old, ignore_errors=True)
    return kept


def shared_plan(
    folder: Path,
    offer: Offer,
    offers: list[Offer],
    metas: dict,
    shared: Sequence[tuple],
    key: bytes,
    timeout: float,
    previous: tuple[Path, int, dict] | None,
) -> tuple[dict, dict]:
    """Where the shared tensors of `offer` come from, given the primary's meta files
    `metas`: (helpers, their byte ranges); the shared bytes of an abandoned transfer of the
    same step (`previous`: its folder, step and metas) are moved into `folder` first."""
    others = [o for o in offers if o.step == offer.step and o.digest != offer.digest]
    helpers, ranges = helper_ranges(metas, others, shared, key, timeout)
    if previous is not None and previous[0] != folder and previous[1] == offer.step:
        common = {
            data_file(m): common_ranges(metas[m], previous[2][m], shared)
            for m in metas
            if m in previous[2]
        }
        kept = adopt(previous[0], folder, common, JOURNAL)
        log.info("kept %.1f MB of shared tensors from the abandoned transfer", kept / 1e6)
    if helpers:
        log.info("%d more donor(s) help with the shared tensors", len(helpers))
    return helpers, ranges
