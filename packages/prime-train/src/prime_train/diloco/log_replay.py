"""Catching up from the members' update logs (`diloco/replay_log.py`): a joiner that loaded a
checkpoint replays the committed updates since it until it is even with the members
(`catch_up`, before it says ready), or, admitted late and already a member, replays the rounds
it missed at once (`replay_in_place`, the fallback when it cannot listen). Which path a joiner
takes: `replaying` and `listening`. The steps of a join: `diloco/join.py`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prime_ckpt import PeerError
from prime_train.diloco.catch_up import (
    Fetched,
    Holder,
    fetch_entries,
    on_primary,
    replay_fetched,
)
from prime_train.diloco.snapshot import (
    JOIN_TIMEOUT_S,
    JoinFailed,
    JoinRecord,
    fetch_members_state,
    load_state,
    members_left,
    shared_tensors,
)
from prime_train.seam import ElasticOuterStep

if TYPE_CHECKING:
    from prime_train.run import Run

ENTRIES_WAIT_S = 10.0  # how long a late joiner waits for entries a member still writes


def replaying(outer: ElasticOuterStep) -> bool:
    """Whether this joiner catches up by replaying the members' update logs (Prime's DiLoCo
    steps, synchronous and delayed; another outer step waits for a fresh checkpoint)."""
    return callable(getattr(outer, "replay", None))


def listening(outer: ElasticOuterStep) -> bool:
    """Whether a joiner admitted late listens until it has the rounds it missed
    (`diloco/listen.py`: DiLoCo with data slots, whose members send the exact header every
    round, as a listener does; synchronous or delayed, and with streaming fragments each
    round the fragment the members sync); else it replays them in place."""
    return replaying(outer) and getattr(outer, "data", None) is not None


def newer_snapshot(run: Run, outer: ElasticOuterStep, record: JoinRecord, why: str) -> None:
    """Fetch and load a checkpoint newer than the record's snapshot (on every local rank)."""
    run.log.warn(f"{why}: fetching a newer checkpoint")
    membership = run.placement.membership
    assert membership is not None
    got = on_primary(
        run,
        lambda: fetch_members_state(
            membership,
            run.ckpt_dir,
            run.log,
            newer_than=record.snapshot_step,
            fresh=False,
            shared=shared_tensors(run.cfg.diloco.overlap),
        ),
    )
    record.snapshot_step, record.donor = got.snapshot_step, got.donor
    for who, n in got.snapshot_donors.items():
        record.snapshot_donors[who] = record.snapshot_donors.get(who, 0) + n
    record.bytes += got.bytes
    record.seconds += got.seconds
    record.snapshots += 1
    load_state(run, outer, record)


def catch_up(
    run: Run,
    outer: ElasticOuterStep,
    record: JoinRecord,
    holder: Holder | None,
    need: int | None = None,
) -> None:
    """Replay the members' committed updates since the loaded state, until the donors offer
    no newer one (and at least up to outer step `need`): see `diloco/catch_up.py`. A joiner
    that listens (`listening`) also stops once a pass brings not even half fewer entries than
    the one before: they move slower than rounds pass, so it enters and listens. A log that
    no longer reaches the state, or a replay whose hash differs, takes a newer checkpoint;
    a second mismatch is JoinFailed naming it."""
    membership = run.placement.membership
    assert membership is not None
    ranks = run.placement.world_size
    folder = run.ckpt_dir / "replay-in"
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    mismatches, waited_since, gone_since, previous = 0, None, None, None
    while True:
        after = outer.outer_steps  # type: ignore[attr-defined]
        if holder is not None:
            holder.first = after + 1
            holder.renew()
        t0 = time.monotonic()
        got = on_primary(run, lambda a=after: fetch_entries(membership, a, ranks, folder))
        if time.monotonic() > deadline:
            raise JoinFailed(
                f"could not catch up with the members within {JOIN_TIMEOUT_S:.0f} s (at outer "
                f"step {after}); check this machine's link to them, then rerun the same command"
            )
        if got.stale:
            newer_snapshot(run, outer, record, f"the members' update logs no longer reach "
                            f"outer step {after + 1}")  # fmt: skip
            continue
        if not got.outer_steps:
            gone_since = gone_since or time.monotonic()
            left = on_primary(
                run,
                lambda s=gone_since: None if membership.donors() else members_left(membership, s),
            )
            if left is not None:
                raise left
            if need is None or after >= need:
                break
            waited_since = waited_since or time.monotonic()
            if time.monotonic() - waited_since > 30.0:  # the members keep no log (K = 0)
                newer_snapshot(run, outer, record, f"no update after outer step {after} came")
                waited_since = None
            time.sleep(1.0)
            continue
        gone_since = None
        problem = replay_fetched(run, outer, record, got, folder, t0)
        if problem is not None:
            mismatches += 1
            if mismatches > 1:
                raise JoinFailed(
                    f"replaying the members' committed updates does not reproduce their outer "
                    f"weights ({problem}); this node cannot join them: run it with the same "
                    "torch build and CPU kind as the members"
                )
            previous = None
            newer_snapshot(run, outer, record, f"replay mismatch: {problem}")
            continue
        n, caught = len(got.outer_steps), need is None or outer.outer_steps >= need  # type: ignore[attr-defined]
        if listening(outer) and previous is not None and 2 * n > previous and caught:
            break  # not converging: enter now and listen (`diloco/listen.py`)
        previous = n


def replay_in_place(
    run: Run, outer: ElasticOuterStep, record: JoinRecord, mine: int, theirs: int
) -> bool:
    """A joiner admitted late, already a member: fetch and replay the updates of outer steps
    mine+1..theirs (committed before this round, so every donor has them), at once; False
    when it cannot (it then leaves and catches up as a waiting node)."""
    membership = run.placement.membership
    assert membership is not None
    folder, t0 = run.ckpt_dir / "replay-in", time.monotonic()
    want = list(range(mine + 1, theirs + 1))

    def fetch() -> Fetched:
        # a member writes the entry of the round it just applied in the background (a delayed
        # round applies right before the sync point that admitted this node): ask again briefly
        while True:
            try:
                got = fetch_entries(
                    membership, mine, run.placement.world_size, folder, until=theirs
                )
            except (PeerError, OSError):
                got = Fetched(stale=True)
            if got.outer_steps == want or time.monotonic() - t0 > ENTRIES_WAIT_S:
                return got
            time.sleep(0.2)

    got = on_primary(run, fetch)
    if got.outer_steps != want:
        return False
    problem = replay_fetched(run, outer, record, got, folder, t0)
    if problem is not None:
        run.log.warn(f"replaying the rounds missed failed: {problem}")
        return False
    record.late += 1
    run.log.info(
        f"admitted {theirs - mine} round(s) late: replayed outer steps {mine + 1}..{theirs} "
        f"in {time.monotonic() - t0:.2f} s and took this round with the members"
    )
    return True
