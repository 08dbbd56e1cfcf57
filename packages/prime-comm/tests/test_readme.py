"""The README's examples run as written and print the figures their comments state."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from prime_testkit import free_port

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "example.py"
    script.write_text(code)
    # block-buffered output: each rank's lines reach the shared pipe in one write at its exit
    # (unbuffered, two ranks' print() pieces interleave: "01 4063760 ...")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_first_example_quantizes_and_all_reduces(tmp_path):
    code = blocks()[0]
    assert '"29533"' in code
    out = run(code.replace('"29533"', f'"{free_port()}"'), tmp_path).splitlines()
    size, err = out[0].split()
    assert size == "1016384" and 0.9 <= float(err.rstrip("%")) <= 1.0
    ranks = sorted(line.split()[:3] for line in out[1:])
    assert ranks == [["0", "4063760", "16000000"], ["1", "4063760", "16000000"]]


def test_bits_example_prints_its_comments(tmp_path):
    code = blocks()[1]
    expected = [line[2:] for line in code.splitlines() if re.match(r"# \d ", line)]
    assert len(expected) == 3
    assert run(code, tmp_path).splitlines() == expected
