"""A partial download's record of the byte ranges already written (what a rerun resumes)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

JOURNAL = ".progress"


class Journal:
    """Append-only record of finished byte ranges, one 'start<TAB>end<TAB>name' line each.
    Ranges rather than chunk numbers, so a rerun with another chunk size still resumes."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / JOURNAL
        self._lock = threading.Lock()
        self._fd: int | None = None

    def load(self) -> dict[str, list[tuple[int, int]]]:
        """File name -> finished [start, end) ranges."""
        done: dict[str, list[tuple[int, int]]] = {}
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return done
        for line in text.split("\n")[:-1]:  # a torn last line has no newline: refetched
            start, _, rest = line.partition("\t")
            end, _, name = rest.partition("\t")
            if start.isdigit() and end.isdigit() and name:
                done.setdefault(name, []).append((int(start), int(end)))
        return done

    @staticmethod
    def covers(done: dict[str, list[tuple[int, int]]], name: str, start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in done.get(name, ()))

    def mark(self, name: str, start: int, end: int) -> None:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, f"{start}\t{end}\t{name}\n".encode())

    def forget(self, names: set[str]) -> None:
        """Drop every record of `names` (their files failed the checksum)."""
        self.close()
        keep = [
            f"{s}\t{e}\t{n}\n"
            for n, ranges in sorted(self.load().items())
            if n not in names
            for s, e in ranges
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(self.path)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
