"""Peer transfer end to end: real donors (threads and processes) on 127.0.0.1, real files."""

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from prime_ckpt.manifest import (
    is_leased,
    read_manifest,
    step_dirname,
    verify_dir,
)
from prime_ckpt.peer import (
    PeerError,
    PeerGoneError,
    fetch_checkpoint,
    fetch_from_peer,
    serve_directory,
)
from prime_ckpt.peer.fetch import partial_dirname
from prime_ckpt.peer.journal import JOURNAL
from prime_testkit import donor_processes, make_checkpoint, wait_until

TOKEN = "run-secret"
MB = 1 << 20
CHUNK = 256 << 10


def random_files(n: int, size: int) -> dict[str, bytes]:
    return {f"shard{i}/w.bin": os.urandom(size) for i in range(n)} | {"meta.bin": b"m" * 10}


def journal_lines(dest: Path, step: int, digest: str) -> int:
    try:
        return len((dest / partial_dirname(step, digest) / JOURNAL).read_text().splitlines())
    except FileNotFoundError:
        return 0


class Fetch:
    """fetch_from_peer in a thread, so a test can act while the transfer runs."""

    def __init__(self, *args, **kwargs) -> None:
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            self.result = fetch_from_peer(*args, **kwargs)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float = 60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "fetch_from_peer did not return in time"
        return self


def assert_same_checkpoint(a: Path, b: Path) -> None:
    assert verify_dir(b) == []
    assert read_manifest(a).digest() == read_manifest(b).digest()
    for name in read_manifest(a).files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_round_trip_parallel_connections(tmp_path):
    files = random_files(3, 3 * MB + 123) | {"empty.bin": b""}
    make_checkpoint(tmp_path / "donor", 4, files)
    stale, newer = partial_dirname(2, "ab" * 32), partial_dirname(9, "cd" * 32)
    for name in (stale, newer):  # leftovers of failed fetches
        (tmp_path / "dest" / name).mkdir(parents=True)
    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        step = fetch_from_peer(
            [server.url], tmp_path / "dest", token=TOKEN, connections=4, chunk_bytes=CHUNK
        )
        assert step == 4
        assert server.bytes_sent == sum(map(len, files.values()))
        # Already there: nothing is downloaded again.
        assert fetch_from_peer(server.url, tmp_path / "dest", token=TOKEN) == 4
        assert server.bytes_sent == sum(map(len, files.values()))
    assert_same_checkpoint(
        tmp_path / "donor" / step_dirname(4), tmp_path / "dest" / step_dirname(4)
    )
    # The stale partial of an older step is cleaned; a newer one may still be resumed.
    assert sorted(os.listdir(tmp_path / "dest")) == sorted([newer, step_dirname(4)])
    assert sorted(os.listdir(tmp_path / "dest" / step_dirname(4))) == sorted(
        ["manifest.msgpack", "shard0", "shard1", "shard2", "meta.bin", "empty.bin"]
    )


def test_a_paced_fetch_waits_while_its_pace_holds_and_grows_its_reads_with_the_rate(tmp_path):
    """`pace` (a joiner yielding its link to its all-reduce): called with each read's size
    before it; while it blocks, no byte is read; released, the transfer completes. Each
    connection starts with small reads (its window: nothing much in flight when it holds) and,
    unpaced once released, grows them with the rate, up to 1 MiB (a fixed 16 KiB window held
    a loopback transfer to 20 MB/s)."""
    files = random_files(2, 8 * MB + 7)
    make_checkpoint(tmp_path / "donor", 3, files)
    opened, sizes, lock = threading.Event(), [], threading.Lock()

    def pace(n: int) -> None:
        with lock:
            sizes.append(n)
        assert opened.wait(60), "never released"

    got: dict = {}
    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        t = threading.Thread(target=lambda: got.update(r=fetch_checkpoint(
            [server.url], tmp_path / "dest", token=TOKEN, connections=2, chunk_bytes=CHUNK,
            pace=pace)), daemon=True)  # fmt: skip
        t.start()
        wait_until(lambda: len(sizes) >= 2, 30, what="both connections asking to read")
        assert len(sizes) == 2 and t.is_alive()  # held: each waits before its first read
        opened.set()
        t.join(60)
    assert not t.is_alive() and got["r"].step == 3
    # grown past the first reads (how far depends on the rate: 1 MiB on an idle loopback)
    assert max(sizes[:2]) == 16 << 10 < max(sizes) <= MB, sorted(set(sizes))
    assert sum(sizes) == sum(map(len, files.values()))
    assert_same_checkpoint(
        tmp_path / "donor" / step_dirname(3), tmp_path / "dest" / step_dirname(3)
    )


