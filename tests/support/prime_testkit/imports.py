"""Whether a Prime package imports alone (without its siblings)."""

from __future__ import annotations

import subprocess
import sys

PACKAGES = ("prime_mesh", "prime_ckpt", "prime_comm", "prime_train")


def sibling_imports(package: str) -> list[str]:
    """The sibling packages that importing `package` and every submodule pulls in, checked in
    a fresh interpreter (a test process has every package loaded already)."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    if package not in out:
        raise AssertionError(f"{package} was not imported: {out}")
    return sorted(set(out) & set(PACKAGES) - {package})
