"""The mesh's status page during a real 2-node debug run through the prime-train CLI, looked at
in headless Chromium: both nodes listed, a rising step, the loss chart drawn.

The screenshot in packages/prime-mesh/README.md is this test's own: run it with
`PRIME_STATUS_SCREENSHOT=packages/prime-mesh/docs/status.png uv run pytest tests/test_status_page.py`.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prime_browser import canvas_ink, chromium, table

from prime_testkit import debug_args, free_port, wait_until

TOKEN = "status-page-run-token"
RUN = [
    "--train.steps", "120",
    "--diloco.inner_steps", "20",
    "--ckpt.every", "0",
    "--eval.every", "20",
    "--run.log_every", "10",
    "--launch.local_nodes", "2",
]  # fmt: skip


def members(session) -> dict[str, list[str]]:
    return {r[0]: r for r in table(session, "nodes") if len(r) > 6 and r[1] == "member"}


def steps(session) -> dict[str, int]:
    return {k: int(r[5]) for k, r in members(session).items() if r[5].isdigit()}


def outer_steps(session) -> list[int]:
    return [int(r[6]) if r[6].isdigit() else 0 for r in members(session).values()]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_status_page_during_a_two_node_run(tmp_path, children):
    port = free_port()
    env = dict(os.environ, PRIME_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "prime_train.cli",
           *debug_args(tmp_path / "runs", tmp_path / "cache"),
           *RUN, "--launch.status_port", str(port)]  # fmt: skip
    proc = children.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    output: list[str] = []

    def pump():
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    url = None
    while url is None:
        line = lines.get(timeout=120)
        if line.startswith("[launch] status page at "):
            url = line.split(" at ", 1)[1].strip()
    assert url == f"http://127.0.0.1:{port}/"

    with chromium() as session:
        session.get(url)
        wait_until(lambda: len(steps(session)) == 2 or proc.poll() is not None, 240,
                   what="both nodes on the page with a step")  # fmt: skip
        assert proc.poll() is None, "".join(output)[-3000:]
        first = steps(session)
        wait_until(lambda: all(steps(session).get(k, 0) > s for k, s in first.items()), 120,
                   what="every node's step rising")  # fmt: skip
        wait_until(lambda: min(outer_steps(session), default=0) >= 4, 300,
                   what="four outer steps on both nodes")  # fmt: skip
        rows = members(session)
        assert len(rows) == 2
        for r in rows.values():
            loss, heldout, sent = r[8], r[9], r[11]
            assert float(loss) > 0 and float(heldout) > 0, r
            assert sent.endswith("kB") or sent.endswith("MB"), r  # bytes per outer step
            assert r[12] == "0", r  # checkpoint failures so far
            assert r[13].endswith(" s"), r  # compute · all-reduce · wait split
        summary = session.find_element("id", "summary").text
        assert summary.startswith("epoch 1 · 2 members"), summary
        assert [r[2] for r in table(session, "events")] == ["formed"]
        assert canvas_ink(session, "loss-chart") > 2000, "the loss chart is not drawn"
        shot = os.environ.get("PRIME_STATUS_SCREENSHOT")
        target = Path(shot) if shot else tmp_path / "status.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        height = session.execute_script("return document.documentElement.scrollHeight")
        session.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": 1500, "height": min(int(height) + 16, 1400), "deviceScaleFactor": 1,
            "mobile": False})  # fmt: skip
        assert session.save_screenshot(str(target)) and target.stat().st_size > 10_000
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the nodes finish their step, checkpoint, exit 0
    assert proc.wait(timeout=300) == 0, "".join(output)[-3000:]
