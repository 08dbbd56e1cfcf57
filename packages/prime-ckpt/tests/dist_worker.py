"""The ranks' side of test_distributed.py: phases run by the session's rank pool.

Each `phase_NAME(ctx, root)` runs on ranks 0..W-1 of the pool (prime_testkit.RankPool) in
`ctx.pg`, the subgroup of W ranks, and raises on any mismatch: save2 (W=2 saves DTensor and
FSDP2 state), load1 (W=1 loads both, saves its own), load2 (W=2 loads the W=1 checkpoint and
its own RAM copy), fail2 (W=2, one rank's disk full).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from prime_ckpt import CheckpointError, CheckpointManager, StateMismatch
from prime_ckpt.faults import ENV

ROWS = {"w": (5, 3), "tiny": (1, 4), "big": (6,), "rep": (2, 2)}


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randn(ROWS[name], generator=g)


def dstate(mesh, step: int | None) -> dict:
    """DTensor state: uneven rows (5 on 2 ranks), an empty shard (1 row), a replicated one."""

    def make(name, placements):
        t = full(name, step) if step is not None else torch.zeros(ROWS[name])
        return distribute_tensor(t, mesh, placements)

    return {
        "w": make("w", [Shard(0)]),
        "tiny": make("tiny", [Shard(0)]),
        "nested": {"big": make("big", [Shard(0)]), "rep": make("rep", [Replicate()])},
        "count": 0 if step is None else step * 10,
        "tags": [] if step is None else ["a", "b"],
    }


def check_dstate(state: dict, step: int) -> None:
    for name, t in [
        ("w", state["w"]),
        ("tiny", state["tiny"]),
        ("big", state["nested"]["big"]),
        ("rep", state["nested"]["rep"]),
    ]:
        got = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(got, full(name, step)), f"{name} differs after load"
    assert state["count"] == step * 10, state["count"]
    assert state["tags"] == ["a", "b"], state["tags"]


def fsdp_model(mesh, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    opt.step()  # creates the AdamW state (exp_avg, exp_avg_sq, step) that a load fills in
    opt.zero_grad()
    return model, opt


def fsdp_flat(model, opt) -> dict[str, np.ndarray]:
    out = {f"p.{k}": v.full_tensor().numpy() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"o.{pid}.{k}"] = v.numpy()
    return out


def phase_save2(ctx, root: str) -> dict:
    """W=2 saves DTensor state (while training collectives go on) and FSDP2 + AdamW state."""
    group, mesh, shm = setup(ctx, root, "save2")
    root = Path(root)
    # not closed: its RAM copies stay for phase load2, as after a crash
    mgr = CheckpointManager(root / "dt", shm_dir=shm, group=group)
    h = mgr.save(3, dstate(mesh, 3))
    t = torch.ones(1)
    for _ in range(20):  # training collectives while rank 0 commits in the background
        dist.all_reduce(t, group=group)
    h.wait(timeout=120)
    model, opt = fsdp_model(mesh, seed=0)
    # its own RAM folder: a manager holds one checkpoint in RAM, and a second manager on the
    # same folder takes it over (dt's step 3 must stay there for phase load2)
    with CheckpointManager(root / "fsdp", shm_dir=shm.with_name(shm.name + "-fsdp"),
                           group=group) as mgr:  # fmt: skip
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait(120)
    flat = fsdp_flat(model, opt)
    if ctx.rank == 0:
        np.savez(root / "fsdp_expected.npz", **flat)
    dist.barrier(group=group)
    return {}


def phase_load1(ctx, root: str) -> dict:
    """W=1 loads both checkpoints of save2, into DTensors and plain tensors, and saves its own."""
    group, mesh, shm = setup(ctx, root, "load1")
    root = Path(root)
    st = dstate(mesh, None)
    with CheckpointManager(root / "dt", shm_dir=shm, group=group) as mgr:
        assert mgr.load_latest(st) == 3
        check_dstate(st, 3)
        plain = {k: torch.zeros(ROWS[k]) for k in ("w", "tiny")}
        plain["nested"] = {"big": torch.zeros(6), "rep": torch.zeros(2, 2)}
        plain.update(count=0, tags=[])
        assert mgr.load(3, plain) == 3  # DTensor shards into plain tensors
        check_dstate(plain, 3)
        bad = dstate(mesh, None)
        bad["w"] = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
        try:
            mgr.load(3, bad)
            raise AssertionError("shape mismatch not detected")
        except StateMismatch as e:
            assert "w: checkpoint has shape (5, 3)" in str(e), e
    model, opt = fsdp_model(mesh, seed=123)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    # its own RAM folder: a manager holds one checkpoint in RAM, and a second manager on the
    # same folder takes it over (dt's step 3 must stay there for phase load2)
    with CheckpointManager(root / "fsdp", shm_dir=shm.with_name(shm.name + "-fsdp"),
                           group=group) as mgr:  # fmt: skip
        assert mgr.load_latest(sd) == 1
    opt.load_state_dict(sd["optim"])
    expected = np.load(root / "fsdp_expected.npz")
    got = fsdp_flat(model, opt)
    assert sorted(got) == sorted(expected.files), (sorted(got), expected.files)
    for k in expected.files:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    with CheckpointManager(root / "dt1", shm_dir=shm, group=group) as mgr:
        mgr.save(4, dstate(mesh, 4)).wait(120)
        try:
            mgr.save(5, {"layer": {"w": distribute_tensor(torch.zeros(2, 4), mesh, [Shard(1)])}})
            raise AssertionError("Shard(1) accepted")
        except TypeError as e:
            assert "cannot checkpoint layer/w" in str(e) and "Shard(0)" in str(e), e
    return {}


def phase_fail2(ctx, root: str) -> dict:
    """W=2 where only rank 1's disk fills up at step 2: the commit aborts on both ranks."""
    group, mesh, shm = setup(ctx, root, "fail2")
    root = Path(root)
    with CheckpointManager(root / "fail", shm_dir=shm, group=group) as mgr:
        mgr.save(1, dstate(mesh, 1)).wait(120)
        if ctx.rank == 1:
            os.environ[ENV] = "enospc@2"  # only rank 1's disk is full
        try:
            mgr.save(2, dstate(mesh, 2)).wait(120)
            raise AssertionError("step 2 committed although rank 1 failed")
        except CheckpointError as e:
            failed = str(e)
        finally:
            os.environ.pop(ENV, None)  # this process serves later tests
        mgr.save(3, dstate(mesh, 3)).wait(120)
        st = dstate(mesh, None)
        dist.barrier(group=group)
        assert mgr.load(1, st) == 1
        check_dstate(st, 1)
    dist.barrier(group=group)
    return {"failed": failed}


def phase_load2(ctx, root: str) -> dict:
    """W=2 loads the W=1 checkpoint, and step 3 of save2 with its own RAM copy at hand."""
    group, mesh, shm = setup(ctx, root, "load2")
    root = Path(root)
    st = dstate(mesh, None)
    with CheckpointManager(root / "dt1", shm_dir=shm, group=group) as mgr:
        assert mgr.load_latest(st) == 4
    check_dstate(st, 4)
    st = dstate(mesh, None)
    save2_shm = root / f"shm-save2-{ctx.rank}"
    with CheckpointManager(root / "dt", shm_dir=save2_shm, group=group) as mgr:
        copies = {c.tier for c in mgr.list() if c.step == 3}
        assert mgr.load_latest(st) == 3
    check_dstate(st, 3)
    dist.barrier(group=group)
    return {"copies": sorted(copies)}


def setup(ctx, root: str, phase: str):
    """The call's group, a 1-D CPU device mesh over it, and this rank's RAM folder."""
    torch.set_num_threads(1)
    mesh = DeviceMesh.from_group(ctx.pg, "cpu")
    return ctx.pg, mesh, Path(root) / f"shm-{phase}-{ctx.rank}"
