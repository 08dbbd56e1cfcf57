"""What a test asserts of memory: the process's own figures from /proc."""

from __future__ import annotations

from pathlib import Path


def rss_anon_kib() -> int:
    """This process's anonymous resident memory (RssAnon), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")
