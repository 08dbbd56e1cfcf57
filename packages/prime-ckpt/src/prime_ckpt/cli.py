"""`prime-ckpt` command line."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list checkpoints")
    sub.add_parser("verify", help="verify checkpoints")
    parser.parse_args(argv)
    print("prime-ckpt: not yet implemented", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