def test_a_paced_fetch_under_a_slow_pace_keeps_its_reads_and_window_small(tmp_path):
    """A pace of 1 MB/s (a capped joiner, or a slow link): the window stays at its smallest
    (64 KiB: a tenth of a second at that rate, rounded up), so its reads stay at 16 KiB and a
    hold stops the donor within that much."""
    files = random_files(1, 2 * MB)
    make_checkpoint(tmp_path / "donor", 3, files)
    sizes, lock, state = [], threading.Lock(), {"next": 0.0}

    def pace(n: int) -> None:  # a token bucket of 1 MB/s, like prime-train's LinkGate
        with lock:
            sizes.append(n)
            now = time.monotonic()
            start = max(now, state["next"])
            state["next"] = start + n / 1e6
        time.sleep(max(0.0, start - now))

    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        got = fetch_checkpoint([server.url], tmp_path / "dest", token=TOKEN, connections=1,
                               chunk_bytes=CHUNK, pace=pace)  # fmt: skip
    assert got.step == 3 and max(sizes) == 16 << 10, sorted(set(sizes))
    assert_same_checkpoint(
        tmp_path / "donor" / step_dirname(3), tmp_path / "dest" / step_dirname(3)
    )


def test_donor_killed_mid_transfer_switches_to_same_digest_only(tmp_path, children):
    files = random_files(3, 2 * MB)
    digest = make_checkpoint(tmp_path / "a", 3, files)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same checkpoint on a second donor
    other = make_checkpoint(tmp_path / "c", 3, random_files(3, 2 * MB))  # same step, other bytes
    assert other != digest
    (proc_a, url_a), (_, url_b) = donor_processes(
        children, TOKEN, (tmp_path / "a", 1), (tmp_path / "b", 1)
    )
    with serve_directory(tmp_path / "c", "127.0.0.1", token=TOKEN) as server_c:
        dest = tmp_path / "dest"
        f = Fetch(
            [url_a, server_c.url, url_b],
            dest,
            token=TOKEN,
            connections=4,
            chunk_bytes=CHUNK,
            timeout=10,
        )
        wait_until(lambda: journal_lines(dest, 3, digest) >= 2, timeout=30, what="first chunks")
        proc_a.send_signal(signal.SIGKILL)
        proc_a.wait(timeout=10)
        assert f.thread.is_alive(), "the transfer ended before the donor was killed"
        assert journal_lines(dest, 3, digest) < len(files) * 8  # mid-transfer
        f.join()
        assert f.error is None, f.error
        assert f.result == 3
        assert server_c.bytes_sent == 0  # the donor of another digest was never used
    assert_same_checkpoint(tmp_path / "a" / step_dirname(3), dest / step_dirname(3))


def test_newer_step_committed_mid_transfer_stays_pinned(tmp_path):
    files = random_files(2, 2 * MB)
    digest = make_checkpoint(tmp_path / "donor", 1, files)
    dest = tmp_path / "dest"
    with serve_directory(
        tmp_path / "donor", "127.0.0.1", token=TOKEN, max_bytes_per_s=2 * MB
    ) as server:
        f = Fetch([server.url], dest, token=TOKEN, connections=2, chunk_bytes=CHUNK)
        wait_until(lambda: journal_lines(dest, 1, digest) >= 1, timeout=30, what="first chunk")
        make_checkpoint(tmp_path / "donor", 2, random_files(2, MB))
        assert is_leased(tmp_path / "donor", 1)  # the donor's manager will not prune step 1
        assert f.thread.is_alive(), "the transfer ended before the newer step was committed"
        f.join()
        assert f.error is None, f.error
        assert f.result == 1
        assert_same_checkpoint(tmp_path / "donor" / step_dirname(1), dest / step_dirname(1))
        assert not (dest / step_dirname(2)).exists()
        # The next transfer is offered the newer step.
        assert fetch_from_peer([server.url], dest, token=TOKEN) == 2
    assert_same_checkpoint(tmp_path / "donor" / step_dirname(2), dest / step_dirname(2))


