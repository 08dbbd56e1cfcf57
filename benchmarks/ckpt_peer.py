"""Peer-transfer throughput on loopback vs a raw socket copy of the same bytes, same run.

    uv run python benchmarks/ckpt_peer.py [--size-mb 256] [--files 4] [--connections 1 4 8]
                                          [--cap-mb-s 100]

Builds a checkpoint of random bytes, then copies it donor -> joiner three ways, each into a
fresh folder and each ending with the files fsynced:
- raw: one TCP connection, the donor `sendfile`s every file, the receiver writes them; no
  HTTP, no authentication, no checksums. The ceiling for this machine.
- raw+sha256, raw+blake3: the same, then the hash of every received file (what any verified
  copy must add): SHA-256, as manifests of format 1 listed it, and BLAKE3, as format 2 does.
- peer N: `fetch_from_peer` with N connections (HMAC-signed Range requests, the BLAKE3 of
  every file, journal, atomic commit).
- paced: what a joiner does (prime-train's snapshot): one connection per donor, 1 MiB chunks,
  reads paced by a `LinkGate` with no cap (its adaptive receive window).
- paced v1: the same from a donor whose manifest is of format 1 (SHA-256 files): the baseline
  of the hash change, in the same process.
- capped: the same with the gate capped at `--cap-mb-s` MB/s; prints the ratio to the cap.
- donor cap: plain fetch from a donor serving with `max_bytes_per_s` = the cap.
Prints the best of `--repeat` runs per mode, MB/s, its ratio to raw and raw+blake3 (and to
the cap for the capped modes), and the CPU seconds per GB the process spent in its best run
(donor and joiner together, user + system: what the transfer takes from a node that also
trains, where a busy machine's wall-clock rate says little). Loopback has no bandwidth limit,
so the uncapped modes measure the CPU cost of the transfer path, the thing peer transfer adds.

With `--wan-mbit R` (root; the WAN bed of tests/support/prime_netbed.py) it also runs donor
and joiner in two network namespaces joined by `tc tbf` links of R Mbit/s, as separate
processes (`python -m prime_ckpt.peer serve/fetch`), and reports the fraction of the link rate
reached with each connection count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prime_ckpt.manifest import FileEntry, Manifest, file_digest, step_dirname
from prime_ckpt.peer import LinkGate, fetch_checkpoint, fetch_from_peer, serve_directory
from prime_train.diloco.fetch import CHUNK_BYTES

TOKEN = "benchmark-token"


def build_checkpoint(root: Path, size_mb: int, files: int, fmt: int = 2) -> tuple[Path, list[Path]]:
    """A donor folder `root/donor-v<fmt>` holding step 1 with a manifest of format `fmt`."""
    d = root / f"donor-v{fmt}" / step_dirname(1)
    d.mkdir(parents=True)
    per = size_mb * (1 << 20) // files
    block = os.urandom(1 << 20)
    paths = []
    for i in range(files):
        p = d / f"shard{i}.bin"
        with open(p, "wb") as f:
            for j in range(per >> 20):
                f.write(block[j % 7 :] + block[: j % 7])  # distinct blocks, cheap to make
        paths.append(p)
    entries = {p.name: FileEntry(p.stat().st_size, file_digest(p, fmt)) for p in paths}
    (d / "manifest.msgpack").write_bytes(Manifest(step=1, files=entries, format=fmt).to_bytes())
    return d.parent, paths


def raw_copy(paths: list[Path], dest: Path, verify: int | None = None) -> float:
    """The baseline: length-prefixed sendfile over one loopback TCP connection."""
    dest.mkdir(parents=True)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def donor() -> None:
        conn, _ = listener.accept()
        with conn:
            for p in paths:
                with open(p, "rb") as f:
                    conn.sendall(struct.pack("!Q", p.stat().st_size))
                    conn.sendfile(f)

    t = threading.Thread(target=donor, daemon=True)
    t0 = time.perf_counter()
    t.start()
    buf = memoryview(bytearray(1 << 20))
    with socket.create_connection(("127.0.0.1", port)) as s:
        for p in paths:
            header = s.recv(8, socket.MSG_WAITALL)
            left = struct.unpack("!Q", header)[0]
            with open(dest / p.name, "wb") as out:
                while left:
                    n = s.recv_into(buf, min(len(buf), left))
                    if not n:
                        raise ConnectionError("raw donor closed early")
                    out.write(buf[:n])
                    left -= n
                out.flush()
                os.fsync(out.fileno())
    if verify:  # what any verified transfer must add: hash what arrived (manifest format)
        for p in paths:
            file_digest(dest / p.name, verify)
    dt = time.perf_counter() - t0
    t.join(timeout=30)
    listener.close()
    return dt


def wan_runs(donor_dir: Path, scratch: Path, size: int, args) -> dict[int, float]:
    """Best fetch time per connection count between two rate-limited namespaces."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from prime_netbed import WanBed, bed_unavailable_reason

    reason = bed_unavailable_reason()
    if reason:
        print(f"skipping the WAN runs: {reason}")
        return {}
    env = dict(os.environ, PRIME_TOKEN=TOKEN)
    best: dict[int, float] = {}
    with WanBed(2, rate_mbit=args.wan_mbit) as bed:
        cmd = [
            sys.executable,
            "-m",
            "prime_ckpt.peer",
            "serve",
            str(donor_dir),
            "--host",
            "0.0.0.0",
            "--advertise-host",
            bed.ip(0),
        ]
        donor = subprocess.Popen(bed.exec_prefix(0) + cmd, stdout=subprocess.PIPE, env=env)
        try:
            url = donor.stdout.readline().decode().strip()
            for r in range(args.repeat):
                for conns in args.connections:
                    dest = scratch / f"wan-{conns}-{r}"
                    t0 = time.perf_counter()
                    subprocess.run(
                        bed.exec_prefix(1)
                        + [
                            sys.executable,
                            "-m",
                            "prime_ckpt.peer",
                            "fetch",
                            url,
                            "--dest",
                            str(dest),
                            "--connections",
                            str(conns),
                        ],
                        env=env,
                        check=True,
                        timeout=600,
                        capture_output=True,
                    )
                    dt = time.perf_counter() - t0
                    shutil.rmtree(dest)
                    best[conns] = min(best.get(conns, float("inf")), dt)
                    link = args.wan_mbit * 1e6 / 8
                    print(
                        f"  run {r + 1}/{args.repeat} wan x{conns}: {dt:6.2f}s "
                        f"{size / dt / 1e6:8.1f} MB/s ({size / dt / link:.2f} of the link)",
                        flush=True,
                    )
        finally:
            donor.terminate()
            donor.wait(timeout=30)
    return best


