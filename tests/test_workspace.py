"""The workspace's promises: packages import alone, dependencies point one way."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAVES = {"prime_mesh", "prime_ckpt", "prime_comm"}


def imported_packages(src: Path) -> set[str]:
    found = set()
    for f in src.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_leaf_packages_never_import_each_other():
    for leaf in LEAVES:
        pkg = ROOT / "packages" / leaf.replace("_", "-") / "src"
        others = imported_packages(pkg) & (LEAVES | {"prime_train"}) - {leaf}
        assert not others, f"{leaf} imports {others}"
