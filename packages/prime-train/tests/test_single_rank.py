"""A node of one rank trains a plain module (FSDP2 has nothing to shard there; several ranks
and CPU offload keep it), and checkpoints cross between the two layouts both ways: a run
checkpointed with FSDP2's DTensors resumes as plain tensors and the reverse, each reproducing
the uninterrupted run."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from prime_ckpt import CheckpointManager
from prime_ckpt.manifest import step_dirname
from prime_ckpt.reader import Source, read_tensor, tensor_paths
from prime_ckpt.state import is_dtensor
from prime_train import parallel
from prime_train.metrics import Log, read_metrics
from prime_train.placement import init_placement
from prime_train.run import Run
from prime_train.trainer import train


def test_one_rank_is_a_plain_module_and_cpu_offload_keeps_fsdp2(tiny):
    for offload, wrapped in (("false", False), ("true", True)):
        cfg = tiny("--train.cpu_offload", offload, "--run.name", f"offload-{offload}")
        placement = init_placement(cfg)
        run = Run(cfg, placement, Log(placement.prefix, primary=False))
        try:
            units = [m for m in run.model.modules() if isinstance(m, FSDPModule)]
            assert bool(units) is wrapped
            assert all(is_dtensor(p) is wrapped for p in run.model.parameters())
            assert run.model.autocast_dtype is None  # float32 on CPU
            run.inner_step(1)
        finally:
            run.close()
            placement.close()


def weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    src = Source.open("disk", run_dir / "ckpt" / step_dirname(step))
    return {p[1]: read_tensor(src, p) for p, _, _ in tensor_paths(src, ("model",))}


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("first", ["fsdp2", "plain"])
def test_checkpoints_resume_across_the_fsdp2_and_plain_layouts(tiny, monkeypatch, first):
    """Steps 1-6 in one layout (checkpoint at 6), the same run resumed at 6 in the other layout
    to step 12: the losses of steps 7-12 and the final weights equal the uninterrupted run's
    (plain throughout). `first = "fsdp2"` is a run folder made before this change, whose
    one-rank checkpoints hold DTensors."""
    common = ("--train.steps", "12", "--run.log_every", "1", "--eval.every", "0")
    straight = tiny(*common, "--run.name", "straight")
    train(straight)

    crossed = tiny(*common, "--run.name", "crossed", "--ckpt.every", "6")
    with monkeypatch.context() as m:
        m.setattr(parallel, "uses_fsdp", lambda mesh, cfg: first == "fsdp2")
        train(crossed)
    assert CheckpointManager(crossed.run_dir / "ckpt").discard_after(6) == [12]
    src = Source.open("disk", crossed.run_dir / "ckpt" / step_dirname(6))
    records = [r for r in src.meta(0)["tensors"] if r[0][0] == "model"]
    # a DTensor's record carries its global shape, a plain tensor's none
    assert all((r[3] is not None) is (first == "fsdp2") for r in records)
    with monkeypatch.context() as m:
        m.setattr(parallel, "uses_fsdp", lambda mesh, cfg: first != "fsdp2")
        train(crossed)  # resumes from the step-6 checkpoint of the other layout

    want, got = train_losses(straight.run_dir), train_losses(crossed.run_dir)
    assert sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(7, 13)] == [want[s] for s in range(7, 13)]
    a, b = weights(straight.run_dir, 12), weights(crossed.run_dir, 12)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