def loopback_runs(donors: dict[int, Path], paths: list[Path], scratch: Path, size: int,
                  args) -> dict:  # fmt: skip
    """Best (seconds, CPU seconds) per mode, the modes interleaved run after run (the machine
    is noisy); `donors`: the donor folder of each manifest format."""
    cap = args.cap_mb_s * 1e6
    donor_dir = donors[2]
    results: dict[str, tuple[float, float]] = {}
    with (
        serve_directory(donor_dir, "127.0.0.1", token=TOKEN) as server,
        serve_directory(donors[1], "127.0.0.1", token=TOKEN) as v1,
        serve_directory(donor_dir, "127.0.0.1", token=TOKEN, max_bytes_per_s=cap) as capped,
    ):
        t0 = time.perf_counter()
        fetch_from_peer(server.url, scratch / "warm", token=TOKEN)  # donor hashes once
        fetch_from_peer(capped.url, scratch / "warm2", token=TOKEN, chunk_bytes=size)
        fetch_from_peer(v1.url, scratch / "warm3", token=TOKEN)
        print(f"donors' first verification + warm-up fetch: {time.perf_counter() - t0:.2f}s")
        for w in ("warm", "warm2", "warm3"):
            shutil.rmtree(scratch / w)

        def paced(rate: float | None, url: str = server.url) -> None:
            fetch_checkpoint([url], dest, token=TOKEN, connections=1,
                             chunk_bytes=CHUNK_BYTES, pace=LinkGate(rate).wait)  # fmt: skip

        modes = {
            "raw": lambda: raw_copy(paths, dest),
            "raw+sha256": lambda: raw_copy(paths, dest, 1),
            "raw+blake3": lambda: raw_copy(paths, dest, 2),
        }
        for c in args.connections:
            modes[f"peer x{c}"] = lambda c=c: fetch_from_peer(server.url, dest, token=TOKEN,
                                                              connections=c)  # fmt: skip
        modes["paced"] = lambda: paced(None)
        modes["paced v1"] = lambda: paced(None, v1.url)
        modes["capped"] = lambda: paced(cap)
        modes["donor cap"] = lambda: fetch_from_peer(capped.url, dest, token=TOKEN)
        for r in range(args.repeat):
            for name, run in modes.items():
                dest = scratch / f"dest-{name.replace(' ', '')}-{r}"
                t0, c0 = time.perf_counter(), time.process_time()
                ret = run()
                dt = ret if isinstance(ret, float) else time.perf_counter() - t0
                cpu = time.process_time() - c0
                shutil.rmtree(dest)
                results[name] = min(results.get(name, (float("inf"), 0.0)), (dt, cpu))
                print(f"  run {r + 1}/{args.repeat} {name:>10}: {dt:6.2f}s "
                      f"{size / dt / 1e6:8.1f} MB/s, CPU {cpu / size * 1e9:5.2f} s/GB",
                      flush=True)  # fmt: skip
    return results


