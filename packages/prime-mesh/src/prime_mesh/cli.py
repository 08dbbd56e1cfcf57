"""`prime-mesh` command line: run a coordinator, or print a run's members.

The token comes from the environment variable PRIME_TOKEN or from --token-file, never from the
command line (other users of the machine can read process arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from prime_mesh.errors import MeshError


def _token(path: str | None) -> str | None:
    if path is None:
        return None  # resolve_token falls back to PRIME_TOKEN
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise MeshError(f"cannot read --token-file {path}: {e.strerror}") from None
    if not token:
        raise MeshError(f"--token-file {path} is empty; write the run's shared secret into it")
    return token


def _coordinator(args: argparse.Namespace) -> int:
    from prime_mesh.wire import resolve_token

    token = resolve_token(_token(args.token_file))  # before importing torch: fail fast
    if args.status_port is not None:
        from prime_mesh.status_server import require_status_extra

        require_status_extra()
    from prime_mesh.coordinator import Coordinator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    coord = Coordinator(
        args.host,
        args.port,
        token=token,
        min_nodes=args.min_nodes,
        store_port=args.store_port,
        advertise_host=args.advertise_host,
        reform_wait=args.reform_wait,
    ).start()
    if args.status_port is not None:
        try:
            page = coord.serve_status(args.status_host, args.status_port)
        except BaseException:
            coord.close()
            raise
        print(f"prime-mesh status page at {page.url}", flush=True)
    # One parseable line, so a launcher that passed --port 0 learns the address.
    print(
        f"prime-mesh coordinator listening on {coord.address} (store port {coord.store_port})",
        flush=True,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: coord.close())
    coord.wait()
    coord.close()
    if coord.failed is not None:
        print(f"prime-mesh coordinator failed ({coord.failed}): restart it; the nodes re-form "
              "the run with it", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    print("prime-mesh coordinator stopped", flush=True)
    return 0


def _status(args: argparse.Namespace) -> int:
    from prime_mesh.status import format_status, query_status

    status = query_status(args.coordinator, token=_token(args.token_file), timeout=args.timeout)
    print(json.dumps(status, indent=2) if args.json else format_status(status, args.coordinator))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime-mesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("coordinator", help="run the membership coordinator")
    c.add_argument(
        "--host",
        default="0.0.0.0",
        help="address the coordinator and its store listen on (default 0.0.0.0: all)",
    )
    c.add_argument("--port", type=int, default=29500, help="TCP port (0 picks a free one)")
    c.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="TCP port of the rendezvous store the nodes' gloo groups meet through; every "
        "node connects to it (default 0: a free one, printed at start; set it to open it)",
    )
    c.add_argument("--advertise-host", default=None, help="address nodes use to reach the store")
    c.add_argument("--min-nodes", type=int, default=1, help="nodes needed to form the first epoch")
    c.add_argument(
        "--reform-wait",
        type=float,
        default=30.0,
        help="restarted on a run's address: seconds to wait for its members to reconnect "
        "before re-forming it without the missing ones (default 30)",
    )
    c.add_argument(
        "--token-file", default=None, help="file holding the token (else env PRIME_TOKEN)"
    )
    c.add_argument(
        "--status-port",
        type=int,
        default=None,
        help="serve the read-only status page, /api/status and /metrics on this port (0: free)",
    )
    c.add_argument(
        "--status-host",
        default="127.0.0.1",
        help="address of the status page (default 127.0.0.1: this machine only)",
    )
    c.set_defaults(func=_coordinator)
    s = sub.add_parser("status", help="print the members of a running job")
    s.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    s.add_argument(
        "--token-file", default=None, help="file holding the token (else env PRIME_TOKEN)"
    )
    s.add_argument("--timeout", type=float, default=10.0)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_status)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (MeshError, OSError, ValueError) as e:
        print(f"prime-mesh {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
