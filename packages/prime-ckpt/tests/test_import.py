"""prime-ckpt alone: importing it pulls in no other Prime package."""

import subprocess
import sys

SIBLINGS = ("prime_mesh", "prime_ckpt", "prime_comm", "prime_train")


def test_imports_alone():
    """In a fresh interpreter (this test process has every package loaded), importing
    prime_ckpt and its submodules imports none of its sibling packages."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import prime_ckpt\n"
        "for m in pkgutil.walk_packages(prime_ckpt.__path__, 'prime_ckpt.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert "prime_ckpt" in out
    siblings = sorted(set(out) & set(SIBLINGS) - {"prime_ckpt"})
    assert not siblings, f"importing prime_ckpt imported {siblings}"
