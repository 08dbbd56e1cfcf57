"""`[run] trackers`: the metrics rows in TensorBoard event files and an offline W&B run, with
the config as hyperparameters; only while the node is the mesh's first member."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from prime_train.config_load import load_config
from prime_train.metrics import Log
from prime_train.trackers import Trackers

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def read_wandb(path: Path) -> tuple[dict, list[dict]]:
    """The config and history rows of an offline W&B run file (a LevelDB-style log of
    protobuf records after a 7-byte header), read the way `wandb sync` does."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, buf, config, history = 7, 32768, b"", {}, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind not in (1, 4):  # FIRST or MIDDLE part of a record
            continue
        record = pb.Record()
        record.ParseFromString(buf)
        buf = b""
        if record.WhichOneof("record_type") == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif record.WhichOneof("record_type") == "history":
            history.append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }  # fmt: skip
            )
    return config, history


@pytest.mark.slow
def test_tensorboard_and_offline_wandb_through_the_cli(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_", "WANDB_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")  # no network: wandb sync uploads later
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", "--config", str(DEBUG),
         "--run.runs_dir", str(tmp_path), "--launch.local_nodes", "1", "--train.steps", "20",
         "--run.log_every", "5", "--eval.every", "10", "--run.trackers",
         '["tensorboard", "wandb"]'],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "logging metrics to tensorboard and wandb" in r.stdout
    run_dir = tmp_path / "debug"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tb = scalars(run_dir / "tensorboard")
    # the same rows as metrics.jsonl (TensorBoard keeps float32)
    f32 = [(r["step"], float(np.float32(r["loss"]))) for r in rows if "loss" in r]
    assert tb["loss"] == f32 and len(f32) == 4
    assert [s for s, _ in tb["eval_loss"]] == [0, 10, 20]
    assert [s for s, _ in tb["tokens_per_s"]] == [5, 10, 15, 20]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    hparams = acc.PluginTagToContent("hparams")  # the config, as hyperparameters
    assert b"train.steps" in b"".join(hparams.values())
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (wandb_file,) = offline.glob("run-*.wandb")
    config, history = read_wandb(wandb_file)
    assert config["train"]["steps"] == 20 and config["run"]["trackers"] == ["tensorboard", "wandb"]
    assert [(h["step"], h["loss"]) for h in history if "loss" in h] == [
        (r["step"], r["loss"]) for r in rows if "loss" in r
    ]
    assert [h["step"] for h in history if "eval_loss" in h] == [0, 10, 20]


def test_only_the_first_member_logs(tmp_path):
    cfg = load_config(str(DEBUG), ["--run.trackers", '["tensorboard"]'])
    leading = [False]
    sink = Trackers(cfg, tmp_path, lambda: leading[0], Log("[test]", True), node=1)
    sink.write({"step": 1, "loss": 3.0})  # not the first member: nothing opened or written
    assert not (tmp_path / "tensorboard").exists()
    leading[0] = True  # the first member left: this node leads now
    sink.write({"step": 2, "loss": 2.5, "outer_sha256": "ab", "time": 1.0})
    sink.close()
    assert scalars(tmp_path / "tensorboard") == {"loss": [(2, 2.5)]}
    (events,) = (tmp_path / "tensorboard").glob("events.*")
    assert events.name.endswith(".node1")


def test_reporting_follows_a_rejoined_nodes_new_registration(tmp_path):
    from types import SimpleNamespace as NS

    from prime_train.reporting import attach_reporting

    class Mesh:
        def __init__(self, rank):
            self.global_rank, self.reports = rank, []

        def report_progress(self, **numbers):
            self.reports.append(numbers)

    cfg = load_config(str(DEBUG), ["--run.trackers", '["tensorboard"]'])
    old, new = Mesh(1), Mesh(0)
    placement = NS(membership=NS(mesh=old), node=NS(index=1))
    run = NS(primary=True, placement=placement, metrics=NS(sinks=[]), run_dir=tmp_path,
             log=Log("[test]", True))  # fmt: skip
    attach_reporting(cfg, run)
    progress, trackers = run.metrics.sinks
    assert not trackers.leader()
    placement.membership = NS(mesh=new)  # `diloco/rejoin.py` swaps in the new registration
    assert trackers.leader(), "the rejoined node leads as rank 0 of its new epoch"
    progress.write({"step": 5})
    assert new.reports == [{"step": 5}] and old.reports == []


def test_mesh_progress_reports_rows_and_the_time_split():
    from prime_train.reporting import MeshProgress

    class Mesh:
        def __init__(self):
            self.reports = []

        def report_progress(self, **numbers):
            from prime_mesh.progress import validate_progress

            self.reports.append(validate_progress(numbers))

    now = [100.0]
    mesh = Mesh()
    sink = MeshProgress(lambda: mesh, clock=lambda: now[0])
    sink.write({"step": 10, "loss": float("nan"), "lr": 0.1, "tokens_per_s": 900.0, "time": 1.0,
                "ckpt_errors": 2})  # fmt: skip
    now[0] = 112.0
    sink.write({"step": 20, "outer_step": 1, "outer_seconds": 2.0, "allreduce_seconds": 0.5,
                "bytes_sent": 4096, "nodes": 2, "epoch": 1, "outer_sha256": "ab"})  # fmt: skip
    assert mesh.reports == [
        {"step": 10, "tokens_per_s": 900.0, "ckpt_errors": 2},  # not a nan loss, nor `lr`
        {"step": 20, "outer_step": 1, "outer_seconds": 2.0, "allreduce_seconds": 0.5,
         "bytes_sent": 4096, "compute_seconds": 10.0, "wait_seconds": 1.5},
    ]  # fmt: skip
