"""Fault hooks for tests: the one place where prime-train reads them, all from the environment.

Each hook is off unless its variable is set in a node's environment (a test sets it for the
node it wants to misbehave); production code calls the hooks below and never reads the
environment itself.

| variable | effect |
| --- | --- |
| `PRIME_TRAIN_FAULT_HOLD_ROUND_S` | with `overlap = "delayed"`, every background outer round waits this many seconds between its sync point and its all-reduce, so that a test can kill or stop a node while a round is in flight |
| `PRIME_TRAIN_FAULT_STALL_AT_STEP`, `PRIME_TRAIN_FAULT_STALL_S`, `PRIME_TRAIN_FAULT_STALL_UNTIL` | before inner step K, the training thread blocks, once, for S seconds or until the file PATH exists, whichever comes first, while the mesh's heartbeat thread goes on: a node stuck but alive, which only the sync timeout leaves out |
| `PRIME_TRAIN_FAULT_STALL_AFTER_VOTE` | with `PRIME_TRAIN_FAULT_STALL_S` (and `_UNTIL`): once the commit vote of outer step N has passed, the training thread blocks, once, before it records the round: the others may leave the node out meanwhile, and it learns of that eviction only after its round committed |
| `PRIME_TRAIN_FAULT_SLOW_FACTOR` | every inner step takes about N times as long (the training thread sleeps N - 1 times the step's own time after it): a node on a slower machine |
| `PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S` | a joiner waits this many seconds before its first `ready()`, so that a test can stop it before it is admitted |
| `PRIME_TRAIN_FAULT_LISTENER_ROUND_FAILS` | a listener's Nth round after the one that admitted it: its all-reduce counts as failed on it alone, and its ballot goes out 1 s late, once per process: the members, who do not wait for a listener's ballot, commit without it, and it learns that it lacks the round's update |
| `PRIME_TRAIN_FAULT_PERTURB_OUTER_AT` | once this node applied outer step N, it adds 0.001 to the first of its outer weights, once per process, before it hashes them: a node whose weights silently differ from the others' |
| `PRIME_TRAIN_FAULT_NAN_AT` | the pseudo-gradient this node computes for outer step N holds a NaN, once per process: a node whose numbers went bad |
| `PRIME_TRAIN_FAULT_SCALE_AT` | the pseudo-gradient this node computes for outer step N is multiplied by 1000, once per process: finite numbers far outside the others' |
"""

from __future__ import annotations

import os
import time

import torch

from prime_train.metrics import Log

HOLD_ROUND_ENV = "PRIME_TRAIN_FAULT_HOLD_ROUND_S"


def _seconds(name: str) -> float:
    return float(os.environ.get(name, "0") or 0)


HOLD_ROUND_S = _seconds(HOLD_ROUND_ENV)  # read once, when the trainer starts
STALL_AT_STEP_ENV, STALL_S_ENV = "PRIME_TRAIN_FAULT_STALL_AT_STEP", "PRIME_TRAIN_FAULT_STALL_S"
STALL_UNTIL_ENV = "PRIME_TRAIN_FAULT_STALL_UNTIL"
_stall = [int(_seconds(STALL_AT_STEP_ENV)), _seconds(STALL_S_ENV)]  # [step, seconds]: once
STALL_AFTER_VOTE_ENV = "PRIME_TRAIN_FAULT_STALL_AFTER_VOTE"
_stall_after_vote = [int(_seconds(STALL_AFTER_VOTE_ENV)), _seconds(STALL_S_ENV)]
SLOW_FACTOR_ENV = "PRIME_TRAIN_FAULT_SLOW_FACTOR"
SLOW_FACTOR = _seconds(SLOW_FACTOR_ENV)
JOIN_READY_DELAY_ENV = "PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S"
_join_ready_delay = [_seconds(JOIN_READY_DELAY_ENV)]  # used up by the first join


