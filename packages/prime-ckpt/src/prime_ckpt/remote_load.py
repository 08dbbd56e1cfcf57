"""Loading from the remote tier: a remote step is downloaded into a temporary folder under
`disk_dir` (decompressed and checked against its manifest on the way) and loaded from there;
once loaded it becomes the disk copy of that step, and otherwise it is removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prime_ckpt.errors import CorruptCheckpoint
from prime_ckpt.manifest import step_dirname
from prime_ckpt.reader import CheckpointSource
from prime_ckpt.remote import RemoteStore


def open_remote(store: RemoteStore, step: int, tmp: Path, owner: bool) -> CheckpointSource:
    """Download `step` from `store` into the folder `tmp` and open it for loading (tier
    "remote"). Every failure is a CorruptCheckpoint, so a load moves on to the next copy; a
    copy that fails its own manifest is deleted from the remote by the `owner` (rank 0)."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        store.download(step, tmp)
    except CorruptCheckpoint as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if owner:  # a copy that fails its own manifest is never good: clean it
            try:
                store.delete(step)
            except Exception as de:  # cleaning is best effort; the step stays skipped
                e = CorruptCheckpoint(f"{e}; could not remove it: {de}")
        raise e from None
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorruptCheckpoint(f"download from {store.url} failed: {e}") from None
    src = CheckpointSource.open("disk", tmp)
    src.tier = "remote"
    return src


def settle_remote(source: CheckpointSource, disk_dir: Path, adopt: bool) -> None:
    """After a load from `source` (opened by open_remote): with `adopt` it becomes `disk_dir`'s
    copy of its step, unless that exists already; otherwise it is removed."""
    final = disk_dir / step_dirname(source.manifest.step)
    if adopt and not final.exists():
        os.rename(source.dir, final)
    else:
        shutil.rmtree(source.dir, ignore_errors=True)
