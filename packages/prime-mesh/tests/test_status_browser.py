"""The status page in headless Chromium while real node processes train (a stand-in loop of
sync points and progress reports), through a node being SIGKILLed and a new one joining."""

import os
import signal
import sys

import pytest
from prime_browser import canvas_ink, chromium, table

from prime_mesh import Coordinator
from prime_testkit import wait_until

TOKEN = "status-browser-token"
LABEL = '<img src=x id="injected"> & <b>bold</b>'
NODE = """
import os, time
from prime_mesh import ElasticDeviceMesh
mesh = ElasticDeviceMesh(os.environ["COORD"], host="127.0.0.1", heartbeat_interval=0.2,
                         heartbeat_timeout=2.0, metadata={"label": os.environ["LABEL"],
                         "_private": "hidden-value"})
step = 0
while True:
    mesh.maybe_reinit_global_pg()  # a sync point: a dead peer is dropped here
    step += 10
    mesh.report_progress(step=step, loss=6.0 / (1 + step / 100), tokens_per_s=500.0)
    time.sleep(0.2)
"""


def start_node(children, address, label):
    env = {**os.environ, "PRIME_TOKEN": TOKEN, "COORD": address, "LABEL": label}
    return children.popen([sys.executable, "-c", NODE], env=env)


def node_rows(session) -> dict[str, list[str]]:
    return {c[0]: c for c in table(session, "nodes") if c}


def event_rows(session) -> list[list[str]]:
    return table(session, "events")


def step_of(session, node_id: str) -> int:
    row = node_rows(session).get(node_id)
    return int(row[5]) if row and row[5].isdigit() else -1


@pytest.mark.timeout(240)
def test_page_through_a_killed_and_a_new_node(children):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        page = coord.serve_status()
        a = start_node(children, coord.address, LABEL)
        wait_until(lambda: len(coord.status()["nodes"]) == 1, 60, what="node a to register")
        b = start_node(children, coord.address, "second")
        with chromium() as session:
            session.get(page.url)
            wait_until(lambda: {"node-1", "node-2"} <= set(node_rows(session)), 90,
                       what="both nodes on the page")  # fmt: skip
            # both rows can show before node-1's first progress report reaches the page
            wait_until(lambda: step_of(session, "node-1") > 0, 30, what="node-1's first step")
            first = step_of(session, "node-1")
            wait_until(lambda: step_of(session, "node-1") > first, 30, what="a rising step")
            rows = node_rows(session)
            assert rows["node-1"][1].startswith("member") and rows["node-2"][1] == "member"
            # a node's string is shown as text, never as markup; private metadata is not shown
            assert f"label={LABEL}" in rows["node-1"][-1]
            assert not session.find_elements("id", "injected")
            assert not session.find_elements("css selector", "#nodes b")
            assert "hidden-value" not in session.page_source
            wait_until(lambda: canvas_ink(session, "loss-chart") > 500, 30, what="the chart")

            b.send_signal(signal.SIGKILL)
            b.wait(timeout=30)

            def evicted():
                return any(r[2] == "evicted" and r[3] == "node-2" for r in event_rows(session))

            wait_until(evicted, 30, what="the eviction in the epoch history")
            ev = next(r for r in event_rows(session) if r[2] == "evicted")
            assert ev[4] == "connection of local rank 0 closed" and ev[5] == "node-1"
            assert node_rows(session)["node-2"][1].startswith("evicted")

            start_node(children, coord.address, "rejoined")  # the same command again
            wait_until(lambda: node_rows(session).get("node-3", ["", ""])[1] == "member", 90,
                       what="the new node admitted on the page")  # fmt: skip
            joined = step_of(session, "node-3")
            wait_until(lambda: step_of(session, "node-3") > joined, 30,
                       what="the new node's step rising")  # fmt: skip
            kinds = [(r[2], r[3]) for r in event_rows(session)]
            assert ("joined", "node-3") in kinds and ("evicted", "node-2") in kinds
            summary = session.find_element("id", "summary").text
            assert summary.startswith("epoch 3 · 2 members"), summary
            assert node_rows(session)["node-2"][1].startswith("evicted")
            assert a.poll() is None

            # a restarted coordinator starts a new history, and the open page says so
            port = int(page.url.rsplit(":", 1)[1].strip("/"))
            coord.close()
            wait_until(lambda: "cannot reach the coordinator" in session.find_element(
                "id", "connection").text, 30, what="the page noticing the coordinator gone")  # fmt: skip
            coord = Coordinator("127.0.0.1", port=0, token=TOKEN).start()
            coord.serve_status(port=port)
            wait_until(lambda: "coordinator restarted" in session.find_element(
                "id", "history").text, 30, what="the page saying the coordinator restarted")  # fmt: skip
            assert table(session, "nodes") == [] and table(session, "events") == []
    finally:
        coord.close()
