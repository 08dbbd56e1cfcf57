"""The log of committed updates a member keeps and serves, so that a joiner can replay them.

Every committed outer step, each local rank of a member writes one entry: the averaged
pseudo-gradient exactly as `OuterOptimizer.apply` took it (float32, this rank's shard, after
the contributors' scale), the inner step and outer step count it made, and the outer weights'
hash after it (the node's, and this rank's shard's). The averaged pseudo-gradient is
bit-identical on every node, so any member's entry serves any joiner, and applying it with the
same code on CPU reproduces the members' outer weights and momentum bit for bit: the joiner
checks the hash. It is stored as the all-gathered bytes every node decoded the average from
and the contributors' scale (`update_codec`: about 1 byte per element at uint8, a copy of the
codes); unpacking decodes and scales them exactly as the all-reduce and the average did.

An entry also carries `shared`, an opaque msgpack-able dict of the state all members share
after that round (data-slot positions, ...): restored on the joiner after replay.

Each entry is authenticated as checkpoint files are: its header holds a MAC of the rest,
keyed BLAKE3 (a third of HMAC-SHA256's time here: ~4.5 against ~1.7 GB/s) with a key derived
from the run's token (`entry_key`), so a joiner refuses an entry that is torn, corrupt or
forged by anyone who does not hold the token.

The last `keep` outer steps are kept (plus any a joiner holds through the checkpoint server's
side-file holds: `held_from`). Files are `outer-<10 digits>-r<rank>.entry`, written under a
hidden name and renamed, in the node's checkpoint folder's `replay/`; the folder is emptied
when the process starts (an entry is only ever what this process committed).
"""

from __future__ import annotations

import hmac
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import blake3
import msgpack
import torch

from prime_train.diloco import update_codec

log = logging.getLogger("prime_train")
# (4: the update's bytes follow the fields, outside the msgpack; keyed BLAKE3, not HMAC-SHA256)
_MAGIC = b"PRIMEUPD4\n"
_KEY_CONTEXT = "prime-train update-log entry MAC v4"
_NAME_RE = re.compile(r"^outer-(\d{10})-r(\d{1,4})\.entry$")
_HELD = ".held"  # rank 0 tells the node's other ranks which entries a joiner holds


class BadEntry(ValueError):
    """An entry file that is torn, corrupt or of another format."""


def entry_key(token: str | None) -> bytes:
    """The key that authenticates update-log entries, derived from the run's shared secret
    (from an empty one without: the MAC then only detects a torn or corrupt entry)."""
    return blake3.blake3((token or "").encode(), derive_key_context=_KEY_CONTEXT).digest()


def entry_name(outer_step: int, rank: int) -> str:
    return f"outer-{outer_step:010d}-r{rank}.entry"


