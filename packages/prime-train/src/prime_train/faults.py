"""Fault hooks for tests: the one place where prime-train reads them, all from the environment.

Each hook is off unless its variable is set in a node's environment (a test sets it for the
node it wants to misbehave); production code calls the hooks below and never reads the
environment itself.

| variable | effect |
| --- | --- |
| `PRIME_TRAIN_FAULT_HOLD_ROUND_S` | with `overlap = "delayed"`, every background outer round waits this many seconds between its sync point and its all-reduce, so that a test can kill or stop a node while a round is in flight |
| `PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S` | a joiner that caught up waits this many seconds before its first `ready()`, so that the members commit meanwhile and it is admitted late |
"""

from __future__ import annotations

import os
import time

from prime_train.metrics import Log

HOLD_ROUND_ENV = "PRIME_TRAIN_FAULT_HOLD_ROUND_S"


def _seconds(name: str) -> float:
    return float(os.environ.get(name, "0") or 0)


HOLD_ROUND_S = _seconds(HOLD_ROUND_ENV)  # read once, when the trainer starts
JOIN_READY_DELAY_ENV = "PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S"
_join_ready_delay = [_seconds(JOIN_READY_DELAY_ENV)]  # used up by the first join


def hold_outer_round(step: int, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_HOLD_ROUND_S`: keep the outer round of `step` in flight a while."""
    if HOLD_ROUND_S:
        if log is not None:
            log.info(f"holding the outer round of step {step} for {HOLD_ROUND_S:g} s")
        time.sleep(HOLD_ROUND_S)


def delay_first_ready(log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S`: the first join of this process says `ready()`
    that much later (it is then admitted a round late)."""
    delay, _join_ready_delay[0] = _join_ready_delay[0], 0.0
    if delay:
        if log is not None:
            log.info(f"holding ready() for {delay:g} s")
        time.sleep(delay)
