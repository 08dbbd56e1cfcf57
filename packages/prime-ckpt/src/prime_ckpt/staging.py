"""The RAM tier: one staging slot (two with keep["ram"] = 2) in shared memory, allocated
once and reused; or, with `ram="disk"`, the same slots in a folder on disk; or, with
`ram="off"`, no slot: `DirectWriter` copies the state straight into the disk tier's temporary
folder.

Each slot is a folder under `shm_dir` holding one rank's shard in the same files as on disk
(`rank-N.bin`, `rank-N.meta`) and, once the background copy has hashed it, a manifest. A slot
is invalidated (manifest removed) before it is overwritten. With one slot (the default: at
most one checkpoint, 20 bytes per parameter of a DiLoCo node, in RAM) that is safe because
`save()` waits until the previous checkpoint is durable on disk before staging the next; with
two, a crash mid-copy also leaves the other slot loadable by the next process on the machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from prime_ckpt.errors import ManifestError
from prime_ckpt.faults import fault
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    committed_steps,
    data_name,
    meta_name,
    read_manifest,
)
from prime_ckpt.state import TensorItem, dtype_from_name

OWNER = "owner.msgpack"
_CHUNK = 16 << 20
PREFIX = "prime-ckpt-"


def default_shm_dir(disk_dir: Path, rank: int) -> Path:
    """A RAM folder derived from the disk folder and rank, so a restarted process finds it."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha256(str(disk_dir.resolve()).encode()).hexdigest()[:16]
    return root / f"{PREFIX}{digest}-r{rank}"


def disk_staging_dir(disk_dir: Path, rank: int) -> Path:
    """`ram="disk"`: the staging slots in a hidden folder of the disk folder (never taken for
    a step, nor removed as a leftover), so a restarted process finds them."""
    return disk_dir / f".staging-r{rank}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(root: Path) -> list[Path]:
    """Remove RAM folders of dead runs whose disk folder no longer exists."""
    removed = []
    for d in root.glob(f"{PREFIX}*"):
        try:
            owner = msgpack.unpackb((d / OWNER).read_bytes())
            if not _pid_alive(int(owner["pid"])) and not Path(owner["disk_dir"]).exists():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except Exception:  # not ours or half-written: leave it alone
            continue
    return removed


