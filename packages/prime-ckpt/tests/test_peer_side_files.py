"""Side files served beside checkpoints: listing, download, holds, auth, a pruned file."""

import os

import pytest

from prime_ckpt.peer import (
    PeerAuthError,
    PeerError,
    SideFileHold,
    fetch_side_file,
    list_side_files,
    serve_directory,
)
from prime_testkit import wait_until

TOKEN = "run-secret"


def test_side_files_are_listed_fetched_held_and_authenticated(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    ckpt.mkdir()
    log.mkdir()
    blobs = {f"e{i:04d}.bin": os.urandom(1000 + i) for i in range(3)}
    for name, data in blobs.items():
        (log / name).write_bytes(data)
    (log / ".e0003.bin.tmp").write_bytes(b"half written")  # hidden: never listed
    with serve_directory(ckpt, token=TOKEN, files_dir=log, max_bytes_per_s=10e6) as server:
        assert list_side_files(server.url, TOKEN) == {n: len(d) for n, d in blobs.items()}
        assert server.held_from() is None
        list_side_files(server.url, TOKEN, hold="e0001.bin")
        assert server.held_from() == "e0001.bin"
        list_side_files(server.url, TOKEN, release="e0001.bin")
        assert server.held_from() is None
        list_side_files(server.url, TOKEN, hold="e0002.bin")
        for name, data in blobs.items():
            assert fetch_side_file(server.url, name, TOKEN) == data
        (log / "e0000.bin").unlink()  # pruned: a clear PeerError, not garbage
        with pytest.raises(PeerError, match="no longer"):
            fetch_side_file(server.url, "e0000.bin", TOKEN)
        with pytest.raises(PeerAuthError):
            list_side_files(server.url, "another-token")
        with pytest.raises(ValueError):
            fetch_side_file(server.url, "../escape", TOKEN)


def test_a_donor_without_side_files_answers_404(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with (
        serve_directory(tmp_path / "ckpt", token=TOKEN) as server,
        pytest.raises(PeerError, match="404"),
    ):
        list_side_files(server.url, TOKEN)


def test_a_hold_on_every_donor_is_renewed_moved_and_released(tmp_path):
    servers, urls = [], []
    for k in range(2):
        (tmp_path / f"ckpt{k}").mkdir()
        (tmp_path / f"log{k}").mkdir()
        servers.append(serve_directory(tmp_path / f"ckpt{k}", token=TOKEN,
                                       files_dir=tmp_path / f"log{k}"))  # fmt: skip
        urls.append(servers[-1].url)
    gone = "http://127.0.0.1:1"  # a donor that does not answer: skipped, asked again later
    try:
        with SideFileHold(lambda: [*urls, gone], TOKEN, "e0001.bin", timeout=2.0) as hold:
            wait_until(lambda: all(s.held_from() == "e0001.bin" for s in servers), 10,
                       what="the first renewal")  # fmt: skip
            hold.hold_from("e0005.bin")  # moved on: the older hold is dropped at once
            assert [s.held_from() for s in servers] == ["e0005.bin"] * 2
            hold.hold_from("e0007.bin", now=False)  # asked at the next renewal
            assert [s.held_from() for s in servers] == ["e0005.bin"] * 2
            hold.renew()
            assert [s.held_from() for s in servers] == ["e0007.bin"] * 2
        assert [s.held_from() for s in servers] == [None, None]  # released, not left to lapse
    finally:
        for s in servers:
            s.close()
