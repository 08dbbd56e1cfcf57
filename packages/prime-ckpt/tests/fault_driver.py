"""Crash a saving process at each named fault point, and at random times.

    python fault_driver.py ROOT POINT[,POINT...] RANDOM_KILLS

For each point a forked child saves step 1, waits until it is durable, then saves step 2 with
PRIME_CKPT_FAULT=POINT@2 and is SIGKILLed there. For random kills a child saves steps 1, 2, ...
in a loop and is SIGKILLed after a random delay. Prints one JSON line per child; the test
then restores from each folder.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.faults import ENV
from prime_train.lifetime import die_with_parent


def state(step: int) -> dict:
    return {
        "w": torch.full((64, 1024), float(step)),
        "b": torch.arange(1000) * step,
        "step": step,
    }


def fork(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            die_with_parent()
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


def fault_child(root: Path, point: str) -> None:
    mgr = CheckpointManager(root / "disk", shm_dir=root / "shm", keep={"disk": 1})
    mgr.save(1, state(1)).wait(60)
    os.environ[ENV] = f"{point}@2"
    mgr.save(2, state(2)).wait(60)


def loop_child(root: Path) -> None:
    mgr = CheckpointManager(root / "disk", shm_dir=root / "shm", keep={"disk": 2})
    step = 1
    while True:
        mgr.save(step, state(step))
        step += 1


def main() -> None:
    root, points, kills = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for point in [p for p in points.split(",") if p]:
        pid = fork(lambda p=point: fault_child(root / p, p))
        _, status = os.waitpid(pid, 0)
        print(
            json.dumps(
                {"case": point, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
            )
        )
    rng = random.Random()
    for i in range(kills):
        pid = fork(lambda i=i: loop_child(root / f"random{i}"))
        delay = rng.uniform(0.3, 1.5)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"case": f"random{i}", "signal": os.WTERMSIG(status), "delay": delay}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
