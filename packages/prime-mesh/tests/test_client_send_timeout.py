"""A node's client sends with a timeout: a coordinator that completed the handshake and then
stopped reading (a stalled process, a cut link) cannot hold the node's send lock, and with
it every request of the node, for good. A real CoordinatorClient against a peer that never
reads: the request raises CoordinatorLost (the send times out after the heartbeat timeout)
instead of blocking for good."""

import socket
import threading

import pytest

from prime_mesh.client import CoordinatorClient
from prime_mesh.errors import CoordinatorLost
from prime_mesh.wire import read_frame, server_hello


def _silent_coordinator(stop: threading.Event) -> tuple[int, list]:
    """A listener that greets like a coordinator, reads the client's hello, then never reads."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list = [srv]

    def serve() -> None:
        conn, _ = srv.accept()
        held.append(conn)
        _, hello = server_hello()
        conn.sendall(hello)
        read_frame(conn)
        stop.wait(60)

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], held


@pytest.mark.timeout(60)
def test_a_send_to_a_coordinator_that_stopped_reading_times_out():
    stop = threading.Event()
    port, held = _silent_coordinator(stop)
    try:
        client = CoordinatorClient(
            f"127.0.0.1:{port}", b"token", heartbeat_interval=0.5, heartbeat_timeout=2.0
        )
        blob = "x" * (4 << 20)  # a few of these fill the socket buffers both ways
        with pytest.raises(CoordinatorLost, match="lost the coordinator"):
            for _ in range(256):  # until the buffers are full and a send blocks
                client.send({"type": "status", "pad": blob})
        assert client.failed
        with pytest.raises(CoordinatorLost):  # the next one fails, it does not queue behind
            client.request({"type": "status"}, timeout=30)
        client.close()
    finally:
        stop.set()
        for s in held:
            s.close()
