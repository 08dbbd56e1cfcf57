"""A joiner stalled or cut off before it was admitted registers again and joins, through the
CLI (each node its own process and folder; a coordinator in the test process).

Node 1 joins node 0's running job; it holds its `ready()` a while (the fault hook
`PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S`), and the test SIGSTOPs it there past the heartbeat
timeout: the coordinator evicts it before its admission. On SIGCONT it must not exit with the
library's `MeshEvicted` but register again, join, and end with node 0's outer weights.
"""

import signal

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_cli_node, wait_until

TOKEN = "join-evicted-test-token"
H = 10
STEPS = 200  # node 0 alone takes about a minute: node 1 joins well before its end
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_evicted_before_admission_joins_again(tmp_path, token_cache, children):
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    try:
        p0 = start_cli_node(children, n0, coordinator=coord.address, cache=token_cache, **NODE)
        wait_until(lambda: 1 in outer_by_step(folder_metrics(n0)) or p0.poll() is not None,
                   120, what="node 0's first outer step")  # fmt: skip
        env = {"PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S": "8"}
        p1 = start_cli_node(children, n1, coordinator=coord.address, cache=token_cache,
                            env=env, **NODE)  # fmt: skip
        log1 = tmp_path / "node1.log"
        wait_until(lambda: "holding ready()" in log1.read_text() or p1.poll() is not None,
                   120, what="node 1 holding its ready()")  # fmt: skip
        p1.send_signal(signal.SIGSTOP)
        try:  # evicted as a joiner: no new epoch, an event on the page
            wait_until(lambda: any(e["kind"] == "evicted" for e in coord.page_status()["events"]),
                       60, what="node 1 evicted before its admission")  # fmt: skip
        finally:
            p1.send_signal(signal.SIGCONT)
        codes = [p.wait(timeout=240) for p in (p0, p1)]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    # The eviction reaches it as MeshEvicted (it then registers again, saying so) or, when
    # the coordinator's closing of its connection comes first, through its client's own
    # reconnection; either way it must not end with the library's MeshEvicted line
    log = log1.read_text()
    assert "close() this mesh" not in log or "lost its place while joining" in log, log[-3000:]
    outer0, outer1 = outer_by_step(folder_metrics(n0)), outer_by_step(folder_metrics(n1))
    assert max(outer1) == max(outer0) == STEPS // H, log_tails(tmp_path)
    joined = [r for r in folder_metrics(n1) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["fetch_bytes"] > 0, joined
    after = [k for k, r in outer1.items() if r["step"] >= joined[0]["step"]]
    assert after and all(outer1[k]["outer_sha256"] == outer0[k]["outer_sha256"] for k in after)
    assert outer0[STEPS // H]["nodes"] == 2
