"""A 2-node DiLoCo run with its remote tier on a real S3 API (moto's server) survives losing
both machines: each node uploads under its own prefix (`ckpt.remote/NODE_NAME`), both nodes'
folders are wiped (new machines, empty disks) and the same commands resume from S3 at the
newest step any node holds (both hold it here), reproducing the uninterrupted run (weights, data position).

Each node runs the real CLI in its own working folder, as on its own machine: no launcher
variables, the node's index among the nodes comes from the mesh (registration order).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    CREDENTIALS,
    MotoS3,
    debug_args,
    folder_metrics,
    outer_hashes,
    trace,
    wait_until,
)

TOKEN = "remote-resume-test-token"
ARGS = [
    "--data.path", "{stdlib}/[a-c]*.py",
    "--data.seq_len", "64",
    "--train.batch_size", "4",
    "--train.steps", "60",
    "--diloco.inner_steps", "20",
    "--ckpt.every", "20",
    "--ckpt.keep", "2",
    "--eval.every", "20",
    "--run.log_every", "10",
]  # fmt: skip


def node_folder(phase: Path, k: int) -> Path:
    return phase / f"machine{k}"


def run_two_nodes(children, phase: Path, cache: Path, extra: list[str], stop_after_outer=None):
    """Node k runs in `phase/machine{k}` (its runs folder and RAM tier there) and is named
    `node-k`; returns both exit codes and logs."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    procs, logs = [], []
    try:
        for k in range(2):
            home = node_folder(phase, k)
            home.mkdir(parents=True, exist_ok=True)
            env = {
                key: v for key, v in os.environ.items() if not key.startswith(("PRIME_", "AWS_"))
            }
            env.update(CREDENTIALS, PRIME_TOKEN=TOKEN, OMP_NUM_THREADS="1",
                       PRIME_MESH__HEARTBEAT_INTERVAL_S="0.5", PRIME_MESH__HEARTBEAT_TIMEOUT_S="5")  # fmt: skip
            argv = [
                sys.executable, "-m", "prime_train.cli", *debug_args(home / "runs", cache, *ARGS),
                "--ckpt.shm_dir", str(home / "shm"),
                "--mesh.coordinator", coord.address, "--mesh.host", "127.0.0.1",
                "--mesh.node_name", f"node-{k}", *extra,
            ]  # fmt: skip
            logs.append(home / "node.log")
            with open(logs[-1], "a") as out:
                procs.append(
                    children.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=home)
                )
            # one registration at a time: node k gets index k (its data part) every time
            wait_until(lambda n=k: len(coord.status()["nodes"]) > n or procs[n].poll() is not None,
                       120, what=f"node {k} to register")  # fmt: skip
        if stop_after_outer is not None:
            # SIGTERM mid-round: once the outer step is committed and both nodes have logged a
            # step past it (a signal while a node is still at that boundary stops it there)
            def both_past_the_outer_step() -> bool:
                rows = [folder_metrics(node_folder(phase, k)) for k in range(2)]
                return all(
                    any(r.get("outer_step") == stop_after_outer for r in node_rows)
                    and any(r["step"] > stop_after_outer * 20 for r in node_rows)
                    for node_rows in rows
                )

            wait_until(
                lambda: both_past_the_outer_step() or any(p.poll() is not None for p in procs),
                200,
                what="both nodes past the outer step to stop after",
            )
            for p in procs:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        coord.close()
    return codes, [log.read_text() for log in logs]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_nodes_resume_from_s3_alone_after_both_disks_are_wiped(tmp_path, children):
    s3 = MotoS3(children)
    bucket = s3.bucket()
    # the endpoint as a storage option on the command line; credentials from the environment
    remote = ["--ckpt.remote", f"s3://{bucket}/run",
              "--ckpt.remote_options", f'{{endpoint_url = "{s3.endpoint}"}}']  # fmt: skip
    cache = tmp_path / "token-cache"

    full = tmp_path / "full"
    codes, logs = run_two_nodes(children, full, cache, [])
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]

    split = tmp_path / "split"
    codes, logs = run_two_nodes(children, split, cache, remote, stop_after_outer=1)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    stopped = max(r["step"] for r in folder_metrics(node_folder(split, 0)))
    assert stopped == 40, f"expected a stop at the next outer step, got {stopped}"
    keys = s3.keys(bucket)
    for k in range(2):  # each node under its own prefix, ckpt.keep = 2 steps there
        steps = {key.split("/")[2] for key in keys if key.startswith(f"run/node-{k}/")}
        assert steps == {"step-0000000020", "step-0000000040"}, keys
    assert all(key.startswith(("run/node-0/", "run/node-1/")) for key in keys), keys
    assert not any("remote_options" in json.loads(p.read_text()).get("ckpt", {}) or
                   s3.endpoint in p.read_text()
                   for p in split.rglob("config.json")), "the endpoint was saved"  # fmt: skip

    # neither node's upload of step 40 finished: both resume from step 20 (where only one
    # node lacked it, the other would resume from 40 and it would join: test_resume_newest.py)
    for k in range(2):
        s3.delete(bucket, f"run/node-{k}/step-0000000040/")
    shutil.rmtree(split)  # both machines lost: empty disks, empty RAM tiers
    codes, logs = run_two_nodes(children, split, cache, remote)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for k in range(2):
        assert "resumed from the step-20 checkpoint" in logs[k], logs[k][-3000:]
        # weights, optimizer, outer momentum and data position all restored: the resumed
        # run reproduces the uninterrupted one step for step
        resumed = trace(folder_metrics(node_folder(split, k)), after_step=0)
        reference = trace(folder_metrics(node_folder(full, k)), after_step=20)
        assert resumed == reference, (
            f"node {k}: {sorted(set(resumed.items()) ^ set(reference.items()))[:6]}"
        )
    outer = [outer_hashes(folder_metrics(node_folder(split, k))) for k in range(2)]
    assert sorted(outer[0]) == [2, 3] and outer[0] == outer[1], outer
    keys = s3.keys(bucket)
    for k in range(2):  # the newest steps uploaded again, still ckpt.keep = 2 per prefix
        steps = {key.split("/")[2] for key in keys if key.startswith(f"run/node-{k}/")}
        assert steps == {"step-0000000040", "step-0000000060"}, keys
