"""Multi-rank saves on gloo, and resharding DTensor / FSDP2 state between world sizes."""

from pathlib import Path

import pytest

from prime_ckpt.manifest import read_manifest, verify_dir

WORKER = Path(__file__).with_name("dist_worker.py")


def run_phase(pool, phase: str, world: int, root: Path) -> list[dict]:
    """Run dist_worker's `phase_<phase>` on ranks 0..world-1 of the session's rank pool."""
    return pool.run((WORKER, f"phase_{phase}"), world, root=str(root), timeout=180)


def check_save2(root: Path) -> None:
    m = read_manifest(root / "dt" / "step-0000000003")
    assert m.world_size == 2
    assert sorted(m.files) == [
        "rank-00000.bin",
        "rank-00000.meta",
        "rank-00001.bin",
        "rank-00001.meta",
    ]
    assert verify_dir(root / "dt" / "step-0000000003") == []
    assert not [p for p in (root / "dt").iterdir() if p.name.startswith(".tmp")]


def test_save_on_2_ranks_load_on_1(rank_pool, tmp_path):
    """W=2 commits one checkpoint; W=1 loads DTensor (uneven, empty shard) and FSDP2+AdamW
    state from it, into DTensors and into plain tensors; Shard(1) is refused by name."""
    run_phase(rank_pool, "save2", 2, tmp_path)
    check_save2(tmp_path)
    check_export(tmp_path)
    run_phase(rank_pool, "load1", 1, tmp_path)


def check_export(root: Path) -> None:
    """`prime-ckpt export` assembles the shards of both ranks into whole tensors."""
    import importlib.util

    import torch

    from prime_ckpt.cli import main

    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    out = root / "dt.pt"
    assert main(["export", str(root / "dt"), "--out", str(out)]) == 0
    full = torch.load(out, weights_only=True)
    assert torch.equal(full["w"], worker.full("w", 3))
    assert torch.equal(full["tiny"], worker.full("tiny", 3))
    assert torch.equal(full["nested"]["big"], worker.full("big", 3))
    assert full["count"] == 30


@pytest.mark.slow
def test_save_on_2_ranks_load_on_1_and_back_on_2(rank_pool, tmp_path):
    run_phase(rank_pool, "save2", 2, tmp_path)
    check_save2(tmp_path)
    run_phase(rank_pool, "load1", 1, tmp_path)
    outs = run_phase(rank_pool, "load2", 2, tmp_path)
    # same world size: each rank restored step 3 and could use its own RAM copy
    assert [o["copies"] for o in outs] == [["disk", "ram"]] * 2, outs


@pytest.mark.slow
def test_one_rank_failing_aborts_the_commit_and_keeps_older(rank_pool, tmp_path):
    outs = run_phase(rank_pool, "fail2", 2, tmp_path)
    assert "No space left" in outs[1]["failed"], outs
    assert "rank 1 failed to write its shard" in outs[0]["failed"], outs
    d = tmp_path / "fail"
    assert sorted(p.name for p in d.iterdir()) == ["step-0000000001", "step-0000000003"]
    for s in ("step-0000000001", "step-0000000003"):
        assert verify_dir(d / s) == []
