"""Tokenizing a corpus in worker processes into memory-mapped token files on disk.

Every machine tokenizes the whole corpus once (its training parts into one file, the held-out
parts into another), so any node can read any data slot at once (see `slot_loader.py`): a slot
handed over when membership changes never waits for tokens. Processes on one machine that
share the cache build it once: one holds a lock while it builds, the others wait for it and
read the result. Workers each tokenize one part at a time into a part file; the parent streams
the part files, in order, into one `.npy` and renames it into place. Memory stays bounded by
what the workers hold (one batch of documents each), not by the corpus; a crash never leaves a
torn cache (a builder that dies releases the lock).

Files are keyed by the data's content (each file's name and SHA-256, so the same corpus under
another folder or copied to another machine finds the same cache), the tokenizer and the text
field: a re-run reuses them, a changed file rebuilds them. A file's digest is computed once
per version of it (remembered by path, size, mtime and inode).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prime_train.corpus import Part, documents, list_parts, resolve_files, split_heldout
from prime_train.files import write_atomic
from prime_train.tokens import DataError, make_tokenizer

CACHE_VERSION = 4


@dataclass(frozen=True)
class CorpusSpec:
    """What the tokens depend on: the data, how to read it, and the tokenizer."""

    path: str
    source: str = "text"
    text_field: str = "text"
    tokenizer: str = "byte"
    heldout_fraction: float = 0.05


@dataclass(frozen=True)
class CorpusTokens:
    """The corpus's training tokens and its held-out tokens (`.npy`, memory-mappable)."""

    train: Path
    heldout: Path
    parts: int  # training parts


def content_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of a file's bytes, remembered under `cache_dir/digests` for this version of
    the file (path, size, mtime, inode), so a re-run reads only the files that changed."""
    st = path.stat()
    stamp = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    memo = cache_dir / "digests" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        return memo.read_text()
    except FileNotFoundError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(memo, digest)
    return digest


def _key(spec: CorpusSpec, tokenizer_name: str, files: list[Path], cache_dir: Path) -> str:
    src: list = [CACHE_VERSION, spec.source, spec.text_field, tokenizer_name]
    src.append(spec.heldout_fraction)
    src += [[f.name, content_digest(f, cache_dir)] for f in files]
    return hashlib.sha256(json.dumps(src).encode()).hexdigest()[:20]


# --- worker side: one tokenizer per process, one part per task --------------------------

_worker_tok = None


def _init_worker(tokenizer: str) -> None:
    global _worker_tok
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
    _worker_tok = make_tokenizer(tokenizer)


def _tokenize_part(task: tuple[Part, str, str, str, str]) -> int:
    """Tokenize one part into `out` (raw tokens, documents separated by end-of-text)."""
    part, source, field, out, dtype = task
    tok = _worker_tok
    eos = [] if tok.eos_id is None else [tok.eos_id]
    n = 0
    with open(out, "wb") as f:
        for batch in documents(part, source, field):
            for doc in batch:
                ids = tok.encode_bytes(doc) if isinstance(doc, bytes) else tok.encode_text(doc)
                arr = np.concatenate([ids, eos]).astype(dtype)
                f.write(arr.tobytes())
                n += len(arr)
    return n


# --- parent side -------------------------------------------------------------------------


def _build(dest: Path, parts: list[Part], spec: CorpusSpec, vocab: int, workers: int) -> None:
    """Tokenize `parts` in order into the `.npy` file `dest` (written aside, then renamed)."""
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        tasks = [
            (p, spec.source, spec.text_field, str(tmp / f"{i:08d}.bin"), dtype.str)
            for i, p in enumerate(parts)
        ]
        if workers <= 0:  # in this process (tests, tiny corpora)
            _init_worker(spec.tokenizer)
            counts = [_tokenize_part(t) for t in tasks]
        else:
            ctx = mp.get_context("spawn")  # no fork of a process that runs torch threads
            with ctx.Pool(workers, _init_worker, (spec.tokenizer,)) as pool:
                counts = list(pool.imap(_tokenize_part, tasks))
        total = sum(counts)
        out = tmp / "tokens.npy"
        with open(out, "wb") as f:
            header = {"descr": dtype.str, "fortran_order": False, "shape": (total,)}
            np.lib.format.write_array_header_1_0(f, header)
            for _, _, _, part_file, _ in tasks:
                with open(part_file, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 22)
                os.unlink(part_file)
            f.flush()
            os.fsync(f.fileno())
        os.replace(out, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_corpus_tokens(spec: CorpusSpec, cache_dir: Path, workers: int = 0) -> CorpusTokens:
    """Tokenize (or find cached) the corpus's training and held-out parts (module doc)."""
    tok = make_tokenizer(spec.tokenizer)
    files = resolve_files(spec.path, spec.source)
    train, held = split_heldout(
        list_parts(files, spec.source, spec.text_field), spec.heldout_fraction
    )
    out = cache_dir / _key(spec, tok.name, files, cache_dir)
    train_file, held_file = out / "train.npy", out / "heldout.npy"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a") as lock:
        # the first process builds; the others wait here, then find the files (the lock
        # is released by the kernel if the builder dies, so the wait ends with it)
        fcntl.flock(lock, fcntl.LOCK_EX)
        for dest, parts in ((held_file, held), (train_file, train)):
            if not dest.is_file():
                _build(dest, parts, spec, tok.vocab_size, workers)
            if np.load(dest, mmap_mode="r").size == 0:
                raise DataError(
                    f"{parts[0].file}{' and others' if len(parts) > 1 else ''}: no text to "
                    f"train on (empty documents or field {spec.text_field!r}); the corpus is "
                    "empty"
                )
        info = out / "parts.json"
        if not info.is_file():
            listing = {"tokenizer": tok.name, "heldout": [p.name for p in held]}
            write_atomic(info, json.dumps(listing) + "\n")
    return CorpusTokens(train_file, held_file, len(train))
