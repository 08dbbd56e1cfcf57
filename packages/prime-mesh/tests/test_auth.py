"""Authentication, replay protection and refusals, against an in-process coordinator."""

import logging
import os
import socket
import threading

import msgpack
import pytest

from prime_mesh import (
    Coordinator,
    CoordinatorLost,
    CoordinatorUnreachable,
    ElasticDeviceMesh,
    MeshAuthError,
    MeshRefused,
)
from prime_mesh.wire import client_handshake, parse_address, read_frame, write_frame
from prime_testkit import free_port, node_ids, wait_until

TOKEN = "test-token-auth"
MIN_NODES = 3  # of the `coordinator` fixture (conftest.py)


def _connect(coordinator):
    return socket.create_connection(parse_address(coordinator.address), timeout=10)


class RecordingSocket:
    """A socket wrapper that keeps every byte the client sends, for replaying."""

    def __init__(self, sock):
        self.sock, self.sent = sock, bytearray()

    def sendall(self, data):
        self.sent += data
        return self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _register_msg(key="node-key-1"):
    return {"type": "register", "id": 1, "node_key": key, "local_rank": 0, "local_world_size": 1}


def test_wrong_token_is_refused_on_both_sides(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="prime_mesh.coordinator")
    with pytest.raises(MeshAuthError, match="PRIME_TOKEN"):
        ElasticDeviceMesh(coordinator.address, token="not-the-token", wait=False)
    wait_until(lambda: "refused connection" in caplog.text, 10, what="coordinator log line")
    assert "authentication" in caplog.text
    assert node_ids(coordinator) == []


def test_missing_token_is_a_clear_error(coordinator, monkeypatch):
    monkeypatch.delenv("PRIME_TOKEN", raising=False)
    with pytest.raises(MeshAuthError, match="PRIME_TOKEN"):
        ElasticDeviceMesh(coordinator.address)
    with pytest.raises(MeshAuthError, match="PRIME_TOKEN"):
        Coordinator("127.0.0.1", 0)


def test_token_from_environment(coordinator, monkeypatch):
    monkeypatch.setenv("PRIME_TOKEN", TOKEN)
    mesh = ElasticDeviceMesh(coordinator.address, wait=False, metadata={"url": "x"})
    try:
        (node,) = mesh.members()
        assert node["state"] == "joining" and node["metadata"] == {
            "url": "x"
        }  # readable before admission
    finally:
        mesh.close()
    wait_until(lambda: node_ids(coordinator) == [], 10, what="graceful leave")


def test_replayed_message_inside_a_connection_is_refused(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="prime_mesh.coordinator")
    sock = _connect(coordinator)
    rec = RecordingSocket(sock)
    ch = client_handshake(rec, TOKEN.encode())
    ch.send({"type": "status", "id": 1})
    assert ch.recv()["status"]["epoch"] == 0
    frame_start = len(rec.sent)
    ch.send({"type": "status", "id": 2})
    assert ch.recv()["id"] == 2
    replay = bytes(rec.sent[frame_start:])
    sock.sendall(replay)  # the same signed frame again
    answer = ch.recv()
    assert answer["type"] == "error" and "replayed" in answer["error"], answer
    assert "replayed" in caplog.text
    sock.close()


def test_replayed_registration_in_a_new_connection_is_refused(coordinator, caplog):
    caplog.set_level(logging.WARNING, logger="prime_mesh.coordinator")
    sock = _connect(coordinator)
    rec = RecordingSocket(sock)
    ch = client_handshake(rec, TOKEN.encode())
    ch.send(_register_msg())
    assert ch.recv()["node_id"] == "node-1"
    recorded = bytes(rec.sent)
    ch.close()
    wait_until(lambda: node_ids(coordinator) == [], 10, what="first connection to end")

    sock2 = _connect(coordinator)
    read_frame(sock2)  # the coordinator's hello, with a fresh nonce
    sock2.sendall(recorded)  # the whole recorded client stream: hello + signed registration
    refusal = msgpack.unpackb(read_frame(sock2))
    assert "authentication failed" in refusal["error"]
    sock2.close()
    assert node_ids(coordinator) == []
    assert "bad message authentication code" in caplog.text


