"""One checkpoint from several donors at once (`fetch_checkpoint` with `shared` key prefixes):
real checkpoints written by CheckpointManager that share some tensors and differ in others,
served by donor processes at a capped rate; the donor whose checkpoint is being taken is
killed mid-transfer and the rest comes from another one."""

import contextlib
import signal
import threading

import torch

from prime_ckpt import CheckpointManager, fetch_checkpoint, serve_directory
from prime_ckpt.manifest import read_manifest, step_dirname, verify_dir
from prime_testkit import donor_processes, wait_until

TOKEN = "multi-donor-secret"

SHARED = [("model",), ("outer",)]
N = 512 << 10  # float32 elements: 2 MB per tensor


def donor_state(seed: int) -> dict:
    """The same model and outer weights on every donor; each its own optimizer moments."""
    same = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(N, generator=same)},
        "outer": {
            "weights": torch.randn(N, generator=same),
            "momentum": torch.randn(N, generator=same),
        },
        "optim": {"exp_avg": torch.randn(N, generator=own)},
        "progress": {"step": 7, "who": seed},
    }


def test_several_donors_share_the_transfer_and_a_killed_one_is_replaced(tmp_path, children):
    with contextlib.ExitStack() as stack:
        _several_donors(tmp_path, children, stack)


def _several_donors(tmp_path, children, stack):
    folders = [tmp_path / f"donor{k}" for k in range(3)]
    for k, folder in enumerate(folders):
        with CheckpointManager(folder) as m:
            m.save(7, donor_state(k + 1))
            m.wait()
    digests = [read_manifest(f / step_dirname(7)).digest() for f in folders]
    assert len(set(digests)) == 3  # each donor's own state makes its checkpoint its own
    # ~8 MB at 1 MB/s per donor: several seconds, long enough to kill the first mid-way; it
    # runs in its own process (to be killed), the other two in this one
    (proc, url), *_ = donor_processes(children, TOKEN, (folders[0], 1))
    servers = [
        stack.enter_context(serve_directory(f, "127.0.0.1", token=TOKEN, max_bytes_per_s=1e6))
        for f in folders[1:]
    ]
    urls = [url, *(s.url for s in servers)]
    dest = tmp_path / "joiner"
    got: dict = {}

    def fetch() -> None:
        got["r"] = fetch_checkpoint(urls, dest, token=TOKEN, chunk_bytes=256 << 10, shared=SHARED)

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    # the first donor's checkpoint is taken (equal counts: the first offered); once its
    # transfer is under way, kill it
    partial = lambda: [p for p in dest.glob(".peer-*.partial") if (p / ".progress").exists()]  # noqa: E731
    wait_until(
        lambda: any(len((p / ".progress").read_text().splitlines()) >= 6 for p in partial()),
        timeout=30,
        what="the first chunks",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert t.is_alive(), "the transfer ended before the donor was killed"
    t.join(90)
    assert not t.is_alive(), "fetch_checkpoint did not return in time"
    r = got["r"]
    assert r.step == 7 and r.primaries == 2, r
    assert r.primary in urls[1:]
    assert len([u for u, n in r.bytes_by_donor.items() if n > 0]) == 3, r.bytes_by_donor
    step_dir = dest / step_dirname(7)
    assert verify_dir(step_dir) == []
    mine = read_manifest(step_dir).digest()
    assert mine == digests[urls.index(r.primary)]  # exactly that donor's checkpoint
    # it loads, with the primary's own state and the shared weights everyone holds
    state = donor_state(99)
    with CheckpointManager(dest) as m:
        assert m.load_latest(state) == 7
    want = donor_state(urls.index(r.primary) + 1)
    for part in ("model", "outer", "optim"):
        for k, v in want[part].items():
            assert torch.equal(state[part][k], v), (part, k)
    # less came than a whole checkpoint per primary: the shared bytes were not fetched twice
    total = sum(e.size for e in read_manifest(step_dir).files.values())
    assert sum(r.bytes_by_donor.values()) < 1.6 * total, (r.bytes_by_donor, total)