def hold_outer_round(step: int, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_HOLD_ROUND_S`: keep the outer round of `step` in flight a while."""
    if HOLD_ROUND_S:
        if log is not None:
            log.info(f"holding the outer round of step {step} for {HOLD_ROUND_S:g} s")
        time.sleep(HOLD_ROUND_S)


def stall_training(step: int, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_STALL_AT_STEP`: block the training thread before inner step `step`
    (the first time it comes) for `PRIME_TRAIN_FAULT_STALL_S` seconds, or until the file
    `PRIME_TRAIN_FAULT_STALL_UNTIL` exists. A sleep releases the GIL, so heartbeats go on:
    the node looks alive to the coordinator."""
    at, seconds = _stall
    if at and seconds and step == at:
        _stall[1] = 0.0
        _block(seconds, f"before step {step}", log)


def stall_after_vote(outer_step: int, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_STALL_AFTER_VOTE`: block the training thread once the vote of outer
    step `outer_step` passed, before the round is recorded (as `stall_training`, once)."""
    at, seconds = _stall_after_vote
    if at and seconds and outer_step == at:
        _stall_after_vote[1] = 0.0
        _block(seconds, f"after the vote of outer step {outer_step}", log)


def _block(seconds: float, where: str, log: Log | None) -> None:
    until = os.environ.get(STALL_UNTIL_ENV)
    if log is not None:
        log.info(f"fault hook: blocking the training thread {where} for {seconds:g} s")
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until and os.path.exists(until)):
        time.sleep(0.1)
    if log is not None:
        log.info(f"fault hook: the training thread goes on ({where})")


def slow_inner_step(seconds: float) -> None:
    """`PRIME_TRAIN_FAULT_SLOW_FACTOR` = N: after an inner step that took `seconds`, sleep
    (N - 1) x `seconds`, so the node trains at about 1/N of its speed."""
    if SLOW_FACTOR > 1:
        time.sleep((SLOW_FACTOR - 1) * seconds)


def delay_first_ready(log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S`: the first join of this process says `ready()`
    that much later (it is then admitted a round late)."""
    delay, _join_ready_delay[0] = _join_ready_delay[0], 0.0
    if delay:
        if log is not None:
            log.info(f"holding ready() for {delay:g} s")
        time.sleep(delay)


LISTENER_ROUND_FAILS_ENV = "PRIME_TRAIN_FAULT_LISTENER_ROUND_FAILS"
_listener_rounds = [int(_seconds(LISTENER_ROUND_FAILS_ENV)), 0]  # [the round, rounds seen]


def listener_round_fails(log: Log | None) -> str | None:
    """`PRIME_TRAIN_FAULT_LISTENER_ROUND_FAILS`: called by a listener before each vote; at its
    Nth round (once) wait 1 s and return the error its all-reduce is taken to have had."""
    at, seen = _listener_rounds
    if not at:
        return None
    _listener_rounds[1] = seen = seen + 1
    if seen != at:
        return None
    _listener_rounds[0] = 0
    if log is not None:
        log.info(f"fault hook: this listener's round {seen} fails here; its ballot goes late")
    time.sleep(1.0)
    return "fault hook: the listener's all-reduce failed"


PERTURB_OUTER_ENV = "PRIME_TRAIN_FAULT_PERTURB_OUTER_AT"
_perturb_outer = [int(_seconds(PERTURB_OUTER_ENV))]  # the outer step: once
NAN_AT_ENV = "PRIME_TRAIN_FAULT_NAN_AT"
_nan_at = [int(_seconds(NAN_AT_ENV))]  # the outer step: once
SCALE_AT_ENV = "PRIME_TRAIN_FAULT_SCALE_AT"
_scale_at = [int(_seconds(SCALE_AT_ENV))]  # the outer step: once


def perturb_outer(outer_step: int, weights: torch.Tensor, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_PERTURB_OUTER_AT`: once outer step `outer_step` is applied, move the
    first outer weight by 0.001 (once): this node's weights now differ from the others'."""
    if not _perturb_outer[0] or outer_step != _perturb_outer[0] or not weights.numel():
        return
    _perturb_outer[0] = 0
    weights[0] += 0.001
    if log is not None:
        log.info(f"fault hook: perturbed this node's outer weights at outer step {outer_step}")


def poison_pseudo_gradient(outer_step: int, pseudo_gradient: torch.Tensor, log: Log | None) -> None:
    """`PRIME_TRAIN_FAULT_NAN_AT`: the pseudo-gradient for outer step `outer_step` gets a NaN
    (once); `PRIME_TRAIN_FAULT_SCALE_AT`: it is multiplied by 1000 (once)."""
    if _scale_at[0] and outer_step == _scale_at[0]:
        _scale_at[0] = 0
        pseudo_gradient.mul_(1000.0)
        if log is not None:
            log.info(f"fault hook: pseudo-gradient x 1000 at outer step {outer_step}")
    if not _nan_at[0] or outer_step != _nan_at[0] or not pseudo_gradient.numel():
        return
    _nan_at[0] = 0
    pseudo_gradient[0] = float("nan")
    if log is not None:
        log.info(f"fault hook: a NaN in this node's pseudo-gradient for outer step {outer_step}")
