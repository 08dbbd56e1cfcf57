"""What a person sees: prefixed progress lines, metrics.jsonl, the summary and the loss plot."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from prime_train.files import write_atomic


class Log:
    """Lines that say which node and rank speaks; only `primary` ranks print progress."""

    def __init__(self, prefix: str, primary: bool, stream: TextIO | None = None):
        self.prefix, self.primary = prefix, primary
        self.stream = stream

    def info(self, msg: str) -> None:
        if self.primary:
            self._write(msg)

    def warn(self, msg: str) -> None:
        self._write(f"warning: {msg}")

    def error(self, msg: str) -> None:
        self._write(f"error: {msg}")

    def _write(self, msg: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(f"{self.prefix} {msg}\n")
        stream.flush()


class LogLines(logging.Handler):
    """A library logger's warnings and errors as lines of a node's `Log` (`warning: ...`,
    `error: ...`): one line per record, never a traceback. prime_ckpt logs a checkpoint save
    or upload that failed in the background on its `prime_ckpt` logger; without a handler
    Python would print it bare on stderr. `attach` it for a run, `detach` it after."""

    def __init__(self, log: Log, logger: str) -> None:
        super().__init__(logging.WARNING)
        self.log, self.logger = log, logging.getLogger(logger)

    @classmethod
    def attach(cls, log: Log, logger: str = "prime_ckpt") -> LogLines:
        handler = cls(log, logger)
        handler.logger.addHandler(handler)
        return handler

    def detach(self) -> None:
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = " ".join(record.getMessage().splitlines())
            (self.log.error if record.levelno >= logging.ERROR else self.log.warn)(msg)
        except Exception:
            self.handleError(record)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a crash: skip it
            continue
    return out


class MetricsSink(Protocol):
    """Somewhere else the same metrics rows go (the mesh's status page, experiment trackers)."""

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Metrics:
    """Appends one JSON object per line; on resume drops records past the resumed step.
    Every row also goes to the added sinks (see `reporting`)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._f: TextIO | None = None
        self.sinks: list[MetricsSink] = []

    def open(self, resume_step: int) -> None:
        """Keep the rows up to `resume_step` (again: a node that found the run anew goes back
        to its checkpoint), and append from there."""
        if self.path is None:
            return
        if self._f is not None:
            self._f.close()
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        if self.path.exists():
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._f = open(self.path, "a")  # noqa: SIM115 - kept open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        row = {**record, "time": round(time.time(), 3)}
        if self._f is not None:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks.clear()
        if self._f is not None:
            self._f.close()
            self._f = None
