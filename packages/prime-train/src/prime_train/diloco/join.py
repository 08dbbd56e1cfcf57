"""Joining a running job through live checkpoint recovery, start to finish: register, fetch,
catch up, enter. A new node, one restarted after it died, and one rejoining by itself after it
lost its membership (`diloco/rejoin.py`) all take this path.

1. Register (`diloco.membership.register`, while the placement is built, before the model:
   the node's index comes from it): a node that finds live members registers *waiting*
   (`Membership.join`): the members never wait for it.
2. Every member keeps the committed updates of its last `diloco.replay_rounds` rounds (its
   update log, `diloco/replay_log.py`) and serves them beside its checkpoints; while a node
   waits, and at a round that admitted one, members also checkpoint at the outer boundary
   (the outer step's `joiners_waiting`).
3. DiLoCo with one fragment, synchronous or delayed (`listening`): the joiner says `ready()` at once and listens from the
   members' next sync point while its snapshot comes in the background (`listen.admit_first`,
   `diloco/listen.py`); steps 3-4 below are then the listener's, done in the background and
   at the round its snapshot is in. Otherwise (fragments > 1, or catching up again after a
   failed listen): fetch (`fetch_members_state`, on the node's local rank 0): the joiner fetches a donor's
   newest checkpoint (`prime_ckpt.fetch_from_peer`: verified, resumable, under the donor's
   serving cap) at its own pace, however many rounds that takes, into its own checkpoint
   folder (nothing is removed before it verifies). Meanwhile it holds the donors' log entries
   (`catch_up.Holder`) so the ones it will need are not pruned.
4. Load (`load_members_state`): every local rank loads the checkpoint; a joiner that listens
   then says `ready()` at once (the rounds since come in step 5). Another first replays
   the members' committed updates since it (`catch_up`), each checked against the members'
   outer weights' hash, until the donors offer no newer one. A log that no longer reaches the
   checkpoint, or a hash that differs, takes a newer checkpoint (a second mismatch exits with
   a line naming it).
5. Enter (`enter_running_job`): the members admit it at their next sync point. The joiner takes
   its first round at once (the outer step's `enter`), contributing nothing; the members average over the nodes that
   contributed, and all apply the same update to the same outer weights: the same bits
   everywhere. A listener (admitted before its snapshot, or late after loading one) stays a
   member contributing nothing (`diloco/listen.py`, the outer step's `listen_late`): it keeps
   each round's update while its snapshot and backlog come in the background, then replays
   them and enters with the members' outer weights; the members never wait for its transfer. A
   joiner that cannot listen (fragments > 1) instead replays the rounds it missed at once, as a member, and takes the round with
   them (`log_replay.replay_in_place`, the outer step's `late_catch_up`). If either cannot, it leaves,
   registers again, replays the rounds since and asks again (`JoinedLate` only after
   `MAX_LATE` such tries).

What happened is one typed record, `JoinRecord`, logged and written as the entry's metrics row.
The snapshot's fetch is `diloco/snapshot.py`; fetching and holding log entries, `catch_up.py`.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from prime_mesh import CoordinatorLost, MeshEvicted
from prime_train import faults
from prime_train.diloco.catch_up import (
    Holder,
    on_primary,
)
from prime_train.diloco.late_joiner import JoinedLate
from prime_train.diloco.listen import Listener, admit_first
from prime_train.diloco.log_replay import catch_up, listening, replay_in_place, replaying
from prime_train.diloco.register_again import register_again
from prime_train.diloco.snapshot import (
    JOIN_TIMEOUT_S,
    Background,
    JoinRecord,
    fetch_members_state,
    load_state,
    shared_tensors,
)
from prime_train.seam import ElasticOuterStep, OuterStepReport

if TYPE_CHECKING:
    from prime_train.run import Run

MAX_LATE = 10  # admissions a round too late (then catching up again) before giving up
LOADED_AT = time.monotonic()  # about when the process started (the trainer imports this early)


def load_members_state(
    run: Run, outer: ElasticOuterStep, rejoined: int | None = None
) -> JoinRecord:
    """Steps 3 and 4: fetch a member's checkpoint into this node's folder, load it (every
    local rank), replay the committed updates since, then say `ready()`. `rejoined`: the
    count, for a rejoin by itself. A node evicted before it was admitted (stalled or cut off
    past the heartbeat timeout while it fetched or waited) registers again and starts over,
    at most `MAX_LATE` times."""
    for tries in range(1, MAX_LATE + 2):
        try:
            return _load_members_state(run, outer, rejoined)
        except (MeshEvicted, CoordinatorLost) as e:
            if tries > MAX_LATE:
                raise
            run.log.warn(
                f"lost its place before it was admitted ({type(e).__name__}: {e}); "
                f"registering again and joining again ({tries} of at most {MAX_LATE})"
            )
            membership = run.placement.membership
            assert membership is not None
            membership.close()
            membership = register_again(run, e)
            run.placement.membership = membership
            outer.reattach(membership.mesh)
    raise AssertionError("unreachable")


def _load_members_state(run: Run, outer: ElasticOuterStep, rejoined: int | None) -> JoinRecord:
    membership = run.placement.membership
    assert membership is not None and membership.joining
    if listening(outer) and not faults.waits_after_snapshot():
        return admit_first(run, outer, rejoined)
    replay = replaying(outer)
    holder = Holder(membership) if replay and run.primary else None
    with contextlib.ExitStack() as stack:
        if holder is not None:
            stack.enter_context(holder)
        record: JoinRecord = on_primary(
            run,
            lambda: fetch_members_state(
                membership,
                run.ckpt_dir,
                run.log,
                fresh=not replay,
                shared=shared_tensors(run.cfg.diloco.overlap),
            ),
        )
        record.rejoined = rejoined
        load_state(run, outer, record)
        if replay:
            faults.wait_after_snapshot(run.log, holder, outer.outer_steps)  # type: ignore[attr-defined]
        if replay and not listening(outer):  # (a listener fetches them while it listens)
            catch_up(run, outer, record, holder)
        if listening(outer):  # a listener's backlog stays pinned (`enter_running_job` ends it)
            record.holder = holder
            stack.pop_all()
    run.progress["step"] = record.step
    faults.delay_first_ready(run.log)
    membership.mesh.ready()
    mbps = record.bytes / 1e6 / record.seconds if record.seconds else float("inf")
    run.log.info(
        f"fetched the step-{record.snapshot_step} checkpoint from {record.donor}: "
        f"{record.bytes / 1e6:.2f} MB in {record.seconds:.2f} s ({mbps:.1f} MB/s), "
        f"loaded in {record.load_seconds:.2f} s"
        + (
            f"; replayed {record.replayed} committed update(s) to step {record.step} "
            f"({record.replay_bytes / 1e6:.2f} MB from {record.replay_donors}) in "
            f"{record.replay_seconds:.2f} s"
            if replay
            else ""
        )
        + "; ready, admitted at the members' next outer step"
    )
    return record


def _catch_up_again(
    run: Run, outer: ElasticOuterStep, record: JoinRecord, late: BaseException
) -> None:
    """Admitted a round late (or sent away by a restarted coordinator): leave, register again
    (waiting), replay the rounds since, and say ready again. The members committed without
    waiting; this node's state is unchanged."""
    membership = run.placement.membership
    assert membership is not None
    membership.close()
    record.pending = None  # (a listener whose snapshot never came: it takes a newer one)
    membership = register_again(run, late)
    run.placement.membership = membership
    outer.reattach(membership.mesh)
    _end_hold(record)
    holder = Holder(membership) if run.primary else None
    with contextlib.ExitStack() as stack:
        if holder is not None:
            stack.enter_context(holder)
        catch_up(run, outer, record, holder, need=outer.outer_steps + 1)  # type: ignore[attr-defined]
        if listening(outer):
            record.holder = holder
            stack.pop_all()
    run.progress["step"] = record.step
    membership.mesh.ready()