def report(results: dict[str, tuple[float, float]], size: int, args) -> None:
    raw, raw_hash, cap = results["raw"][0], results["raw+blake3"][0], args.cap_mb_s * 1e6
    print(
        f"\nloopback, {size / 1e6:.0f} MB in {args.files} files, best of {args.repeat}, "
        f"{os.cpu_count()} CPUs, cap {args.cap_mb_s:g} MB/s for the capped modes"
    )
    print(f"{'mode':>10} {'seconds':>8} {'MB/s':>8} {'vs raw':>7} {'vs raw+blake3':>13} "
          f"{'CPU s/GB':>8} {'of cap':>7}")  # fmt: skip
    for name, (dt, cpu) in results.items():
        of_cap = f"{size / dt / cap:7.2f}" if "cap" in name else ""
        print(
            f"{name:>10} {dt:8.2f} {size / dt / 1e6:8.1f} {raw / dt:7.2f} {raw_hash / dt:13.2f} "
            f"{cpu / size * 1e9:8.2f} {of_cap}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-mb", type=int, default=256, help="checkpoint size (default 256)")
    ap.add_argument("--files", type=int, default=4, help="number of files (default 4)")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is kept")
    ap.add_argument("--cap-mb-s", type=float, default=100.0, help="the capped modes' cap")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument(
        "--wan-mbit",
        type=float,
        default=None,
        help="also fetch across two namespaces with links of this rate (root)",
    )
    args = ap.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="ckpt_peer_", dir=args.dir))
    try:
        print(
            f"building a {args.size_mb} MB checkpoint in {args.files} files under {scratch} ...",
            flush=True,
        )
        donor_dir, paths = build_checkpoint(scratch, args.size_mb, args.files)
        donors = {2: donor_dir, 1: build_checkpoint(scratch, args.size_mb, args.files, 1)[0]}
        size = sum(p.stat().st_size for p in paths)
        report(loopback_runs(donors, paths, scratch, size, args), size, args)
        if args.wan_mbit:
            print(
                f"\nWAN bed: donor and joiner in two namespaces, tbf {args.wan_mbit:g} Mbit/s "
                "links, separate processes (the time includes interpreter start-up)"
            )
            wan = wan_runs(donor_dir, scratch, size, args)
            link = args.wan_mbit * 1e6 / 8
            if wan:
                print(f"{'mode':>9} {'seconds':>8} {'MB/s':>8} {'of link':>8}")
            for conns, dt in wan.items():
                print(
                    f"{'wan x' + str(conns):>9} {dt:8.2f} {size / dt / 1e6:8.1f} "
                    f"{size / dt / link:8.2f}"
                )
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
