"""`prime-ckpt` command line: list, verify and export checkpoints (local folders or fsspec URLs)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from prime_ckpt.errors import CheckpointError, ManifestError, UsageError
from prime_ckpt.export import export
from prime_ckpt.manifest import read_manifest, step_dirname, verify_dir
from prime_ckpt.records import CheckpointInfo, checkpoint_info
from prime_ckpt.remote import RemoteStore
from prime_ckpt.staging import default_shm_dir
from prime_ckpt.writer import TMP_PREFIX, disk_steps


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
            info = checkpoint_info(step, "ram", slot, verify)
            info.tier = f"ram:{shm.name.rsplit('-', 1)[1]}"
            out.append(info)
    return out


def _is_url(s: str) -> bool:
    return "://" in s


def _store(args: argparse.Namespace) -> RemoteStore:
    options = {}
    for kv in args.option or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise UsageError(f"--option {kv!r}: expected KEY=VALUE")
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    return RemoteStore(args.dir, options)


def _remote_ok(store: RemoteStore, step: int) -> str:
    """'' when the remote step downloads and verifies, else the problem."""
    with tempfile.TemporaryDirectory(prefix="prime-ckpt-verify-") as tmp:
        try:
            store.download(step, Path(tmp) / "step")
        except CheckpointError as e:
            return str(e)
    return ""


def ls_remote(args: argparse.Namespace) -> int:
    store = _store(args)
    steps = store.steps()
    torn = [s for s in store.step_prefixes() if s not in steps]
    if not steps:
        print(f"{args.dir}: no committed checkpoints")
    else:
        print(f"{'step':>10}  {'tier':<8} {'size':>10}  {'verified':<8}  path")
    for s in steps:
        try:
            size = sum(f.size for f in store.manifest(s).files.values())
            problem = "" if args.quick else _remote_ok(store, s)
        except Exception as e:
            size, problem = 0, str(e)
        v = "-" if args.quick and not problem else ("NO" if problem else "yes")
        path = f"{args.dir.rstrip('/')}/{step_dirname(s)}"
        print(
            f"{s:>10}  {'remote':<8} {_human(size):>10}  {v:<8}  {path}"
            + (f"  ({problem})" if problem else "")
        )
    for s in torn:
        print(f"torn (no manifest, ignored): {args.dir.rstrip('/')}/{step_dirname(s)}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if _is_url(args.dir):
        return ls_remote(args)
    d = _disk_dir(args.dir)
    rows = [
        checkpoint_info(s, "disk", d / step_dirname(s), not args.quick, m) for s, m in disk_steps(d)
    ]
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
    if _is_url(args.dir):
        store = _store(args)
        steps = store.steps()
        check = lambda s: _remote_ok(store, s)  # noqa: E731
        d = args.dir
    else:
        d = _disk_dir(args.dir)
        steps = [s for s, _ in disk_steps(d)]
        check = lambda s: "; ".join(verify_dir(d / step_dirname(s)))  # noqa: E731
    if args.step is not None:
        if args.step not in steps:
            raise UsageError(f"{d}: no committed step {args.step} (committed: {steps or 'none'})")
        steps = [args.step]
    if not steps:
        print(f"{d}: no committed checkpoints")
        return 1
    bad = 0
    for s in steps:
        problems = check(s)
        if problems:
            bad += 1
            print(f"step {s}: CORRUPT")
            for p in problems.split("; "):
                print(f"  {p}")
        else:
            print(f"step {s}: ok")
    print(f"{len(steps) - bad} of {len(steps)} checkpoints verified")
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="prime-ckpt-export-") as tmp:
        if _is_url(args.dir):
            store = _store(args)
            steps = store.steps() if args.step is None else [args.step]
            for s in steps:
                if not (problem := _remote_ok(store, s)):
                    store.download(s, Path(tmp) / "step")
                    step_dir = Path(tmp) / "step"
                    break
                print(f"step {s}: skipped ({problem})", file=sys.stderr)
            else:
                raise UsageError(f"{args.dir}: no committed step that verifies")
        else:
            d = _disk_dir(args.dir)
            if (d / "manifest.msgpack").is_file():  # a step folder itself
                candidates = [d]
            else:
                steps = [s for s, _ in disk_steps(d)] if args.step is None else [args.step]
                candidates = [d / step_dirname(s) for s in steps]
            for c in candidates:
                if not (problems := verify_dir(c)):
                    step_dir = c
                    break
                print(f"{c}: skipped ({'; '.join(problems)})", file=sys.stderr)
            else:
                raise UsageError(f"{d}: no committed step that verifies")
        step, n = export(step_dir, out, args.format)
    print(f"exported step {step} ({n} tensors) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    where = "checkpoint folder (a run's disk_dir) or remote URL (s3://bucket/run, file://...)"
    opt = "fsspec option for a URL, e.g. endpoint_url=http://host:9000 (credentials: use env vars)"
    p = sub.add_parser("ls", help="list checkpoints: step, tier, size, verified")
    p.add_argument("dir", metavar="DIR_OR_URL", help=where)
    p.add_argument("--quick", action="store_true", help="skip checksum verification")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help=opt)
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check every file of every (or one) checkpoint")
    p.add_argument("dir", metavar="DIR_OR_URL", help=where)
    p.add_argument("step", nargs="?", type=int, help="only this step")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help=opt)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("export", help="write consolidated weights (safetensors or torch)")
    p.add_argument("dir", metavar="DIR_OR_URL", help=where + ", or one step folder")
    p.add_argument("step", nargs="?", type=int, help="this step (default: newest that verifies)")
    p.add_argument("--out", required=True, help="output file (.safetensors, else a torch file)")
    p.add_argument("--format", choices=["safetensors", "torch"], help="default: from --out suffix")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help=opt)
    p.set_defaults(fn=cmd_export)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (UsageError, OSError, ValueError, ImportError, TypeError) as e:
        print(f"prime-ckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
