"""`python -m prime_ckpt.peer serve DIR` / `fetch URL... --dest DIR`; the token comes from
$PRIME_TOKEN only (a command-line argument would be visible to other users)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from prime_ckpt.errors import PeerError
from prime_ckpt.peer.fetch import fetch_from_peer
from prime_ckpt.peer.server import serve_directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime_ckpt.peer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="share the newest checkpoint of DIR until SIGTERM/SIGINT")
    s.add_argument("dir")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--advertise-host", default=None)
    s.add_argument("--max-mb-per-s", type=float, default=None, help="cap the upload rate")
    f = sub.add_parser("fetch", help="download the newest checkpoint the donors offer")
    f.add_argument("urls", nargs="+")
    f.add_argument("--dest", required=True)
    f.add_argument("--connections", type=int, default=4)
    f.add_argument("--chunk-mb", type=float, default=8.0, help="Range request size")
    f.add_argument("--timeout", type=float, default=20.0, help="bound on every connect and read")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        if args.command == "fetch":
            step = fetch_from_peer(
                args.urls,
                args.dest,
                connections=args.connections,
                timeout=args.timeout,
                chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))),
            )
            print(f"fetched step {step} into {args.dest}")
            return 0
        rate = args.max_mb_per_s * 1e6 if args.max_mb_per_s else None
        server = serve_directory(
            args.dir, args.host, args.port, advertise_host=args.advertise_host, max_bytes_per_s=rate
        )
    except (PeerError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(server.url, flush=True)  # the first stdout line: what fetchers connect to
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
