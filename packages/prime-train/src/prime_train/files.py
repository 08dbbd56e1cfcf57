"""Files written aside and renamed into place, so a reader never sees a torn one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def write_atomic(path: Path, data: str | bytes | np.ndarray, fsync: bool = False) -> None:
    """Write `data` (text, bytes, or an array in .npy form) to a temporary file beside `path`
    and rename it over `path`. `fsync` makes the contents durable before the rename (caches
    that other processes rely on); plain metrics and configs skip it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, np.ndarray):
                np.save(f, data)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
