"""No connection can tie the coordinator up: 500 idle connections, a client dripping its hello
one byte at a time and oversized frames, while a real run goes on (the `prime-mesh
coordinator` process, two mesh node processes with gloo groups): its members keep
committing, the coordinator's threads stay bounded, every hostile connection is closed by
the coordinator, and the refusals are logged once (one address, within a minute).
"""

import os
import socket
import time

import msgpack
import pytest
from mesh_node import BOUND, coordinator_process, mesh_nodes

from prime_mesh.wire import HELLO_MAX, parse_address, read_frame, write_frame
from prime_testkit import mesh_round

TOKEN = "test-token-hostile"
THREAD_BOUND = 16  # the loop, the main thread, the store's and torch's own: not per connection


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the coordinator closed `sock` within `within` seconds (reading what it sent)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionError, OSError) as e:
        return not isinstance(e, TimeoutError)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_idle_slow_drip_and_oversized_connections_never_stop_a_run(children):
    proc, address, lines = coordinator_process(children, TOKEN, min_nodes=2)
    host, port = parse_address(address)
    cluster = mesh_nodes(children, address, TOKEN)
    for n in "ab":
        cluster.start(n)
    for n in "ab":
        cluster.expect(n, "joined", timeout=120)
    mesh_round(cluster, {"a": 1.0, "b": 3.0}, timeout=BOUND + 30, check_mean=True)

    drip = socket.create_connection((host, port), timeout=10)
    read_frame(drip)  # the coordinator's hello
    big = socket.create_connection((host, port), timeout=10)
    read_frame(big)
    big.sendall((HELLO_MAX + 1).to_bytes(4, "big"))  # a frame too big for a hello
    refusal = msgpack.unpackb(read_frame(big))
    assert "exceeds" in refusal["error"] and "before authentication" in refusal["error"]
    huge = socket.create_connection((host, port), timeout=10)
    read_frame(huge)
    write_frame(huge, msgpack.packb({"nonce": os.urandom(16)}))
    huge.sendall((1 << 30).to_bytes(4, "big"))  # 1 GiB "registration" before authenticating
    assert "exceeds" in msgpack.unpackb(read_frame(huge))["error"]
    # past the cap on handshaking connections per address (256), the rest are refused at once
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(500)]

    # the run goes on meanwhile: one round per second while the drip goes on for 12 s
    payload = msgpack.packb({"nonce": os.urandom(16)})
    hello = len(payload).to_bytes(4, "big") + payload  # 29 bytes: not all sent within 12 s
    started, peak, rounds = time.monotonic(), 0, 0
    for i in range(12):
        try:
            drip.send(hello[i : i + 1])
        except OSError:
            break  # closed by the coordinator: its handshake deadline passed
        mesh_round(cluster, {"a": float(i), "b": 1.0}, timeout=BOUND + 30, check_mean=True)
        rounds += 1
        peak = max(peak, _threads(proc.pid))
        time.sleep(max(0.0, started + i + 1 - time.monotonic()))
    assert rounds >= 5
    assert peak <= THREAD_BOUND, f"{peak} threads in the coordinator"
    assert _closed_by_peer(drip, within=5), "the slow-drip client still holds its connection"
    # every idle connection was closed: refused at once past the per-address cap, the others
    # when their handshake deadline passed
    assert all(_closed_by_peer(s, within=5) for s in idle)
    for s in (*idle, drip, big, huge):
        s.close()
    mesh_round(cluster, {"a": 2.0, "b": 4.0}, timeout=BOUND + 30, check_mean=True)

    cluster.send(["a", "b"], "exit")
    proc.terminate()
    proc.wait(30)
    log = []
    while not lines.empty():
        log.append(lines.get())
    refused = [ln for ln in log if "refused connection" in ln]
    assert len(refused) == 1, refused  # one address, within a minute: one line
