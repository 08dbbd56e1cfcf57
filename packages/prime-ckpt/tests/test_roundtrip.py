"""Single-process saves and loads: round trips, strictness, staging reuse, retention."""

import pytest
import torch

from prime_ckpt import CheckpointManager, StateMismatch
from prime_ckpt.manifest import write_lease


def make_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model, opt, pos: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "data": {"pos": pos, "epoch": 2, "files": ["a.bin", "b.bin"], "ratio": 0.5},
        "rng": torch.get_rng_state(),
        "misc": {
            "flag": True,
            "none": None,
            "raw": b"\x00\x01",
            "bf16": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 5),
            "pair": (torch.ones(2), 7),
            "big_int": 2**60,
        },
    }


@pytest.fixture
def mgr(tmp_path):
    m = CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm")
    yield m
    m.close()


def assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def test_model_adamw_and_plain_values_round_trip(tmp_path):
    model, opt = make_model(0)
    for i in range(3):
        train_step(model, opt, i)
    saved = full_state(model, opt, pos=1234)
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm") as mgr:
        mgr.save(10, saved, metadata={"note": "hello"}).wait(timeout=60)
        listed = {c.tier: c.metadata for c in mgr.list()}
        assert listed == {"ram": {"note": "hello"}, "disk": {"note": "hello"}}

    # a fresh process-like restore: new model, AdamW state created by one step, then load
    model2, opt2 = make_model(1)
    train_step(model2, opt2, 99)
    target = full_state(model2, opt2, pos=0)
    target["data"] = {"pos": 0, "epoch": 0, "files": [], "ratio": 0.0}
    target["misc"]["pair"] = (torch.zeros(2), 0)
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "other-shm") as mgr:
        assert mgr.load_latest(target) == 10
        assert [c.tier for c in mgr.list()] == ["disk"]
    opt2.load_state_dict(target["optim"])
    assert_same(saved, target)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    # training continues identically from the restored state
    train_step(model, opt, 5)
    train_step(model2, opt2, 5)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_latest_none_when_empty(mgr):
    assert mgr.load_latest({"x": torch.zeros(1)}) is None
    assert mgr.list() == []


def test_unsupported_value_is_type_error_naming_key(mgr):
    with pytest.raises(TypeError, match=r"optim/sched/fn: builtins.function"):
        mgr.save(1, {"optim": {"sched": {"fn": lambda: 1}}})
    with pytest.raises(TypeError, match=r"arr: numpy.ndarray"):
        import numpy as np

        mgr.save(1, {"arr": np.zeros(3)})
    with pytest.raises(TypeError, match="dict keys must be str or int"):
        mgr.save(1, {"a": {(1, 2): 3}})
    assert mgr.list() == []  # nothing was staged


