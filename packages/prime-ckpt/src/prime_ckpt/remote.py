"""The remote tier: committed disk checkpoints copied to any fsspec URL in the background.

Object stores cannot rename, so a step's data files are uploaded first and its manifest last:
the manifest marks the commit. A step prefix without a manifest is torn and is removed by the
uploader; a step whose files fail the manifest is skipped by loads and removed. Files may be compressed
with zstd (recorded in the remote manifest); checksums are always of the uncompressed bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
import zstandard

from prime_ckpt.bounded import Breaker
from prime_ckpt.errors import CorruptCheckpoint, ManifestError
from prime_ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    parse_step_dirname,
    read_manifest,
    step_dirname,
)

log = logging.getLogger("prime_ckpt")
_CHUNK = 8 << 20
_PART = 8 << 20  # what a remote file buffers before it sends a part (s3fs: 50 MiB; S3's least: 5)
# the longest a listing, a manifest read or a delete of the remote is waited for where a start
# or a stop waits on it (load_latest, list, discard_after): a remote that hangs counts as
# unreachable (an object store lists a prefix in well under a second; 60 s, botocore's own
# read timeout, held every start against a hung endpoint a minute)
REMOTE_LIST_TIMEOUT_S = 20.0


class RemoteStore:
    """List, upload, download and delete checkpoints under one fsspec URL."""

    def __init__(
        self, url: str, options: Mapping[str, Any] | None = None, compression: str | None = None
    ) -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"remote compression must be None or 'zstd', got {compression!r}")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(options or {}))
        except ImportError as e:
            raise ImportError(
                f"remote {url!r} needs an fsspec backend that is not installed: {e} "
                "(for s3:// install prime-ckpt[s3])"
            ) from None
        except ValueError as e:
            raise ValueError(f"remote {url!r} is not a usable fsspec URL: {e}") from None
        self.url = url
        self.root = self.root.rstrip("/")
        self.compression = compression
        self._local = "file" in _protocols(self.fs)
        self.listing = Breaker()  # `steps()` bounded, not asked again for a while once it hung
        self.moved_at = time.monotonic()  # when an upload last sent (or buffered) data

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):  # nothing there (yet)
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def step_prefixes(self) -> list[int]:
        """Every step with something uploaded, committed or torn."""
        return sorted(s for n in self._names() if (s := parse_step_dirname(n)) is not None)

    def steps(self) -> list[int]:
        """Committed steps (manifest present), newest first."""
        return [
            s
            for s in reversed(self.step_prefixes())
            if self.fs.exists(self.path(step_dirname(s), MANIFEST_NAME))
        ]

    def manifest(self, step: int) -> Manifest:
        try:
            data = self.fs.cat_file(self.path(step_dirname(step), MANIFEST_NAME))
        except FileNotFoundError as e:
            raise ManifestError(f"{self.url}/{step_dirname(step)}: no manifest (torn)") from e
        return Manifest.from_bytes(data)

    def upload(self, local: Path, retry: Callable[[Callable[[], None], str], None]) -> Manifest:
        """Upload a committed local step: data files, then the manifest."""
        m = read_manifest(local)
        prefix = step_dirname(m.step)
        for name in sorted(m.files):
            retry(lambda n=name: self._put(local / n, self.path(prefix, n)), name)
        remote = Manifest(
            m.step,
            m.files,
            m.world_size,
            dict(m.extra, compression=self.compression),
            m.user,
            format=m.format,
        )
        remote.created = m.created
        data = remote.to_bytes()
        retry(lambda: self.fs.pipe_file(self.path(prefix, MANIFEST_NAME), data), MANIFEST_NAME)
        self.moved_at = time.monotonic()
        return remote

    def _put(self, src: Path, dst: str) -> None:
        if self._local:
            self.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        part = max(_PART, -(-src.stat().st_size // 9_000))  # (S3 takes at most 10,000 parts)
        with open(src, "rb") as f, self.fs.open(dst, "wb", block_size=part) as out:
            w = out
            if self.compression == "zstd":
                w = zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False)
            while chunk := f.read(_CHUNK):
                w.write(chunk)  # (a part is sent once the file has buffered one)
                self.moved_at = time.monotonic()
            if w is not out:
                w.flush(zstandard.FLUSH_FRAME)
        self.moved_at = time.monotonic()

    def download(self, step: int, dest: Path) -> Manifest:
        """Download and verify one committed step into `dest` (a local folder)."""
        try:
            m = self.manifest(step)
        except ManifestError as e:
            raise CorruptCheckpoint(str(e)) from None
        dest.mkdir(parents=True, exist_ok=True)
        prefix = step_dirname(step)
        compressed = m.extra.get("compression") == "zstd"
        for name, entry in m.files.items():
            h = m.hasher()
            size = 0
            try:
                with (
                    self.fs.open(self.path(prefix, name), "rb") as f,
                    open(dest / name, "wb") as out,
                ):
                    src = zstandard.ZstdDecompressor().stream_reader(f) if compressed else f
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{self.url}/{prefix}/{name}: missing") from None
            except zstandard.ZstdError as e:
                raise CorruptCheckpoint(f"{self.url}/{prefix}/{name}: bad zstd data: {e}") from None
            if size != entry.size or h.hexdigest() != entry.digest:
                raise CorruptCheckpoint(
                    f"{self.url}/{prefix}/{name}: checksum mismatch (corrupted)"
                )
        local = Manifest(m.step, m.files, m.world_size, {"layout": 1}, m.user, format=m.format)
        local.created = m.created
        (dest / MANIFEST_NAME).write_bytes(local.to_bytes())
        return m

    def delete(self, step: int) -> None:
        """Uncommit first (manifest), then remove the files."""
        prefix = self.path(step_dirname(step))
        try:
            self.fs.rm_file(self.path(step_dirname(step), MANIFEST_NAME))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass


def _protocols(fs: Any) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)
