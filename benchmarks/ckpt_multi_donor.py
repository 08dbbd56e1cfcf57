"""One checkpoint from several donors at once vs from one donor, same run.

    uv run python benchmarks/ckpt_multi_donor.py [--mb-per-tensor 4] [--mb-per-s 2] [--donors 3]
                                                 [--paced]

Each donor saves a DiLoCo-like checkpoint with CheckpointManager: the model weights, the outer
weights and the outer momentum alike on every donor (the shared 60%), two Adam moments its own
(40%). Every donor serves it in this process, capped at `--mb-per-s` (the serving cap of
`mesh.serve_mbit`). The joiner fetches it from one donor (the baseline),
then with `fetch_checkpoint(shared=...)` from all of them, and prints both times, their ratio,
the ideal ratio for that split (the primary must serve its own 40% alone) and the bytes each
donor served, with each fetch's MB/s and its share of the rate the caps allow (one donor: its
cap; all: the ideal time for that split at the caps). `--paced` fetches the way a joiner does
(one paced connection per donor, 1 MiB chunks; prime_ckpt's LinkGate, as a joiner paces it, no cap).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from prime_ckpt import CheckpointManager, LinkGate, fetch_checkpoint, serve_directory
from prime_ckpt.peer import ask_donors, resolve_token

SHARED = [("model",), ("diloco", "outer")]


def state(n: int, seed: int) -> dict:
    same, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    alike = [torch.randn(n, generator=same) for _ in range(3)]
    return {
        "model": {"w": alike[0]},
        "diloco": {"outer": {"outer": alike[1], "momentum": alike[2]}},
        "optim": {
            "exp_avg": torch.randn(n, generator=own),
            "exp_avg_sq": torch.randn(n, generator=own),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb-per-tensor", type=float, default=4.0)
    ap.add_argument("--mb-per-s", type=float, default=2.0, help="each donor's serving cap")
    ap.add_argument("--donors", type=int, default=3)
    ap.add_argument("--paced", action="store_true", help="fetch as a joiner does (LinkGate)")
    args = ap.parse_args()
    n = int(args.mb_per_tensor * 1e6 / 4)
    root = Path(tempfile.mkdtemp(prefix="multi-donor-"))
    servers = []
    try:
        for k in range(args.donors):
            with CheckpointManager(root / f"donor{k}") as m:
                m.save(5, state(n, k + 1))
                m.wait()
            servers.append(serve_directory(root / f"donor{k}", "127.0.0.1", token="bench",
                                           max_bytes_per_s=args.mb_per_s * 1e6))  # fmt: skip
        # each donor verifies its checkpoint before offering it: not part of the transfer
        ask_donors([s.url for s in servers], resolve_token("bench"), 120.0)
        pace = LinkGate(None).wait if args.paced else None
        t = time.monotonic()
        fetch_checkpoint([servers[0].url], root / "one", token="bench", chunk_bytes=1 << 20,
                         connections=1 if pace else 4, pace=pace)  # fmt: skip
        one = time.monotonic() - t
        t = time.monotonic()
        got = fetch_checkpoint([s.url for s in servers], root / "all", token="bench",
                               connections=args.donors if pace else 2 * args.donors,
                               chunk_bytes=1 << 20, shared=SHARED, pace=pace)  # fmt: skip
        many = time.monotonic() - t
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(root, ignore_errors=True)
    total, own = 5 * n * 4, 2 * n * 4
    ideal = max(own, total / args.donors) / total  # the primary serves its own part alone
    cap = args.mb_per_s * 1e6
    print(f"one donor: {total / one / 1e6:.1f} MB/s, {total / one / cap:.2f} of its cap; "
          f"{args.donors} donors: {total / many / 1e6:.1f} MB/s, "
          f"{ideal * total / cap / many:.2f} of what the caps allow for this split")  # fmt: skip
    print(f"{total / 1e6:.0f} MB checkpoint ({(total - own) / 1e6:.0f} MB shared), donors capped "
          f"at {args.mb_per_s:g} MB/s: one donor {one:.1f} s, {args.donors} donors {many:.1f} s: "
          f"{one / many:.2f}x (ideal {1 / ideal:.2f}x); bytes by donor "
          f"{[round(b / 1e6, 1) for b in got.bytes_by_donor.values()]} MB")  # fmt: skip


if __name__ == "__main__":
    main()
