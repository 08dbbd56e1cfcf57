"""Peaks of each node's memory (its process tree, from /proc) and disk, sampled in a thread:
what `benchmarks/real_size.py` reports per parameter."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from prime_testkit.children import descendants

FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmHWM")


def _status(pid: int) -> dict[str, int]:
    """The FIELDS of /proc/PID/status, in bytes (empty once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    got = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in FIELDS:
            got[key] = int(value.split()[0]) * 1024
    return got


def _disk(folder: Path) -> int:
    """Bytes allocated under `folder`."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Sampler(threading.Thread):
    """Peaks of each node's memory (its process tree) and disk, sampled until `stop()`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.nodes: dict[str, tuple[int, Path]] = {}
        self.peak: dict[str, dict[str, int]] = {}
        self._halt = threading.Event()

    def watch(self, name: str, pid: int, folder: Path) -> None:
        self.peak[name] = {"anon": 0, "staging": 0, "hwm": 0, "disk": 0}
        self.nodes[name] = (pid, folder)

    def run(self) -> None:
        tick = 0
        while not self._halt.wait(0.2):
            tick += 1
            for name, (pid, folder) in list(self.nodes.items()):
                peak, st = self.peak[name], [_status(p) for p in descendants(pid)]
                anon = sum(s.get("RssAnon", 0) for s in st)
                staging = sum(s.get("RssFile", 0) + s.get("RssShmem", 0) for s in st)
                peak["anon"], peak["staging"] = (
                    max(peak["anon"], anon),
                    max(peak["staging"], staging),
                )
                peak["hwm"] = max(peak["hwm"], sum(s.get("VmHWM", 0) for s in st))
                if tick % 3 == 0:
                    peak["disk"] = max(peak["disk"], _disk(folder))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