def test_strict_load_names_keys_shapes_dtypes(mgr):
    mgr.save(1, {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": 1, "sub": {"x": 1}}).wait(60)
    with pytest.raises(StateMismatch) as e:
        mgr.load_latest({"a": torch.zeros(2, 3), "sub": {"x": 0, "y": 2}, "c": 0})
    msg = str(e.value)
    assert "missing keys" in msg and "sub/y" in msg
    assert "unexpected keys" in msg and "b" in msg
    with pytest.raises(
        StateMismatch, match=r"a: checkpoint has shape \(2, 3\) float32, state has \(3, 2\)"
    ):
        mgr.load_latest({"a": torch.zeros(3, 2), "b": torch.zeros(4), "c": 0, "sub": {"x": 0}})
    with pytest.raises(
        StateMismatch, match=r"b: checkpoint has shape \(4,\) float32, state has \(4,\) float64"
    ):
        mgr.load_latest(
            {
                "a": torch.zeros(2, 3),
                "b": torch.zeros(4, dtype=torch.float64),
                "c": 0,
                "sub": {"x": 0},
            }
        )
    # nothing was modified by the failed loads
    state = {"a": torch.ones(2, 3), "sub": {"x": 5}}
    with pytest.raises(StateMismatch):
        mgr.load_latest(state)
    assert state["sub"]["x"] == 5 and torch.equal(state["a"], torch.ones(2, 3))
    # non-strict: loads what matches, adds what the state lacks
    assert mgr.load_latest(state, strict=False) == 1
    assert state["sub"]["x"] == 1 and torch.equal(state["a"], torch.zeros(2, 3))
    assert torch.equal(state["b"], torch.zeros(4)) and state["c"] == 1


def test_save_returns_while_training_keeps_stepping(mgr):
    model, opt = make_model(0)
    train_step(model, opt, 0)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    handle = mgr.save(1, {"model": model.state_dict()})
    for i in range(5):  # the background copy must hold the values at save() time
        train_step(model, opt, i + 1)
    handle.wait(timeout=60)
    assert not torch.equal(model[0].weight, snapshot["0.weight"])
    target = {"model": {k: torch.empty_like(v) for k, v in snapshot.items()}}
    assert mgr.load(1, target) == 1
    for k, v in snapshot.items():
        assert torch.equal(target["model"][k], v), k


def test_staging_buffers_reused_and_one_copy_in_flight(mgr):
    state = {"w": torch.randn(256, 256), "s": 0}
    h1 = mgr.save(1, state)
    bufs = {i: b.data_ptr() for i, (_, b) in mgr._stager._buffers.items()}
    h2 = mgr.save(2, state)
    assert h1.done(), "save() must wait for the previous disk copy"
    h3 = mgr.save(3, state)
    h4 = mgr.save(4, state)
    assert h2.done() and h3.done()
    mgr.wait(timeout=60)
    assert h4.done()
    assert len(mgr._stager._buffers) == 1  # one slot by default, allocated once
    assert {i: b.data_ptr() for i, (_, b) in mgr._stager._buffers.items()}.items() >= bufs.items()
    ram = [c.step for c in mgr.list() if c.tier == "ram"]
    assert ram == [4]  # at most one checkpoint in RAM
    state["w"] = torch.randn(10)  # a new layout reallocates
    mgr.save(5, state).wait(60)
    assert mgr.load_latest({"w": torch.empty(10), "s": 1}) == 5


def test_retention_per_tier_and_leases(tmp_path):
    d = tmp_path / "ckpt"
    with CheckpointManager(d, shm_dir=tmp_path / "shm", keep={"ram": 1, "disk": 2}) as mgr:
        for s in range(1, 4):
            mgr.save(s, {"x": torch.full((3,), float(s))}).wait(60)
        assert [(c.step, c.tier) for c in mgr.list()] == [(3, "ram"), (3, "disk"), (2, "disk")]
        write_lease(d, 2, 60)  # a peer is downloading step 2
        mgr.save(4, {"x": torch.full((3,), 4.0)}).wait(60)
        # the leased step counts toward keep: the newest and it stay, nothing beyond keep
        assert [c.step for c in mgr.list() if c.tier == "disk"] == [4, 2]
        write_lease(d, 2, -1)
        mgr.save(5, {"x": torch.full((3,), 5.0)}).wait(60)
        assert [c.step for c in mgr.list() if c.tier == "disk"] == [5, 4]
        x = {"x": torch.zeros(3)}
        assert mgr.load(4, x) == 4 and x["x"][0] == 4
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(d, keep={"ram": 3})


def test_close_frees_ram_only_when_durable(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm")
    mgr.save(1, {"x": torch.ones(4)}).wait(60)
    mgr.close()
    assert not (tmp_path / "shm").exists()
    with pytest.raises(Exception, match="closed"):
        mgr.save(2, {"x": torch.ones(4)})


def test_stale_shm_of_dead_run_cleaned(tmp_path, monkeypatch):
    import msgpack

    from prime_ckpt import staging

    monkeypatch.setattr(
        staging, "default_shm_dir", lambda d, r: tmp_path / "root" / f"prime-ckpt-me-r{r}"
    )
    dead = tmp_path / "root" / "prime-ckpt-dead-r0"
    dead.mkdir(parents=True)
    (dead / "owner.msgpack").write_bytes(
        msgpack.packb({"pid": 2**22 + 12345, "disk_dir": "/nonexistent/x"})
    )
    alive = tmp_path / "root" / "prime-ckpt-alive-r0"
    alive.mkdir()
    (alive / "owner.msgpack").write_bytes(
        msgpack.packb({"pid": 2**22 + 12345, "disk_dir": str(tmp_path)})
    )
    removed = staging.clean_stale(tmp_path / "root")
    assert removed == [dead] and alive.exists()


def test_ram_tier_holds_one_checkpoint_unless_told_two(tmp_path):
    """The default RAM tier is one slot (one checkpoint's bytes in /dev/shm); keep ram=2 keeps
    two."""
    state = {"w": torch.randn(1 << 16)}
    size = state["w"].numel() * 4

    def shm_bytes() -> int:
        return sum(f.stat().st_size for f in (tmp_path / "shm").rglob("*.bin"))

    with CheckpointManager(tmp_path / "a", shm_dir=tmp_path / "shm", keep={"ram": 2}) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state).wait(60)
        assert [c.step for c in mgr.list() if c.tier == "ram"] == [3, 2]
        assert shm_bytes() == 2 * size
    with CheckpointManager(tmp_path / "a", shm_dir=tmp_path / "shm") as mgr:
        for s in (4, 5):
            mgr.save(s, state).wait(60)
            assert shm_bytes() == size
        assert [c.step for c in mgr.list() if c.tier == "ram"] == [5]
