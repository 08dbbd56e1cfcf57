"""Stopping cleanly: SIGINT/SIGTERM ask the loop to stop after the current step."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from prime_train.placement import Placement


class StoppedEarly(BaseException):
    """A stop signal before the loop began (loading, or joining a running job: waiting,
    fetching, listening): this process holds nothing of its own to save yet. A BaseException,
    as KeyboardInterrupt is: raised wherever the main thread is, it must not be taken for that
    code's own failure (a churn run found a listener's SIGTERM, landing in its all-reduce,
    counted as a failed all-reduce: the node joined again instead of exiting)."""


class StopSignal:
    """SIGINT/SIGTERM ask to stop after the current step; a second signal stops at once.
    With `at_once` (before the loop, when there is nothing to save) the first signal raises
    StoppedEarly where the main thread is, so the node leaves the mesh and exits cleanly."""

    def __init__(self, at_once: bool = False) -> None:
        self.signal: str | None = None
        self.at_once = at_once
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        for sig in self._old:  # a second signal gets the default behaviour
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        if self.at_once:
            raise StoppedEarly(f"{self.signal} received before training began")

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def agreed(self, placement: Placement) -> bool:
        """True on every rank of the node once any rank was signalled."""
        if placement.world_size == 1:
            return self.signal is not None
        flag = torch.tensor([1.0 if self.signal else 0.0], device=placement.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=placement.group)
        return bool(flag.item() > 0)
