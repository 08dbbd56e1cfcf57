"""Multi-rank saves on gloo, and resharding DTensor / FSDP2 state between world sizes."""

import subprocess
from pathlib import Path

import pytest

from prime_ckpt.manifest import read_manifest, verify_dir
from prime_testkit import free_port

WORKER = Path(__file__).with_name("dist_worker.py")


def run_phase(children, phase: str, world: int, root: Path) -> list[str]:
    port = free_port()
    procs = [
        children.python(
            [str(WORKER), phase, str(r), str(world), str(port), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, f"{phase} rank {r} failed:\n{out}"
        outs.append(out)
    return outs


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


def test_save_on_2_ranks_load_on_1(children, tmp_path):
    """W=2 commits one checkpoint; W=1 loads DTensor (uneven, empty shard) and FSDP2+AdamW
    state from it, into DTensors and into plain tensors; Shard(1) is refused by name."""
    run_phase(children, "save2", 2, tmp_path)
    check_save2(tmp_path)
    run_phase(children, "load1", 1, tmp_path)


@pytest.mark.slow
def test_save_on_2_ranks_load_on_1_and_back_on_2(children, tmp_path):
    run_phase(children, "save2", 2, tmp_path)
    check_save2(tmp_path)
    run_phase(children, "load1", 1, tmp_path)
    outs = run_phase(children, "load2", 2, tmp_path)
    # same world size: each rank restored step 3 and could use its own RAM copy
    assert all("copies of step 3: ['disk', 'ram']" in o for o in outs), outs