def _listen_again(
    run: Run, outer: ElasticOuterStep, record: JoinRecord, lost: BaseException
) -> JoinRecord:
    """A listener without state yet, sent away (a restarted coordinator re-formed the run
    without it): register again and listen again from the members' next sync point, with a
    new snapshot in the background. Its timeline keeps its first start."""
    membership = run.placement.membership
    assert membership is not None
    membership.close()
    record.pending = None
    _end_hold(record)
    membership = register_again(run, lost)
    run.placement.membership = membership
    outer.reattach(membership.mesh)
    again = admit_first(run, outer, record.rejoined)
    again.started, again.late = record.started, record.late
    return again


def _stop_listening(outer: ElasticOuterStep, record: JoinRecord) -> None:
    """A listener that lost its place: it keeps nothing of what it listened to; a snapshot
    still under way (local rank 0) ends first (bounded by its own timeouts), so that no
    fetch writes into its folder while it catches up again."""
    listener = getattr(outer, "listener", None)
    if listener is not None:
        listener.close()
    outer.listen_first = False  # type: ignore[attr-defined]
    pending = record.pending
    if isinstance(pending, Background):
        pending.join(JOIN_TIMEOUT_S)


def _end_hold(record: JoinRecord) -> None:
    """Release the donors' entries a listener kept pinned (nothing when none)."""
    if record.holder is not None:
        record.holder.__exit__(None, None, None)
        record.holder = None


def _listen(run: Run, outer: ElasticOuterStep, step: int) -> OuterStepReport | None:
    """`outer.enter(step)`, then, while it only listened (`diloco/listen.py`), the members'
    next rounds (no training: straight to each sync point), until it caught up; None when the run completed
    meanwhile (or the outer step applied nothing)."""
    report = outer.enter(step)
    total = run.cfg.train.steps
    while report is None and getattr(outer, "listener", None) is not None:
        done = outer.listener.step  # type: ignore[attr-defined]
        if done >= total:
            outer.listener.close()  # type: ignore[attr-defined]
            run.log.info(
                "the run completed while this node waited to join (it listened to the members' "
                "last rounds); nothing to enter"
            )
            return None
        # no training: straight to the next sync point, which its arrival does not time
        report = outer.enter(min(outer.round_end(done), total))
    return report


