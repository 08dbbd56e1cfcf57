"""Multi-rank saves on gloo, and resharding DTensor / FSDP2 state between world sizes."""

import subprocess
import sys
from pathlib import Path

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


def test_save_on_2_ranks_load_on_1_and_back(children, tmp_path):
    run_phase(children, "save2", 2, tmp_path)
    m = read_manifest(tmp_path / "dt" / "step-0000000003")
    assert m.world_size == 2
    assert sorted(m.files) == [
        "rank-00000.bin",
        "rank-00000.meta",
        "rank-00001.bin",
        "rank-00001.meta",
    ]
    assert verify_dir(tmp_path / "dt" / "step-0000000003") == []
    assert not [p for p in (tmp_path / "dt").iterdir() if p.name.startswith(".tmp")]
    run_phase(children, "load1", 1, tmp_path)
    outs = run_phase(children, "load2", 2, tmp_path)
    # same world size: each rank restored step 3 and could use its own RAM copy
    assert all("copies of step 3: ['disk', 'ram']" in o for o in outs), outs


def test_unsupported_placement_is_a_clear_error(tmp_path):
    code = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from prime_ckpt import CheckpointManager
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
t = distribute_tensor(torch.zeros(2, 4), mesh, [Shard(1)])
mgr = CheckpointManager({str(tmp_path)!r}, shm_dir={str(tmp_path / "shm")!r})
try:
    mgr.save(1, {{"layer": {{"w": t}}}})
except TypeError as e:
    print("ERR", e)
mgr.close()
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR cannot checkpoint layer/w" in out.stdout and "Shard(0)" in out.stdout, out.stdout