def test_pinned_step_pruned_and_donor_closed_mid_transfer(tmp_path):
    digest = make_checkpoint(tmp_path / "donor", 5, random_files(2, 2 * MB))
    dest = tmp_path / "dest"
    server = serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN, max_bytes_per_s=2 * MB)
    with server:
        f = Fetch([server.url], dest, token=TOKEN, connections=2, chunk_bytes=CHUNK)
        wait_until(lambda: journal_lines(dest, 5, digest) >= 1, timeout=30, what="first chunk")
        shutil.rmtree(tmp_path / "donor" / step_dirname(5))  # pruned despite the lease
        f.join()
        assert isinstance(f.error, PeerGoneError), f.error
        assert "no longer on this donor" in str(f.error) and "resumes" in str(f.error)
        assert not (dest / step_dirname(5)).exists()
    # close() cuts a transfer in flight promptly; the fetcher fails clearly, without a hang.
    digest = make_checkpoint(tmp_path / "donor", 6, random_files(2, 2 * MB))
    server = serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN, max_bytes_per_s=MB)
    f = Fetch([server.url], dest, token=TOKEN, connections=2, chunk_bytes=CHUNK, timeout=5)
    wait_until(lambda: journal_lines(dest, 6, digest) >= 1, timeout=30, what="first chunk")
    closer = threading.Thread(target=server.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close() did not return promptly"
    f.join()
    assert isinstance(f.error, PeerGoneError), f.error


def test_resume_after_interrupted_fetch(tmp_path, children):
    files = random_files(2, 2 * MB)
    total = sum(map(len, files.values()))
    digest = make_checkpoint(tmp_path / "donor", 7, files)
    dest = tmp_path / "dest"
    [(proc, url)] = donor_processes(children, TOKEN, (tmp_path / "donor", 2))
    f = Fetch([url], dest, token=TOKEN, connections=2, chunk_bytes=CHUNK, timeout=10)
    wait_until(lambda: journal_lines(dest, 7, digest) >= 4, timeout=30, what="some chunks")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    f.join()
    assert isinstance(f.error, PeerGoneError), f.error
    partial = dest / partial_dirname(7, digest)
    done = (partial / JOURNAL).read_text().splitlines()
    ranges = [line.split("\t") for line in done]
    done_bytes = sum(int(end) - int(start) for start, end, _ in ranges)
    assert 0 < done_bytes < total
    # A byte the journal vouches for rots on disk: the checksum catches it and refetches.
    start, _, name = ranges[0]
    with open(partial / name, "r+b") as fh:
        fh.seek(int(start))
        b = fh.read(1)
        fh.seek(int(start))
        fh.write(bytes([b[0] ^ 0xFF]))
    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        # A rerun with another chunk size still resumes (the journal records byte ranges).
        assert fetch_from_peer([server.url], dest, token=TOKEN, chunk_bytes=CHUNK // 2) == 7
        rotten = len(files[name])
        assert server.bytes_sent == total - done_bytes + rotten  # only the missing parts
    assert_same_checkpoint(tmp_path / "donor" / step_dirname(7), dest / step_dirname(7))
    assert not partial.exists()


def test_never_overwrites_a_different_committed_step(tmp_path):
    make_checkpoint(tmp_path / "donor", 4, {"a.bin": b"donor's"})
    mine = make_checkpoint(tmp_path / "dest", 4, {"a.bin": b"mine"})
    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        with pytest.raises(PeerError, match="refusing to overwrite"):
            fetch_from_peer(server.url, tmp_path / "dest", token=TOKEN)
        assert read_manifest(tmp_path / "dest" / step_dirname(4)).digest() == mine
        # The same checkpoint, but rotten on disk: reported, still not overwritten.
        shutil.rmtree(tmp_path / "dest" / step_dirname(4))
        shutil.copytree(tmp_path / "donor" / step_dirname(4), tmp_path / "dest" / step_dirname(4))
        (tmp_path / "dest" / step_dirname(4) / "a.bin").write_bytes(b"DONOR'S")
        with pytest.raises(PeerError, match="fails its checksums"):
            fetch_from_peer(server.url, tmp_path / "dest", token=TOKEN)
        assert (tmp_path / "dest" / step_dirname(4) / "a.bin").read_bytes() == b"DONOR'S"


def test_stalled_donor_is_dropped_after_bounded_waits(tmp_path, children):
    """A donor that stops answering without closing its sockets (SIGSTOP) costs at most a
    couple of `timeout`s; its chunks move to the donor that still answers."""
    digest = make_checkpoint(tmp_path / "a", 9, random_files(2, 2 * MB))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (proc_a, url_a), (_, url_b) = donor_processes(
        children, TOKEN, (tmp_path / "a", 1), (tmp_path / "b", 4)
    )
    dest = tmp_path / "dest"
    f = Fetch([url_a, url_b], dest, token=TOKEN, connections=4, chunk_bytes=CHUNK, timeout=2)
    wait_until(lambda: journal_lines(dest, 9, digest) >= 2, timeout=30, what="first chunks")
    proc_a.send_signal(signal.SIGSTOP)
    f.join(timeout=60)
    assert f.error is None, f.error
    assert f.result == 9
    assert_same_checkpoint(tmp_path / "a" / step_dirname(9), dest / step_dirname(9))
