"""A donor's connections cannot tie it up (issue #34): caps per address and in all, a deadline
on each request header as a whole, a cap on its bytes, one request before authentication,
refusals logged once per address per minute. Real sockets on loopback addresses (127.0.0.x are
distinct addresses for the caps), real transfers alongside."""

import logging
import os
import select
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from prime_ckpt.manifest import step_dirname, verify_dir
from prime_ckpt.peer import Limits, fetch_from_peer, serve_directory
from prime_testkit import make_checkpoint, wait_until

TOKEN = "run-secret"


@pytest.fixture
def donor_dir(tmp_path):
    files = {f"shard{i}.bin": os.urandom(2 << 20) for i in range(2)}
    make_checkpoint(tmp_path / "donor", 7, files)
    return tmp_path / "donor"


def connect(url: str, source: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=10, source_address=(source, 0))


def closed_by_donor(s: socket.socket, within: float) -> bool:
    """True once the donor closed `s` (EOF or reset) within `within` seconds; False if open."""
    ready, _, _ = select.select([s], [], [], within)
    if not ready:
        return False
    try:
        return s.recv(65536) == b""
    except (ConnectionResetError, TimeoutError):
        return True


def fetch_ok(url: str, dest) -> None:
    assert fetch_from_peer([url], dest, token=TOKEN, connections=2, timeout=10) == 7
    assert verify_dir(dest / step_dirname(7)) == []


def test_connection_caps_refuse_the_excess_while_a_transfer_completes(donor_dir, tmp_path, caplog):
    limits = Limits(max_connections=16, max_per_address=8, handshake_s=30)
    with serve_directory(donor_dir, "127.0.0.1", token=TOKEN, limits=limits) as server:
        idle = [connect(server.url, "127.0.0.2") for _ in range(8)]
        wait_until(lambda: server.admission.count == 8, 10, what="8 idle connections admitted")
        extra = [connect(server.url, "127.0.0.2") for _ in range(2)]
        assert all(closed_by_donor(s, 5) for s in extra)  # over the per-address cap
        assert not any(closed_by_donor(s, 0) for s in idle)  # admitted ones wait on
        fetch_ok(server.url, tmp_path / "a")  # another address still gets its checkpoint
        idle += [connect(server.url, "127.0.0.3") for _ in range(8)]
        wait_until(lambda: server.admission.count == 16, 10, what="16 connections admitted")
        late = connect(server.url, "127.0.0.4")
        assert closed_by_donor(late, 5)  # over the donor's total cap
        for s in idle + extra + [late]:
            s.close()
        wait_until(lambda: server.admission.count == 0, 10, what="closed connections released")
        fetch_ok(server.url, tmp_path / "b")
    refusals = [r for r in caplog.records if "refused 127.0.0.2" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # twice refused, once logged


def test_a_slow_drip_client_is_cut_at_the_header_deadline(donor_dir, tmp_path):
    """One byte every 0.1 s never trips a per-recv timeout; the whole-header deadline cuts it,
    while a real transfer goes on."""
    limits = Limits(handshake_s=1.5)
    with serve_directory(donor_dir, "127.0.0.1", token=TOKEN, limits=limits) as server:
        fetched = threading.Thread(target=fetch_ok, args=(server.url, tmp_path / "a"))
        fetched.start()
        s = connect(server.url, "127.0.0.2")
        line = b"GET /v1/index HTTP/1.1\r\nX-Pad: " + b"a" * 200
        sent, cut = 0, False
        for byte in line:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            sent += 1
            if closed_by_donor(s, 0.1):
                cut = True
                break
        s.close()
        fetched.join(60)
        assert not fetched.is_alive()
        assert cut and sent < len(line), f"the donor read all {sent} dripped bytes"
        wait_until(lambda: server.admission.count == 0, 10, what="the drip's slot released")


def test_an_oversized_or_unauthenticated_request_ends_its_connection(donor_dir, tmp_path):
    limits = Limits(request_bytes=16 << 10)
    with serve_directory(donor_dir, "127.0.0.1", token=TOKEN, limits=limits) as server:
        s = connect(server.url, "127.0.0.2")
        header = b"GET /v1/index HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (4 << 20) + b"\r\n\r\n"
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            s.sendall(header)  # the donor stops reading at 16 KiB and closes
            assert closed_by_donor(s, 10)
            raise ConnectionResetError("closed after the send")  # the send fit in buffers
        s.close()
        # one unauthenticated request gets its answer, then the connection ends
        s = connect(server.url, "127.0.0.2")
        s.sendall(b"GET /v1/index HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        s.close()
        assert reply.startswith(b"HTTP/1.1 401") and b"unauthenticated" in reply
        fetch_ok(server.url, tmp_path / "a")


def test_refusals_are_logged_once_per_address_per_minute(donor_dir, caplog):
    caplog.set_level(logging.WARNING, logger="prime_ckpt.peer")
    with serve_directory(donor_dir, "127.0.0.1", token=TOKEN) as server:
        for source in ["127.0.0.5"] * 5 + ["127.0.0.6"]:
            s = connect(server.url, source)
            s.sendall(b"GET /v1/index HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(12).startswith(b"HTTP/1.1 401")
            s.close()
    logged = [r.getMessage() for r in caplog.records if "refused 127.0.0." in r.getMessage()]
    assert [m.split(":")[0] for m in logged] == ["refused 127.0.0.5", "refused 127.0.0.6"]
