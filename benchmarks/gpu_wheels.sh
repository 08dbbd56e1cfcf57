#!/usr/bin/env bash
# Fetch into DEST (default .whl/ at the repository root, git-ignored) the wheels that
# benchmarks/gpu_check.sh needs on a GPU machine without network: Python 3.12 x86-64 with
# torch, numpy, msgpack, fsspec, cmake and pybind11, but no pydantic, zstandard or hatchling.
# Run it where a package index is reachable; the versions are the ones uv.lock pins.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
# pydantic and its needs, zstandard, and hatchling (the pure packages' build backend) with its
# needs that machine lacks
NAMES="pydantic pydantic-core annotated-types typing-inspection typing-extensions zstandard \
hatchling trove-classifiers tomlkit packaging"
pins=$("$PY" - "$NAMES" <<'PY'
import sys, tomllib
lock = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"]}
print(" ".join(f"{n}=={lock[n]}" if n in lock else n for n in sys.argv[1].split()))
PY
)
mkdir -p "$DEST"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" $pins
ls "$DEST"
