"""Tokenizers and the cached, memory-mapped token files built from text.

Text files are split into a training and a held-out set by document (a stable hash of each
file's path), tokenized once, and written as two `.npy` token arrays that every rank maps
read-only. Files are written aside and renamed, so a crash never leaves a torn cache and
concurrent builders (ranks, local nodes) simply race to an identical result.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")


class DataError(ValueError):
    """Bad data settings (no files, unreadable tokenizer, too little text)."""


class ByteTokenizer:
    """Each UTF-8 byte is a token; 256 marks the end of a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode_file(self, path: Path) -> np.ndarray:
        return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)

    def encode_text(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (install prime-train[hf])."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                f"data.tokenizer = {str(path)!r} needs the `tokenizers` package: "
                "install prime-train[hf] (uv pip install tokenizers) or use 'byte'"
            ) from None
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path} (give a tokenizer.json or 'byte')")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"cannot load tokenizer {path}: {e}") from None
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.name = f"hf-{digest}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.path = path
        found = [(t, self._tok.token_to_id(t)) for t in _EOS_NAMES]
        self.eos_token, self.eos_id = next(
            ((t, i) for t, i in found if i is not None), (None, None)
        )

    def encode_file(self, path: Path) -> np.ndarray:
        return self.encode_text(path.read_bytes().decode("utf-8", errors="replace"))

    def encode_text(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(Path(spec).expanduser())


def resolve_files(pattern: str) -> list[Path]:
    """Text files from a folder (recursively) or a glob; '{stdlib}' is the standard library."""
    pattern = pattern.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    p = Path(pattern).expanduser()
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file()]
    else:
        files = [Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file()]
    if not files:
        raise DataError(
            f"data.path = {pattern!r} matches no files; give a folder or a glob "
            "such as 'corpus/**/*.txt'"
        )
    return sorted(files)


def is_heldout(path: Path, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(path.name.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


@dataclass(frozen=True)
class TokenFiles:
    train: Path
    heldout: Path
    vocab_size: int


def _write_aside(dest: Path, data: np.ndarray | bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                np.save(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_token_cache(
    pattern: str, tokenizer: ByteTokenizer | HFTokenizer, heldout_fraction: float, cache_dir: Path
) -> TokenFiles:
    """Tokenize the files once; later calls (any rank, any run) reuse the cached arrays."""
    files = resolve_files(pattern)
    key_src = [tokenizer.name, heldout_fraction]
    for f in files:
        st = f.stat()
        key_src.append([str(f), st.st_size, st.st_mtime_ns])
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:20]
    out = cache_dir / key
    train, heldout = out / "train.npy", out / "heldout.npy"
    if train.is_file() and heldout.is_file():
        return TokenFiles(train, heldout, tokenizer.vocab_size)

    heldout_files = [f for f in files if is_heldout(f, heldout_fraction)]
    if not heldout_files or len(heldout_files) == len(files):
        # too few documents for the fraction: hold out the last file, train on the rest
        heldout_files = files[-1:]
    if len(files) < 2:
        raise DataError(f"data.path = {pattern!r} matches one file; need at least two documents")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    held = set(heldout_files)
    for dest, group in ((train, [f for f in files if f not in held]), (heldout, heldout_files)):
        parts = []
        for f in group:
            try:
                ids = tokenizer.encode_file(f)
            except OSError as e:
                raise DataError(f"cannot read {f}: {e.strerror}") from None
            parts.append(ids)
            if tokenizer.eos_id is not None:
                parts.append(np.array([tokenizer.eos_id], dtype=np.int64))
        _write_aside(dest, np.concatenate(parts).astype(dtype))
    info = {"tokenizer": tokenizer.name, "heldout": [str(f) for f in heldout_files]}
    _write_aside(out / "files.json", json.dumps(info).encode())
    return TokenFiles(train, heldout, tokenizer.vocab_size)
