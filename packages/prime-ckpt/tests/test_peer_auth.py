"""Peer transfer, donor side: authentication, replay, traversal, Range, what is offered."""

import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import msgpack
import pytest

from prime_ckpt.manifest import (
    FileEntry,
    Manifest,
    file_digest,
    is_leased,
    step_dirname,
)
from prime_ckpt.peer import (
    NoPeerError,
    PeerAuthError,
    fetch_from_peer,
    serve_directory,
)
from prime_ckpt.peer.auth import sign_request
from prime_ckpt.peer.catalog import Catalog
from prime_testkit import make_checkpoint

TOKEN = "run-secret"


def raw_get(url: str, path: str, token: str | None = TOKEN, rng: str = "", headers=None):
    """One raw GET with the exact `path` (no normalisation); returns (status, headers, body)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        h = dict(headers) if headers else {}
        if token is not None and headers is None:
            h = sign_request(token.encode(), "GET", path, rng)
        if rng:
            h["Range"] = rng
        conn.request("GET", path, headers=h)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.fixture
def donor(tmp_path):
    digest = make_checkpoint(tmp_path / "donor", 1, {"w.bin": bytes(range(256)) * 40, "m/x": b"x"})
    (tmp_path / "secret").write_bytes(b"not yours")
    with serve_directory(tmp_path / "donor", "127.0.0.1", token=TOKEN) as server:
        yield server, digest, tmp_path


def test_index_offers_newest_verified_step_and_leases_it(tmp_path):
    root = tmp_path / "d"
    make_checkpoint(root, 8, {"a": b"eight"})
    make_checkpoint(root, 10, {"a": b"ten"})
    (root / step_dirname(10) / "a").write_bytes(b"TEN")  # corrupt: never offered
    (root / (step_dirname(12) + ".tmp-1")).mkdir()  # torn write: never offered
    with serve_directory(root, "127.0.0.1", token=TOKEN) as server:
        status, _, body = raw_get(server.url, "/v1/index")
        assert status == 200
        assert msgpack.unpackb(body)["step"] == 8
        assert is_leased(root, 8)
        make_checkpoint(root, 11, {"a": b"eleven"})  # a later transfer sees the newer step
        assert msgpack.unpackb(raw_get(server.url, "/v1/index")[2])["step"] == 11


def test_wrong_token_names_authentication(donor):
    server, _, tmp_path = donor
    with pytest.raises(PeerAuthError, match="authentication"):
        fetch_from_peer([server.url], tmp_path / "dest", token="not-the-run-secret")
    assert not any(p.name.startswith("step-") for p in (tmp_path / "dest").iterdir())
    status, _, body = raw_get(server.url, "/v1/index", token=None)
    assert status == 401 and b"unauthenticated" in body


def test_replayed_and_stale_requests_refused(donor):
    server, _, _ = donor
    headers = sign_request(TOKEN.encode(), "GET", "/v1/index")
    assert raw_get(server.url, "/v1/index", headers=headers)[0] == 200
    status, _, body = raw_get(server.url, "/v1/index", headers=headers)
    assert status == 403 and b"replayed" in body
    stale = sign_request(TOKEN.encode(), "GET", "/v1/index", now=time.time() - 120)
    status, _, body = raw_get(server.url, "/v1/index", headers=stale)
    assert status == 403 and b"stale" in body
    # A signature for one path does not authorise another.
    status, _, body = raw_get(server.url, "/v1/ckpt/1/" + "0" * 64 + "/w.bin", headers=headers)
    assert status == 401 and b"bad signature" in body


def test_paths_outside_the_checkpoint_refused(donor):
    server, digest, tmp_path = donor
    base = f"/v1/ckpt/1/{digest}/"
    for evil in [
        "../../secret",
        "%2e%2e/%2e%2e/secret",
        "%2F" + str(tmp_path / "secret"),
        "m/../../../secret",
        "manifest.msgpack/../../../secret",
    ]:
        status, _, body = raw_get(server.url, base + evil)
        assert status in (403, 404), evil
        assert b"not yours" not in body
    # A file listed in the manifest that is a symlink pointing out of the checkpoint.
    root = tmp_path / "linky"
    d = make_checkpoint(root, 2, {"ok": b"fine"})
    os.symlink(tmp_path / "secret", root / step_dirname(2) / "out")
    m = Manifest(
        step=2,
        files={
            "ok": FileEntry(4, file_digest(root / step_dirname(2) / "ok")),
            "out": FileEntry(9, file_digest(tmp_path / "secret")),
        },
    )
    (root / step_dirname(2) / "manifest.msgpack").write_bytes(m.to_bytes())
    d = m.digest()
    with serve_directory(root, "127.0.0.1", token=TOKEN) as s2:
        status, _, body = raw_get(s2.url, f"/v1/ckpt/2/{d}/out")
        assert status == 403 and b"outside the checkpoint" in body
        assert raw_get(s2.url, f"/v1/ckpt/2/{d}/ok")[2] == b"fine"


def test_range_requests_and_gone_step(donor):
    server, digest, tmp_path = donor
    data = bytes(range(256)) * 40
    path = f"/v1/ckpt/1/{digest}/w.bin"
    status, headers, body = raw_get(server.url, path, rng="bytes=100-299")
    assert status == 206 and body == data[100:300]
    assert headers["Content-Range"] == f"bytes 100-299/{len(data)}"
    assert raw_get(server.url, path, rng="bytes=-10")[2] == data[-10:]
    assert raw_get(server.url, path, rng="bytes=10240-")[0] == 416
    assert raw_get(server.url, path, rng="pages=1-2")[0] == 416
    assert raw_get(server.url, f"/v1/ckpt/1/{'1' * 64}/w.bin")[0] == 410  # another digest
    (tmp_path / "donor" / step_dirname(1) / "manifest.msgpack").unlink()  # pruned
    status, _, body = raw_get(server.url, path)
    assert status == 410 and b"no longer on this donor" in body


def test_token_from_environment_and_wildcard_rule(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "d", 1, {"a": b"a"})
    monkeypatch.delenv("PRIME_TOKEN", raising=False)
    with pytest.raises(ValueError, match="PRIME_TOKEN"):
        serve_directory(tmp_path / "d", "127.0.0.1")
    with pytest.raises(ValueError, match="PRIME_TOKEN"):
        fetch_from_peer(["127.0.0.1:1"], tmp_path / "x")
    monkeypatch.setenv("PRIME_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="advertise_host"):
        serve_directory(tmp_path / "d", "0.0.0.0")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        serve_directory(tmp_path / "missing", "127.0.0.1")
    with serve_directory(tmp_path / "d", "0.0.0.0", advertise_host="127.0.0.1") as s:
        assert s.url == f"http://127.0.0.1:{s.port}"
        assert fetch_from_peer(s.url, tmp_path / "dest") == 1


def test_unsigned_index_answer_is_not_trusted(tmp_path):
    """A donor that does not hold the token cannot hand out a manifest of its choosing."""
    m = Manifest(step=99, files={})
    body = msgpack.packb({"step": 99, "digest": m.digest(), "manifest": m.to_bytes()})

    class Forger(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Forger)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    t.start()
    try:
        with pytest.raises(PeerAuthError, match="signature"):
            fetch_from_peer(f"127.0.0.1:{httpd.server_address[1]}", tmp_path / "d", token=TOKEN)
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=10)


def test_no_peer_reachable_fails_fast(tmp_path, port):
    from prime_testkit import free_port

    urls = [f"http://127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]
    t0 = time.monotonic()
    with pytest.raises(NoPeerError, match="no peer could offer a checkpoint") as e:
        fetch_from_peer(urls, tmp_path / "d", token=TOKEN, timeout=5)
    assert time.monotonic() - t0 < 10  # refused connections fail at once, not after retries
    assert str(port) in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with (
        serve_directory(empty, "127.0.0.1", token=TOKEN) as s,
        pytest.raises(NoPeerError, match="no committed checkpoint"),
    ):
        fetch_from_peer([s.url], tmp_path / "d", token=TOKEN)
    with pytest.raises(ValueError, match="http://host:port"):
        fetch_from_peer(["ftp://x:1"], tmp_path / "d", token=TOKEN)


def test_index_waits_for_verification_then_fetcher_retries(tmp_path, monkeypatch):
    """A fresh step is hashed once on a background thread: an index request that finds no
    verified step gets 503 and the fetcher asks again; a corrupt step is hashed only once."""
    gate, calls = threading.Event(), []
    original = Catalog._hash_problem

    def gated(self, step_dir, manifest):
        calls.append(manifest.step)
        assert gate.wait(30), "test never opened the gate"
        return original(self, step_dir, manifest)

    monkeypatch.setattr(Catalog, "_hash_problem", gated)
    root = tmp_path / "d"
    make_checkpoint(root, 3, {"a": b"three"})
    with serve_directory(root, "127.0.0.1", token=TOKEN) as server:
        server.index_budget_s = 0.2
        status, headers, body = raw_get(server.url, "/v1/index")
        assert status == 503 and b"still being verified" in body and headers["Retry-After"]
        fetch = threading.Thread(
            target=lambda: fetch_from_peer(server.url, tmp_path / "x", token=TOKEN)
        )
        fetch.start()
        time.sleep(0.6)  # the fetcher meets at least one 503 first
        gate.set()
        fetch.join(timeout=30)
        assert not fetch.is_alive() and (tmp_path / "x" / step_dirname(3)).is_dir()
        make_checkpoint(root, 4, {"a": b"four"})
        (root / step_dirname(4) / "a").write_bytes(b"FOUR")  # corrupt
        for _ in range(3):
            assert msgpack.unpackb(raw_get(server.url, "/v1/index")[2])["step"] == 3
        assert calls == [3, 4]  # each step hashed once, the corrupt one included