class Stager:
    """Copies a rank's tensors into one of `slots` (1 or 2) shared-memory slots."""

    def __init__(self, shm_dir: Path, disk_dir: Path, rank: int, slots: int = 1) -> None:
        self.dir = shm_dir
        self.rank = rank
        self.slots = [shm_dir / f"slot-{i}" for i in range(slots)]
        if slots == 1:  # a second slot left by a run that kept two: its memory is freed
            shutil.rmtree(shm_dir / "slot-1", ignore_errors=True)
        for s in self.slots:
            s.mkdir(parents=True, exist_ok=True)
        owner = msgpack.packb({"pid": os.getpid(), "disk_dir": str(disk_dir.resolve())})
        (shm_dir / OWNER).write_bytes(owner)
        self._buffers: dict[int, tuple[int, torch.Tensor]] = {}
        self._pool = ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="prime-ckpt-stage"
        )

    def committed(self) -> list[tuple[int, int]]:
        """(step, slot index) of slots holding a RAM copy marked good, newest first."""
        out = []
        for i, s in enumerate(self.slots):
            try:
                out.append((read_manifest(s).step, i))
            except ManifestError:
                continue
        return sorted(out, reverse=True)

    def _pick(self) -> int:
        held = self.committed()
        if not held or len(self.slots) == 1:
            return 0
        return 1 - held[0][1]  # never overwrite the newest good copy

    def _buffer(self, i: int, total: int) -> torch.Tensor:
        path = self.slots[i] / data_name(self.rank)
        cached = self._buffers.get(i)
        if cached and cached[0] == total and path.is_file():
            return cached[1]
        self._buffers.pop(i, None)
        path.unlink(missing_ok=True)  # a fresh inode: old mappings stay valid until dropped
        buf = map_file(path, total)
        self._buffers[i] = (total, buf)
        return buf

    def stage(
        self,
        step: int,
        items: list[TensorItem],
        total: int,
        meta: bytes,
        copied: Callable[[str], object] | None = None,
    ) -> int:
        """Copy the tensors into a free slot; returns the slot index. `copied(key)` as the
        tensors under each top-level key of the state are copied."""
        i = self._pick()
        slot = self.slots[i]
        (slot / MANIFEST_NAME).unlink(missing_ok=True)
        fill(self._buffer(i, total), items, step, self._pool, copied)
        (slot / meta_name(self.rank)).write_bytes(meta)
        return i

    def commit(self, i: int, manifest: Manifest) -> None:
        """Mark slot `i` good (its files hashed into `manifest`)."""
        tmp = self.slots[i] / (MANIFEST_NAME + ".tmp")
        tmp.write_bytes(manifest.to_bytes())
        tmp.replace(self.slots[i] / MANIFEST_NAME)

    def invalidate(self, i: int) -> None:
        (self.slots[i] / MANIFEST_NAME).unlink(missing_ok=True)

    def remove(self) -> None:
        self._pool.shutdown(wait=True)
        self._buffers.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def map_file(path: Path, total: int) -> torch.Tensor:
    """A new file of `total` bytes, its space reserved, mapped shared as a uint8 tensor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if total:
            # reserves the pages or blocks now: a full /dev/shm or disk is an OSError here,
            # not a SIGBUS later
            os.posix_fallocate(fd, 0, total)
    finally:
        os.close(fd)
    if total:
        return torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8)


def fill(
    buf: torch.Tensor,
    items: list[TensorItem],
    step: int,
    pool: ThreadPoolExecutor,
    copied: Callable[[str], object] | None = None,
) -> None:
    """Copy every written tensor of `items` to its offset in `buf`, in order, saying
    `copied(key)` once those under each top-level key are (a caller may then change them);
    the `stage` fault point sits half-way."""
    half = len(items) // 2
    dst_np = buf.numpy()
    chunks: list[tuple[Any, Any]] = []
    with torch.no_grad():
        for n, it in enumerate(items):
            if n and it.path[0] != items[n - 1].path[0]:  # a top-level key's tensors end
                _copy(chunks, pool)
                chunks = []
                if copied is not None:
                    copied(items[n - 1].path[0])
            if n == half:
                _copy(chunks, pool)
                chunks = []
                fault("stage", step)
            if not it.write or not it.nbytes:
                continue
            t = it.tensor
            if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
                src = t.reshape(-1).view(torch.uint8).numpy()
                for a in range(0, it.nbytes, _CHUNK):
                    b = min(a + _CHUNK, it.nbytes)
                    chunks.append((dst_np[it.offset + a : it.offset + b], src[a:b]))
            else:  # GPU (a DMA), strided or lazily-negated tensors: torch does the copy
                dst = buf[it.offset : it.offset + it.nbytes].view(dtype_from_name(it.dtype))
                dst.view(it.shape).copy_(t)
        _copy(chunks, pool)
    if items and copied is not None:
        copied(items[-1].path[0])


def _copy(chunks: list[tuple[Any, Any]], pool: ThreadPoolExecutor) -> None:
    """memcpy in 16 MiB chunks on a small thread pool (numpy releases the GIL). Unlike one
    torch parallel copy per tensor, a descheduled thread never holds up a barrier: the
    others take the remaining chunks."""
    if len(chunks) <= 1:
        for d, s in chunks:
            np.copyto(d, s)
        return
    for f in [pool.submit(np.copyto, d, s) for d, s in chunks]:
        f.result()


class DirectWriter:
    """`ram="off"`: no staging slot. `save()` copies the state straight into the disk tier's
    temporary folder (into the page cache, the same memcpy as staging) and the background
    thread then hashes, fsyncs and commits it; the RAM tier stays empty."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: list[Path] = []
        self._pool = ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="prime-ckpt-stage"
        )

    def committed(self) -> list[tuple[int, int]]:
        return []

    def write(
        self, folder: Path, step: int, items: list[TensorItem], total: int, meta: bytes
    ) -> None:
        """Write this rank's data and meta files of `step` into `folder` (created)."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / data_name(self.rank)
        path.unlink(missing_ok=True)
        buf = map_file(path, total)
        try:
            fill(buf, items, step, self._pool)
        finally:
            del buf  # unmapped; the dirty pages stay in the page cache until written back
        (folder / meta_name(self.rank)).write_bytes(meta)

    def remove(self) -> None:
        self._pool.shutdown(wait=True)


RAM_MODES = ("shm", "disk", "off")


def ram_tier(
    ram: str, shm_dir: str | Path | None, disk_dir: Path, rank: int, slots: int
) -> tuple[Stager | DirectWriter, Path | None]:
    """The staging object and folder `CheckpointManager(ram=..., shm_dir=...)` asks for:
    "shm" stages in RAM (default folder in /dev/shm), "disk" in a folder on disk (default
    `disk_dir/.staging-rN`), "off" nowhere. ValueError for anything else. A RAM folder this
    disk folder used before and no longer stages in is freed (unless it holds a newer
    checkpoint than the disk)."""
    if ram not in RAM_MODES:
        raise ValueError(
            f"ram must be 'shm' (stage in /dev/shm), 'disk' (stage in a folder on disk) or "
            f"'off' (write straight to disk), got {ram!r}"
        )
    if ram == "off" and shm_dir is not None:
        raise ValueError(f"shm_dir={str(shm_dir)!r} has no use with ram='off' (no staging)")
    default_ram = default_shm_dir(disk_dir, rank)
    if ram == "shm":
        if shm_dir is None:
            clean_stale(default_ram.parent)
        d = default_ram if shm_dir is None else Path(shm_dir)
    else:
        _release(default_ram)
        d = None if ram == "off" else Path(shm_dir or disk_staging_dir(disk_dir, rank))
    stager = DirectWriter(rank) if d is None else Stager(d, disk_dir, rank, slots)
    return stager, d


def _release(shm_dir: Path) -> None:
    if not shm_dir.is_dir():
        return
    try:
        disk_dir = Path(msgpack.unpackb((shm_dir / OWNER).read_bytes())["disk_dir"])
    except Exception:  # not ours or half-written: leave it alone
        return
    newest = max(committed_steps(disk_dir), default=-1) if disk_dir.is_dir() else -1
    held = []
    for slot in shm_dir.glob("slot-*"):
        try:
            held.append(read_manifest(slot).step)
        except ManifestError:
            continue
    if all(s <= newest for s in held):
        shutil.rmtree(shm_dir, ignore_errors=True)


@dataclass
class PendingStage:
    """A save whose copy into RAM the manager's writer thread makes (`stage_in_background`)."""

    items: list
    total: int
    meta: bytes


class StagingFailed(Exception):
    """A copy into the RAM tier failed (its message says so in full)."""


def staging_failure(step: int, shm_dir: Path | None, e: OSError) -> str:
    """The line a failed copy of `step` into the RAM tier at `shm_dir` reports."""
    return (
        f"staging step {step} in {shm_dir} failed: {e}; older checkpoints are intact (free "
        "space in /dev/shm, pass shm_dir= on a larger filesystem or ram='disk')"
    )