def enter_running_job(run: Run, outer: ElasticOuterStep, record: JoinRecord) -> int:
    """Step 5: the joiner's first round, ending where the members' round that started from
    the state it reached ends; returns the step it continues from. Admitted late (the members
    committed meanwhile), it listens until it has the rounds it missed (`listening`), or
    replays them in place; if that fails, it catches up again and asks again."""
    if listening(outer):
        outer.listen_late = lambda mine, behind: Listener(  # type: ignore[attr-defined]
            run,
            outer,
            record,
            mine,
            behind,  # type: ignore[arg-type]
        )
    elif replaying(outer):
        outer.late_catch_up = lambda mine, theirs: replay_in_place(  # type: ignore[attr-defined]
            run, outer, record, mine, theirs
        )
    try:
        while True:
            step = min(outer.round_end(record.step), run.cfg.train.steps)
            try:
                report = _listen(run, outer, step)
                if report is None and record.listened:  # the run completed meanwhile
                    return run.cfg.train.steps
                break
            except (MeshEvicted, CoordinatorLost) as e:
                # a restarted coordinator re-forms the run from the nodes at the newest outer
                # step: a listener holds none of its own yet, so it is sent away; it catches
                # up again as a waiting node (its snapshot, if under way, finishes first)
                if not listening(outer) or record.late >= MAX_LATE:
                    raise
                record.late += 1
                fresh = record.pending is not None  # its snapshot not loaded yet: no state
                _stop_listening(outer, record)
                run.log.warn(
                    f"lost its place while listening ({type(e).__name__}: {e}); registering "
                    f"again and {'listening' if fresh else 'catching up'} again ({record.late} "
                    f"of at most {MAX_LATE})"
                )
                if fresh:  # as a fresh joiner: admitted at once, its snapshot in the background
                    record = _listen_again(run, outer, record, e)
                    continue
                _catch_up_again(run, outer, record, e)
                if record.step >= run.cfg.train.steps:
                    run.log.info("the run completed while this node caught up; nothing to enter")
                    return record.step
            except JoinedLate as e:
                record.late += 1
                if not replaying(outer) or record.late > MAX_LATE:
                    raise
                # (a listener that gave up: its round's all-reduce failed, see `vote`)
                fresh = listening(outer) and record.pending is not None
                _stop_listening(outer, record)
                if fresh:  # no state of its own yet: as a fresh joiner again
                    run.log.warn(f"{e}; registering again and listening again ({record.late} "
                                 f"of at most {MAX_LATE})")  # fmt: skip
                    record = _listen_again(run, outer, record, e)
                    continue
                run.log.warn(
                    f"admitted a round late ({e}); leaving, replaying the rounds since and "
                    f"asking again ({record.late} of at most {MAX_LATE})"
                )
                _catch_up_again(run, outer, record, e)
                if record.step >= run.cfg.train.steps:  # the run completed meanwhile
                    run.log.info("the run completed while this node caught up; nothing to enter")
                    return record.step
    finally:
        if replaying(outer):
            outer.late_catch_up = outer.listen_late = None  # type: ignore[attr-defined]
        _end_hold(record)
    # (admitted late and caught up: the members' round, later than the one it asked)
    step = min(outer.round_end(record.step), run.cfg.train.steps)
    if record.listened and report is not None:
        step = report.step
    admitted = time.monotonic() - record.started
    startup = record.started - LOADED_AT
    run.log.info(
        ("re" if record.rejoined else "")
        + f"entered the running job at outer step {report.outer_step if report else '?'} "
        f"(step {step}), donor {record.donor}: {record.bytes / 1e6:.2f} MB "
        f"fetched in {record.seconds:.2f} s; timeline: start-up {startup:.1f} s, snapshot "
        f"{record.seconds:.1f} s, load {record.load_seconds:.1f} s, replay {record.replayed} "
        f"round(s) in {record.replay_seconds:.1f} s, admitted {admitted:.1f} s after the "
        f"join began ({record.late} late admission(s))"
    )
    run.metrics.write(
        {
            "step": step,
            "joined": True,
            "donor": record.donor,
            "fetched_step": record.snapshot_step,
            "fetch_bytes": record.bytes,
            "fetch_seconds": record.seconds,
            "snapshot_donors": record.snapshot_donors,
            "load_seconds": record.load_seconds,
            "startup_seconds": startup,
            "snapshots": record.snapshots,
            "replayed": record.replayed,
            "replay_bytes": record.replay_bytes,
            "replay_seconds": record.replay_seconds,
            "replay_donors": record.replay_donors,
            "late_admissions": record.late,
            "listened": record.listened,
            "listened_fetching": record.listened_fetching,
            "snapshot_rounds": record.snapshot_rounds,
            "backlog_seconds": record.backlog_seconds,
            "admitted_seconds": admitted,
            **({"rejoined": record.rejoined} if record.rejoined else {}),
        }
    )
    run.progress["step"] = step
    return step