def test_forged_and_malformed_input_never_registers(coordinator):
    sock = _connect(coordinator)
    read_frame(sock)
    write_frame(sock, msgpack.packb({"nonce": os.urandom(16)}))
    body = msgpack.packb(_register_msg())
    write_frame(sock, msgpack.packb([1, body, b"\0" * 32]))  # forged MAC
    assert "authentication failed" in msgpack.unpackb(read_frame(sock))["error"]
    sock.close()
    for junk in (b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n", (1 << 30).to_bytes(4, "big")):
        s = _connect(coordinator)
        s.sendall(junk)
        s.close()
    # still serving, nobody registered
    mesh = ElasticDeviceMesh(coordinator.address, token=TOKEN, wait=False)
    assert node_ids(coordinator) == [mesh.node_id]
    mesh.close()


def test_mismatched_joiner_is_refused(coordinator):
    run_settings = {"model.n_layers": "2", "optim.lr": "0.003"}
    first = ElasticDeviceMesh(
        coordinator.address,
        token=TOKEN,
        wait=False,
        metadata={"config_hash": "abc", "settings": run_settings},
    )
    try:
        with pytest.raises(MeshRefused, match="local_world_size 2 differs from the run's 1"):
            ElasticDeviceMesh(
                coordinator.address,
                token=TOKEN,
                wait=False,
                local_rank=0,
                local_world_size=2,
                node_key="k2",
            )
        with pytest.raises(MeshRefused, match="config hash 'zzz' differs"):
            ElasticDeviceMesh(
                coordinator.address, token=TOKEN, wait=False, metadata={"config_hash": "zzz"}
            )
        # the refusal names the settings that differ when both sides advertise them
        mine = {**run_settings, "model.n_layers": "3"}
        with pytest.raises(MeshRefused, match="model.n_layers is 3 here, 2 in the run; start"):
            ElasticDeviceMesh(
                coordinator.address,
                token=TOKEN,
                wait=False,
                metadata={"config_hash": "zzz", "settings": mine},
            )
        assert node_ids(coordinator) == [first.node_id]
    finally:
        first.close()


def test_unreachable_coordinator_and_bad_address():
    with pytest.raises(CoordinatorUnreachable, match="cannot reach the coordinator"):
        ElasticDeviceMesh(f"127.0.0.1:{free_port()}", token=TOKEN, coordinator_grace_s=0)
    with pytest.raises(CoordinatorUnreachable, match=r"cannot reach .* \(waited [12] s\)"):
        ElasticDeviceMesh(f"127.0.0.1:{free_port()}", token=TOKEN, coordinator_grace_s=1.5)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ElasticDeviceMesh("no-port-here", token=TOKEN)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        ElasticDeviceMesh("127.0.0.1:1", token=TOKEN, heartbeat_interval=5, heartbeat_timeout=3)


def test_coordinator_gone_is_a_clear_error_not_a_hang():
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=2).start()
    mesh = ElasticDeviceMesh(
        coord.address, token=TOKEN, wait=False, heartbeat_interval=0.5, heartbeat_timeout=3
    )
    coord.close()  # its sockets close, as when the process is killed
    with pytest.raises(CoordinatorLost, match="lost the coordinator"):
        wait_until(lambda: mesh.should_abort() and False, 10, what="the loss to be noticed")
    with pytest.raises(CoordinatorLost):
        mesh.maybe_reinit_global_pg()
    mesh.close()  # never raises


def test_a_node_started_before_its_coordinator_waits_for_it(caplog):
    """A node whose coordinator is not running yet (or restarts) retries its address within
    `coordinator_grace_s`, saying so once, and registers when the coordinator comes."""
    port = free_port()
    coordinator = Coordinator("127.0.0.1", port=port, token=TOKEN, min_nodes=1)
    starter = threading.Timer(2.0, coordinator.start)
    starter.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prime_mesh"):
            mesh = ElasticDeviceMesh(f"127.0.0.1:{port}", token=TOKEN, coordinator_grace_s=60)
        try:
            assert mesh.global_world_size == 1
        finally:
            mesh.close()
        told = [
            r.getMessage() for r in caplog.records if "retrying for up to 60 s" in r.getMessage()
        ]
        assert len(told) == 1 and "cannot reach the coordinator" in told[0], told
    finally:
        starter.join()
        coordinator.close()
