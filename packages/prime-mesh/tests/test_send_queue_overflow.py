"""A member that stops reading is evicted for its full send queue, never waited for.

A real run (the `prime-mesh coordinator` process, two mesh node processes with gloo groups)
admits a third member: a raw authenticated session ("deaf") that reads until it is a member,
then never reads again while it keeps heartbeating and asking for the run's status (each
answer carries its own 48 KB of metadata, so its unsent output grows past the coordinator's
cap and the kernel's buffers within seconds; heartbeats alone would take hours). The
coordinator must evict it with the reason naming its full send queue, and the two others,
held at their group build by the deaf member, must go on committing rounds without it.
"""

import secrets
import socket
import threading
import time

import pytest
from mesh_node import BOUND, coordinator_process, mesh_nodes

from prime_mesh.wire import client_handshake, parse_address
from prime_testkit import mesh_round

TOKEN = "test-token-overflow"
PAD = 48_000  # metadata bytes: under the 64 KiB first-message cap, in every status answer
FLOOD = 400  # status requests: about 20 MB of answers, far past 1 MiB plus kernel buffers


class DeafMember:
    """A registered node over a raw session that stops reading once it is a member."""

    def __init__(self, address: str) -> None:
        host, port = parse_address(address)
        self.sock = socket.socket()
        # a small receive window, so what it does not read piles up on the coordinator's side
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect((host, port))
        self.channel = client_handshake(self.sock, TOKEN.encode())
        self.cut = threading.Event()  # the coordinator closed the connection
        self.sent = 0

    def register(self) -> None:
        self.channel.send(
            {
                "type": "register",
                "id": 1,
                "node_key": secrets.token_hex(8),
                "local_rank": 0,
                "local_world_size": 1,
                "metadata": {"pad": "x" * PAD},
                "heartbeat_timeout": 3.0,
                "name": "deaf",
                "ready": True,
            }
        )

    def wait_member(self, timeout: float) -> None:
        """Read (heartbeating meanwhile) until an epoch holds this node; then read no more."""
        deadline = time.monotonic() + timeout
        beat = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= beat:
                self._send({"type": "hb"})
                beat = time.monotonic() + 0.5
            self.sock.settimeout(0.2)
            try:
                msg = self.channel.recv()
            except TimeoutError:
                continue
            finally:
                self.sock.settimeout(30)
            if msg.get("type") == "epoch" and "deaf" in msg["epoch"]["members"]:
                return
        raise AssertionError("the deaf node was never admitted")

    def _send(self, msg: dict) -> bool:
        try:
            self.channel.send(msg)
            self.sent += 1
            return True
        except OSError:  # closed by the coordinator (reset, or a send timing out for good)
            self.cut.set()
            return False

    def flood_and_beat(self, until: float) -> None:
        """Ask for the status FLOOD times, then heartbeat, without reading, until cut off."""
        for i in range(FLOOD):
            if not self._send({"type": "status", "id": 100 + i}):
                return
        while time.monotonic() < until and self._send({"type": "hb"}):
            time.sleep(0.5)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_member_that_stops_reading_is_evicted_for_its_full_send_queue(children):
    proc, address, lines = coordinator_process(children, TOKEN, min_nodes=2)
    cluster = mesh_nodes(children, address, TOKEN)
    for n in "ab":
        cluster.start(n)
    for n in "ab":
        cluster.expect(n, "joined", timeout=120)
    mesh_round(cluster, {"a": 1.0, "b": 3.0}, timeout=BOUND + 30, check_mean=True)

    deaf = DeafMember(address)
    deaf.register()
    # the members' next sync point admits it; their group build then waits for it
    cluster.send(["a", "b"], "reinit")
    deaf.wait_member(timeout=60)
    flood = threading.Thread(
        target=deaf.flood_and_beat, args=(time.monotonic() + BOUND + 30,), daemon=True
    )
    flood.start()
    # evicted for its queue, never waited for: the others' build ends in the next epoch
    for n in "ab":
        info = cluster.expect(n, "reinit", timeout=BOUND + 30)
        assert info["world"] == 2, info
    for i in range(3):  # and the run goes on without it
        mesh_round(cluster, {"a": float(i), "b": 1.0}, timeout=BOUND + 30, check_mean=True)
    flood.join(BOUND + 35)
    assert deaf.cut.is_set(), "the deaf node's connection is still open"
    deaf.close()

    cluster.send(["a", "b"], "exit")
    proc.terminate()
    proc.wait(30)
    log = []
    while not lines.empty():
        log.append(lines.get())
    evicted = [ln for ln in log if "deaf evicted" in ln]
    assert len(evicted) == 1, log
    assert "its send queue is full" in evicted[0] and "does not read" in evicted[0], evicted
