"""Tensors kept in a scratch file rather than in host memory: written in the background, read
back in place.

The committed record (`diloco/committed.py`) needs the inner optimizer's moments (8 B/param)
and, with streaming fragments, the model's weights (4) as they were at the last outer
boundary, but reads them only when a node stops mid-round or its coordinator does not come
back. Held in RAM they were the largest copy a node kept beyond its working set; written here,
they live in the page cache, which the kernel writes back and reclaims. The write runs in a
thread while the next inner step computes its forward and backward: nothing changes those
tensors before the optimizer's next step, which waits for it (`Run` hooks `wait` to it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

CHUNK = 8 << 20  # bytes per system call, and per device-to-host copy of a tensor


class SpillError(RuntimeError):
    """The scratch file could not be written or read back."""


class TensorSpill:
    """One scratch file holding a list of tensors' bytes, end to end (see module doc)."""

    def __init__(self, path: Path):
        self.path = path
        self._sizes: list[int] | None = None  # bytes per tensor of the last write
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start writing `tensors` as they are now; returns at once. Whoever changes one of
        them before `wait()` returned changes what is written."""
        self.wait()
        views = [_bytes_of(t) for t in tensors]
        self._sizes = [v.numel() for v in views]
        self._thread = threading.Thread(
            target=self._write, args=(views,), name="committed-spill", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in progress, if any. SpillError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise SpillError(f"could not write {self.path}: {error}") from error

    def read_into(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put the last written values back into `tensors` (the same shapes and dtypes), in
        place."""
        self.wait()
        sizes = [_nbytes(t) for t in tensors]
        if sizes != self._sizes:
            raise SpillError(f"{self.path} holds tensors of {self._sizes} bytes, not {sizes}")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise SpillError(f"could not read {self.path}: {e}") from e
        try:
            offset = 0
            for t in tensors:
                offset = _read_tensor(fd, t, offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Wait for the write in progress and delete the file."""
        try:
            self.wait()
        finally:
            self.path.unlink(missing_ok=True)
            self._sizes = None

    def _write(self, views: list[torch.Tensor]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                offset = 0
                for v in views:
                    offset = _write_bytes(fd, v, offset)
                os.ftruncate(fd, offset)
            finally:
                os.close(fd)
        except BaseException as e:  # (raised in the training thread by `wait`)
            self._error = e


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 tensor: a view when `t` is contiguous."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write_bytes(fd: int, data: torch.Tensor, offset: int) -> int:
    """Write `data` (flat uint8, any device) at `offset`; returns the offset after it."""
    for start in range(0, data.numel(), CHUNK):
        piece = data[start : start + CHUNK]
        buf = memoryview(piece.cpu().numpy())  # (a view on the CPU; one chunk's copy else)
        while buf:
            n = os.pwrite(fd, buf, offset)
            buf, offset = buf[n:], offset + n
    return offset


@torch.no_grad()
def _read_tensor(fd: int, t: torch.Tensor, offset: int) -> int:
    """Read `t`'s bytes from `offset` into `t`; returns the offset after them."""
    target = _bytes_of(t)
    in_place = t.device.type == "cpu" and t.is_contiguous()
    for start in range(0, target.numel(), CHUNK):
        piece = target[start : start + CHUNK]
        host = piece if in_place else torch.empty_like(piece, device="cpu")
        buf = memoryview(host.numpy())
        while buf:
            n = os.preadv(fd, [buf], offset)
            if n == 0:
                raise SpillError(f"the scratch file ends at byte {offset}, before its tensors")
            buf, offset = buf[n:], offset + n
        if not in_place:
            piece.copy_(host)
    if not t.is_contiguous():  # (`target` was a copy)
        t.copy_(target.view(t.dtype).reshape(t.shape))
    return offset
