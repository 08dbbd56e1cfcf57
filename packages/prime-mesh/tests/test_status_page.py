"""The status page's server: progress reported with heartbeats, /api/status, /metrics parsed
with the Prometheus client's own parser, the security headers, and `prime-mesh coordinator
--status-port` as a real process."""

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prime_mesh import Coordinator, ElasticDeviceMesh
from prime_mesh.progress import SERIES_POINTS, History, validate_progress
from prime_testkit import free_port, wait_until

TOKEN = "status-page-secret-token"
CLI = str(Path(sys.executable).parent / "prime-mesh")


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, dict(r.headers), r.read()


@pytest.fixture
def served():
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    page = coord.serve_status()
    mesh = ElasticDeviceMesh(
        coord.address,
        host="127.0.0.1",
        token=TOKEN,
        metadata={"label": "<b>node</b>", "_private": "hidden-value", "config_hash": "abc"},
        heartbeat_interval=0.2,
        heartbeat_timeout=3.0,
    )
    try:
        yield coord, page, mesh
    finally:
        mesh.close()
        coord.close()


def report_and_wait(coord, mesh, **numbers):
    mesh.report_progress(**numbers)
    wait_until(
        lambda: all(
            coord.page_status()["nodes"][0]["progress"].get(k) == v for k, v in numbers.items()
        ),
        10,
        what="the report to reach the coordinator",
    )


def test_progress_is_validated():
    assert validate_progress({"step": 3, "loss": 2}) == {"step": 3, "loss": 2.0}
    for bad, words in [
        ({"stpe": 1}, "unknown progress field 'stpe'"),
        ({"step": 1.5}, "'step' must be a whole number"),
        ({"loss": float("nan")}, "'loss' must be a number >= 0"),
        ({"loss": -1.0}, "'loss' must be a number >= 0"),
        ({"loss": "2"}, "'loss' must be a number"),
        ({"step": True}, "'step' must be a whole number"),
    ]:
        with pytest.raises(ValueError, match=words):
            validate_progress(bad)


def test_history_is_bounded_and_drops_malformed_reports():
    h = History()
    for i in range(SERIES_POINTS + 50):
        h.report("node-1", [{"step": i, "loss": 1.0}])
    h.report("node-1", [{"step": -1}, "junk", {"loss": float("inf")}])
    h.report("node-1", "not a list")
    assert len(h.series["node-1"]) == SERIES_POINTS
    assert h.series["node-1"][-1]["step"] == SERIES_POINTS + 49
    assert h.dropped_reports == 4


def test_api_status_shows_progress_members_and_history(served):
    coord, page, mesh = served
    with pytest.raises(ValueError, match="unknown progress field"):
        mesh.report_progress(steps=1)
    for step in (10, 20):
        report_and_wait(coord, mesh, step=step, loss=5.0 - step / 10, tokens_per_s=1000.0)
    report_and_wait(coord, mesh, step=20, outer_step=1, eval_loss=3.5, bytes_sent=4096,
                    outer_seconds=1.5, allreduce_seconds=1.0, wait_seconds=0.5,
                    compute_seconds=6.0)  # fmt: skip
    status, headers, body = get(page.url + "api/status")
    assert status == 200 and headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["epoch"] == 1 and data["members"] == [mesh.node_id]
    (node,) = data["nodes"]
    assert node["state"] == "member" and node["address"] == "127.0.0.1"
    assert node["progress"] == {
        "step": 20, "loss": 3.0, "tokens_per_s": 1000.0, "outer_step": 1, "eval_loss": 3.5,
        "bytes_sent": 4096, "outer_seconds": 1.5, "allreduce_seconds": 1.0,
        "wait_seconds": 0.5, "compute_seconds": 6.0,
    }  # fmt: skip
    assert [p["step"] for p in data["series"][mesh.node_id]] == [10, 20, 20]
    assert [(e["kind"], e["epoch"], e["members"]) for e in data["events"]] == [
        ("formed", 1, [mesh.node_id])
    ]
    # a node's private metadata, the token and the rendezvous prefix are never shown
    assert node["metadata"] == {"label": "<b>node</b>", "config_hash": "abc"}
    for path in ("", "api/status", "metrics", "status.js"):
        text = get(page.url + path)[2].decode()
        assert TOKEN not in text and "hidden-value" not in text and "_private" not in text
        assert coord.state.prefix not in text


