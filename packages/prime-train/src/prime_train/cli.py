"""`prime-train`: train a model with DiLoCo across nodes.

Usage: prime-train --config FILE.toml [--section.key value ...]
"""

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prime-train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="path to a TOML config (see configs/)")
    args, _overrides = parser.parse_known_args(argv)
    path = Path(args.config)
    if not path.is_file():
        print(
            f"prime-train: config file not found: {path} (pass an existing TOML file, "
            "e.g. --config configs/debug.toml)",
            file=sys.stderr,
        )
        return 2
    try:
        path.read_bytes()
    except OSError as e:
        print(f"prime-train: cannot read config {path}: {e.strerror}", file=sys.stderr)
        return 2
    print("prime-train: the trainer is not implemented yet", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
