"""`save(..., stage_in_background=True)`: the copy into RAM is made by the writer thread, and
`save()` returns at once; the caller changes its tensors only after `wait_staged()`."""

import os
import threading

import pytest
import torch

from prime_ckpt import CheckpointError, CheckpointManager
from prime_testkit import small_state


class HeldStaging:
    """The manager's real stager, whose copies wait until `release()` (so a test sees the
    save return before its copy, without timing anything)."""

    def __init__(self, mgr: CheckpointManager):
        self.stager, self.gate, self.started = mgr._stager, threading.Event(), threading.Event()
        self._stage = self.stager.stage
        self.stager.stage = self.stage

    def stage(self, *args):
        self.started.set()
        assert self.gate.wait(60), "never released"
        return self._stage(*args)

    def release(self) -> None:
        self.gate.set()


def test_save_returns_before_the_copy_and_the_checkpoint_holds_the_values_at_save(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm") as mgr:
        held = HeldStaging(mgr)
        live = small_state(1.0)
        handle = mgr.save(1, live, stage_in_background=True)
        assert held.started.wait(60) and not handle.staged(0), "copied before save() returned"
        live["n"] = 4  # plain values were taken at save()
        held.release()
        mgr.wait_staged()
        assert handle.staged(0)
        live["w"].fill_(9.0)  # the caller's next change: after the copy
        live["opt"]["m"].fill_(9.0)
        handle.wait(60)
        target = small_state(0.0)
        assert mgr.load(1, target) == 1
        assert torch.equal(target["w"], small_state(1.0)["w"]) and target["n"] == 3
        assert torch.equal(target["opt"]["m"], small_state(1.0)["opt"]["m"])
        assert [(c.step, c.tier) for c in mgr.list()] == [(1, "ram"), (1, "disk")]


def test_a_wait_for_the_first_keys_returns_before_the_later_ones_are_copied(tmp_path):
    """`wait_staged(keys)`: the tensors are copied in the state's order, and a caller may
    change those under the first keys once they are, while the rest is still being copied
    (a trainer's optimizer step waits for the model and its own state only)."""
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm") as mgr:
        gate, paused = threading.Event(), threading.Event()
        stage = mgr._stager.stage

        def stage_pausing_after_w(step, items, total, meta, copied=None):
            def told(key: str) -> None:
                copied(key)
                if key == "w":  # the fill pauses here, "opt" not copied yet
                    paused.set()
                    assert gate.wait(60), "never released"

            return stage(step, items, total, meta, told)

        mgr._stager.stage = stage_pausing_after_w
        live = small_state(1.0)
        handle = mgr.save(1, live, stage_in_background=True)
        assert paused.wait(60)
        mgr.wait_staged(("w",))  # returns while the copy is paused
        assert not handle.staged(0) and not handle.staged(0, keys=("opt",))
        live["w"].fill_(9.0)  # the caller's change: "w" was copied before it
        gate.set()
        mgr.wait_staged()
        assert handle.staged(0, keys=("opt",))
        live["opt"]["m"].fill_(9.0)
        handle.wait(60)
        target = small_state(0.0)
        assert mgr.load(1, target) == 1
        assert torch.equal(target["w"], small_state(1.0)["w"])
        assert torch.equal(target["opt"]["m"], small_state(1.0)["opt"]["m"])


def test_a_load_waits_for_the_staging_it_would_write_under(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm") as mgr:
        mgr.save(1, small_state(1.0)).wait(60)
        held = HeldStaging(mgr)
        live = small_state(2.0)
        handle = mgr.save(2, live, stage_in_background=True)
        assert held.started.wait(60)
        loaded = []
        loader = threading.Thread(target=lambda: loaded.append(mgr.load(1, live)))
        loader.start()
        loader.join(0.5)
        assert loader.is_alive() and not loaded, "the load overwrote tensors being copied"
        held.release()
        loader.join(60)
        assert loaded == [1] and live["w"][0] == 1.0
        handle.wait(60)
        target = small_state(0.0)
        assert mgr.load(2, target) == 2 and target["w"][0] == 2.0  # step 2 as it was saved


def test_a_staging_past_the_bound_is_given_up_on_and_never_committed(tmp_path):
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm", disk_timeout=0.5) as mgr:
        mgr.save(1, small_state(1.0)).wait(60)
        held = HeldStaging(mgr)
        handle = mgr.save(2, small_state(2.0), stage_in_background=True)
        mgr.wait_staged()  # returns once the bound passed: the save is failed, not waited on
        assert handle.done() and "not saved to disk" in (handle.error or ""), handle.error
        assert mgr.errors == 1
        held.release()
        assert handle.ended(60)
        assert 2 not in mgr.committed_steps()  # its copy may be torn: never committed
        with pytest.raises(CheckpointError):
            handle.wait(0)
        mgr.save(3, small_state(3.0), stage_in_background=True).wait(60)  # and the next save works
        target = small_state(0.0)
        assert mgr.load_latest(target) == 3 and target["w"][0] == 3.0


def test_a_full_ram_tier_fails_the_background_save_without_raising(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as the RAM tier")
    small = tmp_path / "small"
    small.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {small}") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with CheckpointManager(tmp_path / "disk", shm_dir=small / "shm") as mgr:
            mgr.save(1, small_state(1.0)).wait(60)
            big = {"w": torch.zeros(1 << 19)}  # 2 MB into a 1 MiB RAM tier
            handle = mgr.save(2, {**small_state(2.0), **big}, stage_in_background=True)
            mgr.wait_staged()
            with pytest.raises(CheckpointError, match="staging step 2 .* No space left"):
                handle.wait(60)
            assert mgr.errors == 1 and mgr.committed_steps() == [1]
            target = small_state(0.0)
            assert mgr.load_latest(target) == 1 and target["w"][0] == 1.0
    finally:
        os.system(f"umount -l {small}")
