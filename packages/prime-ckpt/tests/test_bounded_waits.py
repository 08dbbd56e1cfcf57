"""No wait of the manager is endless: a disk write that hangs (a FIFO nobody reads stands in
for a hung disk or NFS mount, blocking the writer for real) is given up on after
`disk_timeout`, and save(), wait(), discard_after() and close() return with a clear error."""

import os
import threading
import time

import pytest
import torch

from prime_ckpt import CheckpointError, CheckpointManager
from prime_ckpt.manifest import data_name

BOUND = 0.5  # disk_timeout in these tests


def returns(fn, *args):
    """Run `fn(*args)` on a thread; (returned, result or exception). The 60 s is a hang
    guard (the bound is BOUND), not a measurement."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    return not t.is_alive(), (box[0] if box else None)


def hang_disk_write(mgr: CheckpointManager, step: int):
    """Put a FIFO where the writer will write this rank's data file of `step`."""
    tmp = mgr._committer.tmp_dir(step)
    tmp.mkdir(parents=True)
    fifo = tmp / data_name(mgr.rank)
    os.mkfifo(fifo)
    return fifo


def release(mgr: CheckpointManager, fifo) -> None:
    """Let the stuck writer go: read the FIFO until the writer thread has ended."""
    deadline = time.monotonic() + 60
    try:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        fd = None
    try:
        while mgr._worker.is_alive() and time.monotonic() < deadline:
            try:
                if fd is not None:
                    os.read(fd, 1 << 20)
            except BlockingIOError:
                pass
            mgr._worker.join(0.05)
    finally:
        if fd is not None:
            os.close(fd)
    assert not mgr._worker.is_alive()


STATE = {"w": torch.ones(1 << 18)}  # 1 MiB: more than a pipe holds


def test_a_write_that_makes_no_progress_is_given_up_on(tmp_path):
    """The writer's own waits (the write thread's join, the chunk queue) are bounded."""
    mgr = CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm", disk_timeout=BOUND)
    fifo = hang_disk_write(mgr, 1)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, but never read: writes block
    try:
        h = mgr.save(1, STATE)
        done, _ = returns(mgr.close)
        assert done, "close() hung on a write that makes no progress"
        assert h.done() and "disk_timeout" in h.error and "older checkpoints are intact" in h.error
        assert mgr.errors == 1, mgr.failures()  # said and counted once, whichever bound fired
        assert mgr.committed_steps(["disk"]) == []
    finally:
        os.close(reader)  # the blocked write fails (EPIPE) and its thread ends
        release(mgr, fifo)


def test_save_wait_discard_and_close_return_when_the_disk_hangs(tmp_path):
    """A writer blocked in a system call (open() of a FIFO without a reader) cannot be
    interrupted: the callers' waits are bounded."""
    mgr = CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm", disk_timeout=BOUND)
    mgr.save(1, STATE).wait(60)
    fifo = hang_disk_write(mgr, 2)
    try:
        h2 = mgr.save(2, STATE)
        done, err = returns(mgr.wait)
        assert done and isinstance(err, CheckpointError), err
        assert "step 2 was not saved to disk: its write has not ended after 0.5 s" in str(err)
        assert "disk_timeout" in str(err) and h2.done()
        with pytest.raises(CheckpointError, match="has not ended"):
            h2.wait()
        # the writer still holds the staging slot: step 3 is refused, not torn
        done, h3 = returns(mgr.save, 3, {"w": torch.full((1 << 18,), 3.0)})
        assert done and "step 3 was not saved: the disk write of step 2 has not ended" in h3.error
        done, err = returns(mgr.discard_after, 1)
        assert done and isinstance(err, CheckpointError) and "cannot remove" in str(err)
        done, _ = returns(mgr.close)
        assert done, "close() hung on a disk write"
        assert mgr.errors == 2 and [f.step for f in mgr.failures()] == [2, 3]
        assert mgr.committed_steps(["disk"]) == [1]
    finally:
        release(mgr, fifo)
    with CheckpointManager(tmp_path / "ckpt", shm_dir=tmp_path / "shm2") as again:
        target = {"w": torch.zeros(1 << 18)}
        assert again.load_latest(target) == 1 and target["w"][0] == 1.0