def parse_name(name: str) -> tuple[int, int] | None:
    """(outer step, rank) of an entry file name; None for any other name."""
    m = _NAME_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class Entry:
    """One committed update of one rank's shard (see module doc)."""

    outer_step: int  # the count after applying it
    step: int  # the inner step that round ended at
    rank: int  # the local rank whose shard this is
    outer_sha256: str  # the node's outer weights' hash after it
    shard_sha256: str  # this rank's shard's hash after it
    update: torch.Tensor  # float32, flat: what `apply` took
    shared: dict[str, Any] = field(default_factory=dict)
    packed: dict[str, Any] | None = None  # `update_codec.pack(update)`, once taken

    def pack(self, encoded: update_codec.Encoded | None = None) -> Entry:
        """This entry with its update packed (`encode` then no longer reads `update`, whose
        buffer the caller may reuse); `encoded`: the update as its all-reduce's bytes (see
        `update_codec`); itself when it already is packed."""
        if self.packed is not None:
            return self
        packed = update_codec.pack(self.update, encoded)
        return replace(self, update=torch.empty(0), packed=packed)

    def misfit(self, applied: int, numel: int) -> str | None:
        """Why this entry cannot be replayed onto a shard of `numel` elements that has
        `applied` outer steps (it must be the next one, of the same size); None: it fits."""
        if self.outer_step != applied + 1:
            return f"entry of outer step {self.outer_step} after outer step {applied}"
        if self.update.numel() != numel:
            return (
                f"entry of outer step {self.outer_step} has {self.update.numel()} elements, "
                f"this shard {numel}"
            )
        return None

    def encode(self, key: bytes) -> bytes:
        return b"".join(self.parts(key))

    def parts(self, key: bytes) -> tuple[bytes, bytes, memoryview | bytes]:
        """The encoding as three buffers to write one after the other: the header (magic, the
        MAC under `key`, the fields' length), the fields (msgpack), and the update's bytes
        (the packing's `data`, not copied into the msgpack: that copy cost ~2x a memcpy of
        the weights)."""
        packed = dict(self.packed or update_codec.pack(self.update))
        payload = packed.pop("data")
        fields = msgpack.packb(
            {
                "outer_step": self.outer_step,
                "step": self.step,
                "rank": self.rank,
                "outer_sha256": self.outer_sha256,
                "shard_sha256": self.shard_sha256,
                "update": packed,
                "shared": self.shared,
            },
            use_bin_type=True,
        )
        size = len(fields).to_bytes(8, "little")
        mac = blake3.blake3(size + fields, key=key)
        mac.update(payload)
        return _MAGIC + mac.digest() + size, fields, payload

    @classmethod
    def decode(cls, data: bytes, key: bytes) -> Entry:
        """The entry in `data`; BadEntry when it is torn, corrupt or not authenticated by
        `key` (another run's token, or none)."""
        head = len(_MAGIC) + 32
        if not data.startswith(_MAGIC) or len(data) < head + 8:
            raise BadEntry("not an update-log entry")
        view = memoryview(data)
        size = int.from_bytes(view[head : head + 8], "little")
        mac = blake3.blake3(view[head:], key=key).digest()
        if size > len(data) - head - 8 or not hmac.compare_digest(mac, data[len(_MAGIC) : head]):
            raise BadEntry("authentication failed (torn, corrupt, or written under another token)")
        try:
            h = msgpack.unpackb(view[head + 8 : head + 8 + size], raw=False)
            update = {**h["update"], "data": view[head + 8 + size :]}
            return cls(
                int(h["outer_step"]), int(h["step"]), int(h["rank"]), str(h["outer_sha256"]),
                str(h["shard_sha256"]), update_codec.unpack(update), dict(h.get("shared") or {}),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, msgpack.ExtraData) as e:
            raise BadEntry(f"unreadable entry: {e}") from e


class ReplayLog:
    """This rank's writer of the update log (module doc): `append` at each committed outer
    step (the file is written on a background thread; the next `append` waits for it)."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        keep: int,
        key: bytes,
        held_from: Callable[[], str | None] | None = None,
    ):
        """`key`: `entry_key` of the run's token; `held_from`: the first entry name a joiner
        holds (local rank 0's checkpoint server; None on the other ranks, which read what rank
        0 wrote down)."""
        self.folder, self.rank, self.keep, self._held_from = Path(folder), rank, keep, held_from
        self.key = key
        self.folder.mkdir(parents=True, exist_ok=True)
        for p in self.folder.iterdir():  # another process's entries: not this one's history
            parsed = parse_name(p.name.lstrip(".").removesuffix(".tmp"))
            if parsed is not None and parsed[1] == rank:
                p.unlink(missing_ok=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prime-replay-log")
        self._last: Future | None = None
        self._lock = threading.Lock()

    def append(self, entry: Entry) -> None:
        """Write `entry`: its update is packed here (about a byte per element; the caller's
        buffer is reused after), the file written in the background."""
        if self.keep <= 0:
            return
        packed = entry.pack()
        self.wait()
        self._last = self._pool.submit(self._write, packed)

    def wait(self) -> None:
        """Until the last entry is written (a failure is only this log's: training goes on,
        and a joiner that needs the entry takes a newer checkpoint)."""
        last, self._last = self._last, None
        if last is None:
            return
        try:
            last.result()
        except OSError as e:
            log.warning("update log: cannot write an entry into %s: %s", self.folder, e)

    def _write(self, entry: Entry) -> None:
        name = entry_name(entry.outer_step, self.rank)
        tmp = self.folder / f".{name}.tmp"
        with open(tmp, "wb") as f:
            for part in entry.parts(self.key):
                f.write(part)
        tmp.rename(self.folder / name)
        self._prune(entry.outer_step)

    def _held(self) -> int | None:
        """The first outer step a joiner holds, if any."""
        if self._held_from is not None:
            name = self._held_from()
            parsed = parse_name(name) if name else None
            held = parsed[0] if parsed else None
            (self.folder / _HELD).write_text("" if held is None else str(held))
            return held
        try:
            text = (self.folder / _HELD).read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def _prune(self, newest: int) -> None:
        oldest_kept = newest - self.keep + 1
        held = self._held()
        if held is not None:
            oldest_kept = min(oldest_kept, held)
        for p in self.folder.iterdir():
            parsed = parse_name(p.name)
            if parsed is not None and parsed[1] == self.rank and parsed[0] < oldest_kept:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
