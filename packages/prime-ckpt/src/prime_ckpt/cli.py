"""`prime-ckpt` command line: list and verify checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prime_ckpt.manifest import ManifestError, read_manifest, step_dirname, verify_dir
from prime_ckpt.records import CheckpointInfo, _info
from prime_ckpt.staging import default_shm_dir
from prime_ckpt.writer import TMP_PREFIX, disk_steps


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _disk_dir(arg: str) -> Path:
    d = Path(arg)
    if not d.is_dir():
        raise UsageError(f"{arg}: no such checkpoint folder (pass the disk_dir of a run)")
    return d


def _ram_copies(d: Path, verify: bool) -> list[CheckpointInfo]:
    """RAM copies of this folder's run on this machine (one shared-memory folder per rank)."""
    base = default_shm_dir(d, 0)
    out = []
    for shm in sorted(base.parent.glob(base.name.removesuffix("-r0") + "-r*")):
        for slot in sorted(shm.glob("slot-*")):
            try:
                step = read_manifest(slot).step
            except ManifestError:
                continue
            info = _info(step, "ram", slot, verify)
            info.tier = f"ram:{shm.name.rsplit('-', 1)[1]}"
            out.append(info)
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    d = _disk_dir(args.dir)
    rows = [_info(s, "disk", d / step_dirname(s), not args.quick, m) for s, m in disk_steps(d)]
    rows += _ram_copies(d, not args.quick)
    rows.sort(key=lambda r: (-r.step, r.tier))
    torn = [p.name for p in d.iterdir() if p.name.startswith(TMP_PREFIX)]
    if not rows:
        print(f"{d}: no committed checkpoints")
    else:
        print(f"{'step':>10}  {'tier':<8} {'size':>10}  {'verified':<8}  path")
        for r in rows:
            v = {True: "yes", False: "NO", None: "-"}[r.verified]
            line = f"{r.step:>10}  {r.tier:<8} {_human(r.size):>10}  {v:<8}  {r.path}"
            print(line + (f"  ({r.detail})" if r.detail else ""))
    for t in torn:
        print(f"torn (ignored, cleaned at next start): {d / t}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    d = _disk_dir(args.dir)
    steps = [s for s, _ in disk_steps(d)]
    if args.step is not None:
        if args.step not in steps:
            raise UsageError(f"{d}: no committed step {args.step} (committed: {steps or 'none'})")
        steps = [args.step]
    if not steps:
        print(f"{d}: no committed checkpoints")
        return 1
    bad = 0
    for s in steps:
        problems = verify_dir(d / step_dirname(s))
        if problems:
            bad += 1
            print(f"step {s}: CORRUPT")
            for p in problems:
                print(f"  {p}")
        else:
            print(f"step {s}: ok")
    print(f"{len(steps) - bad} of {len(steps)} checkpoints verified")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list checkpoints: step, tier, size, verified")
    p.add_argument("dir", help="checkpoint folder (the disk_dir of a run)")
    p.add_argument("--quick", action="store_true", help="skip checksum verification")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check every file of every (or one) checkpoint")
    p.add_argument("dir", help="checkpoint folder (the disk_dir of a run)")
    p.add_argument("step", nargs="?", type=int, help="only this step")
    p.set_defaults(fn=cmd_verify)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"prime-ckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
