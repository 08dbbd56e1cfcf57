"""`[run] trackers` in a 2-node run through the CLI: the mesh's first member logs; when it is
killed, the survivor (now the first member) carries on in its own TensorBoard file."""

import signal
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from prime_mesh import Coordinator
from prime_testkit import debug_args, start_local_nodes, wait_until

TOKEN = "trackers-handover-token"


def loss_steps(folder: Path, node: int) -> list[int]:
    files = list(folder.glob(f"events.*.node{node}")) if folder.is_dir() else []
    if not files:
        return []
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_first_member_logs_and_hands_over_when_killed(tmp_path, children):
    args = debug_args(tmp_path / "runs", tmp_path / "cache", "--train.steps", "80",
            "--diloco.inner_steps", "20", "--ckpt.every", "0", "--eval.every", "20",
            "--run.log_every", "10", "--launch.local_nodes", "2",
            "--run.trackers", '["tensorboard"]')  # fmt: skip
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    tb = tmp_path / "runs" / "debug" / "tensorboard"
    try:
        logs = [tmp_path / f"node{k}.log" for k in range(2)]
        procs = start_local_nodes(children, coord, token=TOKEN, args=args, logs=logs)
        wait_until(lambda: 20 in loss_steps(tb, 0), 240, what="node 0 logging step 20")
        assert loss_steps(tb, 1) == [], "node 1 logged while node 0 was the first member"
        procs[0].send_signal(signal.SIGKILL)
        assert procs[1].wait(timeout=240) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        coord.close()
    first, second = loss_steps(tb, 0), loss_steps(tb, 1)
    assert second and second[-1] == 80, second
    assert max(first) < min(second), (first, second)
    assert (
        "logging metrics to tensorboard as the mesh's first member"
        in (tmp_path / "node1.log").read_text()
    )
