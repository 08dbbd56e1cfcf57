"""A member's open files and threads stay flat while nodes join and die around it.

Each membership change builds a new gloo group (a store clone, a device with its own thread
and sockets, worker threads); the replaced ones must be released once nobody uses them.
"""

import signal
import threading

import pytest
from mesh_node import BOUND, mesh_nodes

from prime_mesh import Coordinator
from prime_mesh.epoch import RetiredGroups
from prime_testkit import node_ids, wait_until

TOKEN = "test-token-leaks"
CYCLES = 10
SLACK = 10  # files or threads a member may gain over the cycles after the first


def test_a_retired_group_is_released_off_the_caller_thread_once_nobody_holds_it():
    released = []

    class Group:
        def __del__(self) -> None:
            released.append(threading.current_thread().name)

    retired = RetiredGroups(interval=3600.0)  # the test sweeps itself
    group = Group()
    retired.add(group)
    assert retired.sweep() == 0 and retired.held() == 1, "the caller still holds it"
    del group
    assert retired.sweep() == 1 and retired.held() == 0
    wait_until(lambda: released, 10, what="the group to be released")
    assert released == ["mesh-release-groups"]


def _resources(cluster, name: str) -> tuple[int, int]:
    cluster.send(name, "resources")
    r = cluster.expect(name, "resources")
    return r["fds"], r["threads"]


def _allreduce(cluster, names: list[str]) -> None:
    for i, n in enumerate(names):
        cluster.send(n, "allreduce", value=float(i))
    for n in names:
        assert cluster.expect(n, "ok", timeout=BOUND + 30)["world"] == len(names)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_member_keeps_its_files_and_threads_while_a_node_joins_and_dies(children):
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=2).start()
    cluster = mesh_nodes(children, coord.address, TOKEN)
    members = ["a", "b"]
    try:
        for n in members:
            cluster.start(n)
        for n in members:
            cluster.expect(n, "joined", timeout=120)
        _allreduce(cluster, members)
        counts = []
        cluster.start("c0", wait_until_ready=True)
        for cycle in range(CYCLES):
            c = f"c{cycle}"
            node_id = cluster.expect(c, "registered", timeout=120)["node_id"]
            cluster.send(c, "ready")
            cluster.expect(c, "ready")
            if cycle + 1 < CYCLES:  # the next joiner starts meanwhile, waiting until ready
                cluster.start(f"c{cycle + 1}", wait_until_ready=True)
            cluster.send([*members, c], "reinit")  # admits c
            assert [
                cluster.expect(n, "reinit", timeout=BOUND + 30)["world"] for n in [*members, c]
            ] == [3] * 3
            _allreduce(cluster, [*members, c])  # the group's connections are made
            cluster.signal(c, signal.SIGKILL)
            cluster.procs[c].join(timeout=30)
            wait_until(lambda i=node_id: i not in node_ids(coord), 60, what=f"{c} evicted")
            cluster.send(members, "reinit")
            assert [cluster.expect(n, "reinit")["world"] for n in members] == [2, 2]
            _allreduce(cluster, members)
            counts.append(_resources(cluster, "a"))
        print("member a (open files, threads) after each cycle:", counts)
        (fds0, threads0), (fds, threads) = counts[0], counts[-1]
        assert fds <= fds0 + SLACK, f"open files grew from {fds0} to {fds}: {counts}"
        assert threads <= threads0 + SLACK, f"threads grew from {threads0} to {threads}: {counts}"
        cluster.send(members, "exit")
    finally:
        coord.close()