def test_metrics_parse_with_the_prometheus_parser(served):
    coord, page, mesh = served
    report_and_wait(coord, mesh, step=40, loss=2.5, eval_loss=2.75, tokens_per_s=321.0,
                    bytes_sent=1000, ckpt_errors=2)  # fmt: skip
    status, headers, body = get(page.url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    node = (("node_id", mesh.node_id),)
    assert samples[("prime_mesh_epoch", ())] == 1
    assert samples[("prime_mesh_members", ())] == 1
    assert samples[("prime_mesh_nodes", (("state", "member"),))] == 1
    assert samples[("prime_mesh_membership_events_total", (("kind", "formed"),))] == 1
    assert samples[("prime_mesh_node_step", node)] == 40
    assert samples[("prime_mesh_node_loss", node)] == 2.5
    assert samples[("prime_mesh_node_eval_loss", node)] == 2.75
    assert samples[("prime_mesh_node_tokens_per_second", node)] == 321.0
    assert samples[("prime_mesh_node_bytes_sent", node)] == 1000
    assert samples[("prime_mesh_node_ckpt_errors", node)] == 2
    assert 0 <= samples[("prime_mesh_node_heartbeat_age_seconds", node)] < 3


def test_security_headers_and_read_only(served):
    _, page, _ = served
    for path in ("", "status.js", "status.css", "api/status", "metrics"):
        _, headers, _ = get(page.url + path)
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and headers["X-Content-Type-Options"] == "nosniff"
    html = get(page.url)[2].decode()
    assert '<script src="/status.js"' in html and "http" not in html  # nothing from elsewhere
    js = get(page.url + "status.js")[2].decode()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "document.write" not in js
    with pytest.raises(urllib.error.HTTPError) as e:
        get(page.url + "nope")
    assert e.value.code == 404
    req = urllib.request.Request(page.url + "api/status", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 501


def test_a_leaving_node_is_in_the_epoch_history(served):
    coord, _, mesh = served
    mesh.close()
    # a departure takes effect with those close to it (the coordinator's batch window)
    wait_until(lambda: coord.page_status()["events"][-1]["kind"] == "left", 5,
               what="the departure's epoch")  # fmt: skip
    data = coord.page_status()
    assert [(e["kind"], e["node_id"], e["reason"]) for e in data["events"]][-1] == (
        "left",
        mesh.node_id,
        "left gracefully",
    )
    assert [(n["node_id"], n["state"]) for n in data["nodes"]] == [(mesh.node_id, "left")]


def readme_block(language: str, contains: str) -> str:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    return next(b for b in blocks if contains in b)


def test_readme_report_progress_example(served):
    coord, _, mesh = served
    exec(readme_block("python", "mesh.report_progress("), {"mesh": mesh})
    wait_until(lambda: coord.page_status()["nodes"][0]["progress"].get("outer_step") == 3, 10,
               what="the README's reports")  # fmt: skip
    progress = coord.page_status()["nodes"][0]["progress"]
    assert progress["step"] == 120 and progress["bytes_sent"] == 443_540


@pytest.mark.timeout(120)
def test_readme_coordinator_command_binds_loopback_and_serves(children):
    """The README's command as written, on free ports instead of 29500 and 8080."""
    command = next(
        line for line in readme_block("bash", "--status-port").splitlines()
        if line.startswith("prime-mesh coordinator")
    )  # fmt: skip
    args = shlex.split(command.replace("29500", str(free_port())).replace("8080", "0"))
    env = {**os.environ, "PRIME_TOKEN": TOKEN}
    proc = children.popen([CLI, *args[1:]], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = [proc.stdout.readline() for _ in range(4)]  # log lines, the URL, the address
    line = next((x for x in seen if x.startswith("prime-mesh status page at ")), "")
    assert line.startswith("prime-mesh status page at http://127.0.0.1:"), seen
    url = line.split(" at ")[1].strip()
    assert b"prime-mesh run" in get(url)[2]
    assert json.loads(get(url + "api/status")[2])["nodes"] == []
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_without_the_extra_a_clear_error(tmp_path):
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from prime_mesh.cli import main\n"
        "sys.exit(main(['coordinator', '--port', '0', '--status-port', '0']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PRIME_TOKEN": TOKEN},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "pip install 'prime-mesh[status]'" in r.stderr, r.stderr
