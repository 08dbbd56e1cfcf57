"""Stopping cleanly: SIGINT/SIGTERM ask the loop to stop after the current step."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from prime_train.placement import Placement


class StoppedEarly(BaseException):
    """A stop signal before the loop began (loading, or joining a running job: waiting,
    fetching, listening) or while the node rejoins it: this process holds nothing of its own
    to save (a rejoiner's last checkpoint stands; its state since is not the members'). A BaseException,
    as KeyboardInterrupt is: raised wherever the main thread is, it must not be taken for that
    code's own failure (a churn run found a listener's SIGTERM, landing in its all-reduce,
    counted as a failed all-reduce: the node joined again instead of exiting)."""


class StopSignal:
    """SIGINT/SIGTERM ask to stop after the current step; a second signal stops at once.
    With `at_once` (before the loop, when there is nothing to save) the first signal raises
    StoppedEarly where the main thread is, so the node leaves the mesh and exits cleanly."""

    def __init__(self, at_once: bool = False) -> None:
        self.signal: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.at_once = at_once
        self._during = "before training began"  # what StoppedEarly says the node was doing
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        self.received_at = time.monotonic()
        for sig in self._old:  # a second signal gets the default behaviour
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        if self.at_once:
            raise StoppedEarly(f"{self.signal} received {self._during}")

    @contextmanager
    def at_once_during(self, what: str) -> Iterator[None]:
        """Within: a stop signal, or one received already, raises StoppedEarly at once
        (`what`: the node's wait, for the message), as before the loop: a rejoin may listen
        for as long as the mesh's join_timeout, far past any stop bound."""
        if self.signal is not None:
            raise StoppedEarly(f"{self.signal} received {what}")
        at_once, during = self.at_once, self._during
        self.at_once, self._during = True, what
        try:
            yield
        finally:
            self.at_once, self._during = at_once, during

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
