"""A corpus as a list of parts, and the documents of one part, read with pyarrow.

A part is the unit of tokenization work and of data sharding: one file of a text corpus
(each file is one document), one row group of a parquet file, one JSON-lines file. Parts
are listed from file metadata only (parquet footers), so every rank lists the same parts
cheaply and reads only the ones it tokenizes. Documents are streamed in batches, so memory
stays bounded by a batch, whatever the size of a part.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prime_train.tokens import DataError

SUFFIXES = {"parquet": ".parquet", "jsonl": ".jsonl"}
BATCH_ROWS = 256  # documents read at once from a parquet or JSON-lines part


@dataclass(frozen=True)
class Part:
    """`file`'s row group `index` (parquet), or the whole file (text, JSON lines)."""

    file: str
    index: int = 0
    rows: int = 1

    @property
    def name(self) -> str:
        return f"{Path(self.file).name}#{self.index}"


def resolve_files(pattern: str, source: str = "text") -> list[Path]:
    """Files from a folder (recursively) or a glob; '{stdlib}' is the standard library. A
    folder of a parquet or jsonl corpus yields its `*.parquet` / `*.jsonl` files."""
    pattern = pattern.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
    p = Path(pattern).expanduser()
    if p.is_dir():
        suffix = SUFFIXES.get(source)
        files = [f for f in p.rglob("*") if f.is_file() and (not suffix or f.suffix == suffix)]
    else:
        files = [Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file()]
    if not files:
        example = {"parquet": "data/*.parquet", "jsonl": "data/*.jsonl"}.get(
            source, "corpus/**/*.txt"
        )
        raise DataError(
            f"data.path = {pattern!r} matches no files; give a folder or a glob such as {example!r}"
        )
    return sorted(files)


def list_parts(files: list[Path], source: str, text_field: str) -> list[Part]:
    """Every part of the corpus; an unreadable parquet file or a missing text column is a
    DataError naming the file."""
    if source != "parquet":
        return [Part(str(f)) for f in files]
    import pyarrow.parquet as pq

    parts = []
    for f in files:
        try:
            meta = pq.ParquetFile(f)
        except OSError as e:
            raise DataError(f"cannot read {f}: {e}") from None
        except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not parquet
            raise DataError(f"cannot read {f}: not a parquet file ({e})") from None
        if text_field not in meta.schema_arrow.names:
            raise DataError(
                f"{f} has no column {text_field!r} (columns: {', '.join(meta.schema_arrow.names)}); "
                "set data.text_field"
            )
        md = meta.metadata
        parts += [Part(str(f), i, md.row_group(i).num_rows) for i in range(md.num_row_groups)]
        meta.close()
    if not any(p.rows for p in parts):
        raise DataError(f"the parquet files ({files[0]}, ...) hold no rows: the corpus is empty")
    return [p for p in parts if p.rows]


def is_heldout(name: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split_heldout(parts: list[Part], fraction: float) -> tuple[list[Part], list[Part]]:
    """(train, held-out) parts, by a stable hash of each part's name; at least one of each."""
    if len(parts) < 2:
        raise DataError(
            f"the corpus has one part ({parts[0].file}); need at least two documents "
            "(text files) or parts (parquet row groups, JSON-lines files)"
        )
    held = [p for p in parts if is_heldout(p.name, fraction)]
    if not held or len(held) == len(parts):
        held = parts[-1:]  # too few parts for the fraction: hold out the last one
    held_set = set(held)
    return [p for p in parts if p not in held_set], held


def documents(part: Part, source: str, text_field: str) -> Iterator[list[str | bytes]]:
    """The documents of a part in batches (a text file is one document, as bytes)."""
    path = Path(part.file)
    try:
        if source == "text":
            yield [path.read_bytes()]
        elif source == "parquet":
            import pyarrow.parquet as pq

            with pq.ParquetFile(path) as f:
                for batch in f.iter_batches(BATCH_ROWS, [part.index], columns=[text_field]):
                    yield _texts(batch.column(0), path, text_field)
        elif source == "jsonl":
            import pyarrow.json as pj

            reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=1 << 22))
            for batch in reader:
                if text_field not in batch.schema.names:
                    raise DataError(f"{path} has no field {text_field!r}; set data.text_field")
                yield _texts(
                    batch.column(batch.schema.get_field_index(text_field)), path, text_field
                )
        else:
            raise DataError(f"data.source = {source!r} has no documents")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except DataError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid for malformed input
        raise DataError(f"cannot read {path}: {e}") from None


def _texts(column, path: Path, field: str) -> list[str]:
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{path}: field {field!r} holds {column.type}, not text")
    return [t for t in column.to_pylist() if t]
