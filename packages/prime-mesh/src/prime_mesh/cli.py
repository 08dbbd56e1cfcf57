"""`prime-mesh` command line."""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-mesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("coordinator", help="run the membership coordinator")
    sub.add_parser("status", help="print the members of a running job")
    parser.parse_args(argv)
    print("prime-mesh: not yet implemented", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
