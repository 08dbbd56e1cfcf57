"""`prime-mesh coordinator` and `prime-mesh status` as real processes; the coordinator killed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mesh_node import BOUND, HB_TIMEOUT, mesh_nodes

from prime_testkit import free_port, start_mesh_coordinator

CLI = str(Path(sys.executable).parent / "prime-mesh")
TOKEN = "test-token-cli"


def _run(*args, env_token=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "PRIME_TOKEN"}
    if env_token:
        env["PRIME_TOKEN"] = env_token
    return subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(200)
def test_cli_status_and_coordinator_killed(children, tmp_path):
    coord, address = start_mesh_coordinator(children, TOKEN, "--min-nodes", "2")
    cluster = mesh_nodes(children, address, TOKEN)
    hosts = {"a": "127.0.0.3", "b": "127.0.0.2"}
    for n in "ab":
        cluster.start(
            n, metadata={"serve_url": f"http://{n}:1"}, host=hosts[n], coordinator_grace_s=2.0
        )
    joined = {n: cluster.expect(n, "joined", timeout=120) for n in "ab"}
    assert {j["world"] for j in joined.values()} == {2}
    # gloo binds to and advertises the given host: each listens on its own address, and one
    # connects to the address the other advertised (which one is gloo's choice).
    cluster.send(["a", "b"], "sockets")
    ends = {n: cluster.expect(n, "sockets") for n in "ab"}
    assert hosts["a"] in ends["a"]["local"] and hosts["b"] in ends["b"]["local"], ends
    assert hosts["b"] in ends["a"]["remote"] or hosts["a"] in ends["b"]["remote"], ends

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    out = _run("status", "--coordinator", address, "--token-file", str(token_file))
    assert out.returncode == 0, out.stderr
    assert "epoch 1, 2 members" in out.stdout
    for needle in ("node-1", "node-2", "member", "http://a:1", "http://b:1", "heartbeat"):
        assert needle in out.stdout, out.stdout
    out = _run("status", "--coordinator", address, "--json", env_token=TOKEN)
    assert out.returncode == 0 and '"serve_url": "http://b:1"' in out.stdout

    bad = tmp_path / "bad"
    bad.write_text("wrong")
    out = _run("status", "--coordinator", address, "--token-file", str(bad))
    assert out.returncode == 2 and "PRIME_TOKEN" in out.stderr and "Traceback" not in out.stderr

    taken = address.split(":")[1]
    out = _run("coordinator", "--host", "127.0.0.1", "--port", taken, env_token=TOKEN)
    assert (
        out.returncode == 2
        and "pick another --port" in out.stderr
        and "Traceback" not in out.stderr
    )

    # A node whose main thread computes for longer than the timeout keeps its heartbeats.
    cluster.send("a", "compute", seconds=HB_TIMEOUT + 1)
    cluster.expect("a", "computed", timeout=60)
    cluster.send(["a", "b"], "allreduce", value=1.0)
    assert [cluster.get(n)[0] for n in "ab"] == ["ok", "ok"]
    assert "epoch 1, 2 members" in _run("status", "--coordinator", address, env_token=TOKEN).stdout

    # A stalled coordinator: the nodes notice its silence within the heartbeat timeout.
    coord.p.send_signal(signal.SIGSTOP)
    stopped_at = time.time()
    for n in "ab":
        while True:  # mesh calls answer normally until the silence exceeds the timeout
            cluster.send(n, "check")
            kind, kw = cluster.get(n, timeout=BOUND)
            assert kw["t"] - stopped_at < BOUND, (n, kind, kw)
            if kind == "error":
                break
            time.sleep(0.2)
        assert kw["type"] == "CoordinatorLost" and "has not answered" in kw["msg"], kw
    coord.p.send_signal(signal.SIGKILL)
    coord.p.send_signal(signal.SIGCONT)
    coord.p.wait(timeout=10)
    for n in "ab":
        cluster.send(n, "reinit")
    for n in "ab":  # no coordinator comes back within their grace
        assert cluster.expect(n, "error", timeout=BOUND)["type"] == "CoordinatorGone"
    # Nothing else is torn down: the group they hold still works.
    cluster.send("a", "plain_allreduce", value=1.0)
    cluster.send("b", "plain_allreduce", value=3.0)
    assert [cluster.expect(n, "ok")["mean"] for n in "ab"] == [2.0, 2.0]
    cluster.send(["a", "b"], "exit")


def test_cli_user_mistakes_are_clear(tmp_path):
    out = _run("coordinator", "--port", "0")
    assert out.returncode == 2 and "PRIME_TOKEN" in out.stderr and "Traceback" not in out.stderr
    out = _run("status", "--coordinator", "127.0.0.1:1", env_token=TOKEN, timeout=60)
    assert out.returncode == 2 and "cannot reach the coordinator" in out.stderr
    out = _run("status", "--coordinator", "nonsense", env_token=TOKEN)
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
    out = _run("status", "--coordinator", "127.0.0.1:1", "--token-file", str(tmp_path / "missing"))
    assert out.returncode == 2 and "cannot read --token-file" in out.stderr


def _listening(port: int) -> set[str]:
    """The local addresses of this machine's TCP sockets listening on `port` (IPv6 ones as
    "ipv6:HEX"), read from /proc."""
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(path).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                if len(addr) == 8:
                    found.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.add(f"ipv6:{addr}")
    return found


@pytest.mark.timeout(120)
def test_the_coordinator_and_its_store_listen_on_its_host_only(children):
    store_port = free_port()
    coord, address = start_mesh_coordinator(children, TOKEN, "--store-port", str(store_port))
    # torch's TCPStore alone would listen on every interface (ipv6 "::", dual stack)
    assert _listening(int(address.rsplit(":", 1)[1])) == {"127.0.0.1"}
    assert _listening(store_port) == {"127.0.0.1"}
    out = _run("coordinator", "--host", "127.0.0.1", "--port", "0", "--store-port",
               str(store_port), env_token=TOKEN)  # fmt: skip
    assert out.returncode == 2 and "pick another --store-port" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    coord.p.send_signal(signal.SIGTERM)
    assert coord.p.wait(timeout=30) == 0


@pytest.mark.timeout(200)
def test_node_names_show_and_a_live_nodes_name_is_refused(children):
    coord, address = start_mesh_coordinator(children, TOKEN, "--min-nodes", "2")
    cluster = mesh_nodes(children, address, TOKEN)
    for n in "ab":
        cluster.start(n, node_name=f"dc1-{n}")
    joined = {n: cluster.expect(n, "joined", timeout=120) for n in "ab"}
    assert {j["node_id"] for j in joined.values()} == {"dc1-a", "dc1-b"}
    out = _run("status", "--coordinator", address, env_token=TOKEN)
    assert out.returncode == 0 and "epoch 1, 2 members" in out.stdout, out.stdout
    assert re.search(r"dc1-a +member", out.stdout) and re.search(r"dc1-b +member", out.stdout)

    # A second live node under a name that a live node holds: refused, after waiting one
    # heartbeat timeout in case the holder had died.
    started = time.monotonic()
    cluster.start("twin", node_name="dc1-a")
    err = cluster.expect("twin", "error", timeout=60)
    assert err["type"] == "MeshNameTaken", err
    assert "the node name 'dc1-a' is held by a live node of this run (member" in err["msg"]
    assert "--mesh.node_name" in err["msg"] and f"after {HB_TIMEOUT:g} s" in err["msg"]
    assert HB_TIMEOUT <= time.monotonic() - started < BOUND + 30
    assert "dc1-a" in _run("status", "--coordinator", address, env_token=TOKEN).stdout

    # The holder dies; the node restarted under its name takes it back.
    cluster.signal("a", signal.SIGKILL)
    cluster.start("a-again", node_name="dc1-a", wait=False)
    again = cluster.expect("a-again", "registered", timeout=60)
    assert again["node_id"] == "dc1-a" and again["state"] == "joining", again
    out = _run("status", "--coordinator", address, "--json", env_token=TOKEN).stdout
    nodes = {n["node_id"]: n["state"] for n in json.loads(out)["nodes"]}
    assert nodes == {"dc1-b": "member", "dc1-a": "joining"}, nodes
    cluster.send(["b", "a-again"], "exit")


FAILING_LOOP = """
import sys
from prime_mesh import cli
from prime_mesh.membership import Membership

def tick(self):  # a bug in the state machine, injected
    raise RuntimeError("injected bug")

Membership.tick = tick
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
def test_a_coordinator_whose_loop_fails_exits_1_instead_of_living_on_deaf():
    """An exception in the connection loop (a 1024-node run found one) used to end its
    thread while the process lived on, serving nobody; now the coordinator stops, logs the
    traceback and exits 1, so a supervisor restarts it."""
    env = {**os.environ, "PRIME_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, "-c", FAILING_LOOP, "coordinator", "--host", "127.0.0.1", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "listening on" in out.stdout
    assert "connection loop failed" in out.stderr and "Traceback" in out.stderr
    assert "prime-mesh coordinator failed (RuntimeError: injected bug)" in out.stderr
