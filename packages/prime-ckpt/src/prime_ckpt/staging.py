"""The RAM tier: one staging slot (two with keep["ram"] = 2) in shared memory, allocated
once and reused.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from prime_ckpt.errors import ManifestError
from prime_ckpt.faults import fault
from prime_ckpt.manifest import MANIFEST_NAME, Manifest, data_name, meta_name, read_manifest
from prime_ckpt.state import TensorItem, dtype_from_name

OWNER = "owner.msgpack"
_CHUNK = 16 << 20
PREFIX = "prime-ckpt-"


def default_shm_dir(disk_dir: Path, rank: int) -> Path:
    """A RAM folder derived from the disk folder and rank, so a restarted process finds it."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha256(str(disk_dir.resolve()).encode()).hexdigest()[:16]
    return root / f"{PREFIX}{digest}-r{rank}"


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
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if total:
                # reserves tmpfs pages now: a full /dev/shm is an OSError here, not a SIGBUS later
                os.posix_fallocate(fd, 0, total)
        finally:
            os.close(fd)
        if total:
            buf = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        else:
            buf = torch.empty(0, dtype=torch.uint8)
        self._buffers[i] = (total, buf)
        return buf

    def stage(self, step: int, items: list[TensorItem], total: int, meta: bytes) -> int:
        """Copy the tensors into a free slot; returns the slot index."""
        i = self._pick()
        slot = self.slots[i]
        (slot / MANIFEST_NAME).unlink(missing_ok=True)
        buf = self._buffer(i, total)
        half = len(items) // 2
        dst_np = buf.numpy()
        chunks: list[tuple[Any, Any]] = []
        with torch.no_grad():
            for n, it in enumerate(items):
                if n == half:
                    self._copy(chunks)
                    chunks = []
                    fault("stage", step)
                if not it.write or not it.nbytes:
                    continue
                t = it.tensor
                if (
                    t.device.type == "cpu"
                    and t.is_contiguous()
                    and not t.is_conj()
                    and not t.is_neg()
                ):
                    src = t.reshape(-1).view(torch.uint8).numpy()
                    for a in range(0, it.nbytes, _CHUNK):
                        b = min(a + _CHUNK, it.nbytes)
                        chunks.append((dst_np[it.offset + a : it.offset + b], src[a:b]))
                else:  # GPU (a DMA), strided or lazily-negated tensors: torch does the copy
                    dst = buf[it.offset : it.offset + it.nbytes].view(dtype_from_name(it.dtype))
                    dst.view(it.shape).copy_(t)
            self._copy(chunks)
        (slot / meta_name(self.rank)).write_bytes(meta)
        return i

    def _copy(self, chunks: list[tuple[Any, Any]]) -> None:
        """memcpy in 16 MiB chunks on a small thread pool (numpy releases the GIL). Unlike one
        torch parallel copy per tensor, a descheduled thread never holds up a barrier: the
        others take the remaining chunks."""
        if len(chunks) <= 1:
            for d, s in chunks:
                np.copyto(d, s)
            return
        for f in [self._pool.submit(np.copyto, d, s) for d, s in chunks]:
            f.result()

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
