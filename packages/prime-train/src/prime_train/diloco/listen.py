"""A joiner listens: a member that contributes nothing until it holds the run's state, so the
members never wait for its transfer (synchronous DiLoCo or `overlap = "delayed"`; any number
of fragments).

A joiner says `ready()` as soon as it registered (`diloco/join.py`): the members
admit it at their next sync point, before its snapshot (their checkpoint) arrives. From that
round on it listens:

- It does not train and reads nothing. Each round it goes straight to the next sync point,
  marked `listening` (prime-mesh): arriving up to a round before the members, it must not
  start the coordinator's sync-timeout clock (the first member's arrival does), else the
  members would be left out for being "late". It waits there at most the mesh's
  `request_bound` (the larger of `sync_timeout` and 600 s, plus a heartbeat timeout): rounds
  longer than that need a larger `mesh.sync_timeout`.
- It takes part in the all-reduce with a zeroed pseudo-gradient, its reads counting as nothing
  (the exact header: not a contributor, and the members' outer step count, so nobody sees a
  mismatch; the members do not wait for its ballot in the commit vote, prime-mesh), and keeps
  each committed round's update, the same bits every member applies
  (what their log entry of that round holds), on disk (packed, ~1.25 B/param per round;
  uint8 compression), with the round's counted reads and members (a few numbers, in RAM).
- Meanwhile local rank 0 fetches the snapshot in the background (`fetch.Background`), from
  every member at once, holding while each round's all-reduce runs (`collective`):
  the members' first checkpoint newer than the newest they offered before it said ready. The
  members checkpoint at the round that admitted a node (`Diloco.joiners_waiting`), so the
  snapshot is of that boundary (or the one before): the rounds between it and the first round
  kept, the *backlog*, are none or one, fetched from the members' update logs (held on them).
- At the end of the first round after the snapshot (and backlog) is in, every local rank
  loads the snapshot, replays the backlog (each entry checked against the members' hash),
  then the kept rounds after the snapshot, restores the data positions (the snapshot's, or the
  backlog's last `shared`, then each kept round's counted reads), and applies this round's
  average with the members: its outer weights are theirs, bit for bit (the members' next
  rows' `outer_sha256` show it), and it contributes from the next round.
- With `overlap = "delayed"` each listened round is a delayed joiner's entry round (sync
  point, all-reduce and vote at once, then `settle_late`), and a snapshot
  holding the donor's finished, unapplied round settles it first (`settle_loaded`).

With streaming fragments (`[diloco] fragments` > 1, `diloco/fragments.py`) it listens the
same way: each round it sends zeros as long as the fragment the *members* sync (that of
their count, `Listener.count`, not of its own stale one: `sync_part`) and keeps
that fragment's update; the backlog's entries and the kept rounds are each one fragment's
update, applied in order, each to its own fragment (the fragment follows the count). Its
model then takes the outer weights of every fragment, as a joiner's entry does (`enter`).

So its link carries the snapshot once beside the members' all-reduce traffic, however many
rounds that takes; the kept rounds cost ~1.25 B/param each on its disk for the rounds the
snapshot takes. If the snapshot or backlog cannot be had (every donor gone, pruned, a hash
that differs), it leaves with `JoinedLate` and joins again from the start (`diloco/join.py`):
registered again, it listens again while a new snapshot comes.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prime_mesh import MeshTimeout
from prime_train.diloco.fetch import Fetched, Snapshot, fetch_entries, load_snapshot, replay_fetched
from prime_train.diloco.replay_log import Entry, entry_name
from prime_train.diloco.update_codec import decode
from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_train.diloco.average import Averaged
    from prime_train.diloco.join_side import JoinSide
    from prime_train.diloco.join_state import Joining
    from prime_train.diloco.outer_optimizer import OuterOptimizer
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep


class JoinedLate(RunDirError):
    """A joiner cannot take the members' rounds (its snapshot or the rounds it missed did not
    come, or a round it took part in lacks its update): it leaves and joins again; the
    members go on without waiting."""


BACKLOG_JOIN_S = 60.0  # how long closing a listener waits for its backlog's fetch to end


@dataclass
class _Kept:
    outer_step: int  # the count after it
    consumed: list[float] | None  # the round's counted reads per slot
    members: tuple[str, ...]


class Listener:
    """One joiner's listening, from its admission round until it has caught up (module doc).
    `diloco/join.py` hands it to the outer step (`listen`), whose rounds call `admitted` at
    the first and `listened` at each."""

    def __init__(self, run: Run, outer: ElasticOuterStep, joining: Joining):
        self.run, self.outer, self.joining = run, outer, joining
        self.count: int | None = None  # the members' count (the header's), once admitted
        self.mine = 0  # the outer steps its own state holds (once its snapshot is loaded)
        self.step = 0  # inner step of the last round it listened to
        self.caught_up = False
        self.kept: list[_Kept] = []
        self.applied = 0  # kept rounds applied when it caught up (not already in the snapshot)
        self.folder = run.ckpt_dir / f"listened-r{outer.local_rank}"  # this rank's shards
        self.backlog = run.ckpt_dir / "replay-in"
        self.t0 = time.monotonic()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._got: Fetched | None = None
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self._needed = False  # a backlog between its state and the first kept round

    def admitted(self, count: int) -> None:
        """Its first round: the members had applied `count` outer steps before it."""
        self.count = count
        holder = self.joining.holder
        if holder is not None:  # its snapshot will be of a boundary from here on
            holder.hold_from(entry_name(max(0, count - 2), 0))
        self.run.log.info(
            f"admitted before its snapshot arrived: listening (a member contributing nothing) "
            f"from outer step {count + 1} while the snapshot comes in the background"
        )

    def _start_backlog(self, last: int) -> None:
        """Fetch outer steps mine+1..last in the background (local rank 0)."""
        self._needed = True
        if not self.run.primary:
            return
        holder = self.joining.holder
        if holder is not None:  # pin the backlog on every donor until it is in
            holder.hold_from(entry_name(self.mine + 1, 0))
        self._thread = threading.Thread(
            target=self._fetch, args=(last,), name="prime-join-backlog", daemon=True
        )
        self._thread.start()

    def _fetch(self, last: int) -> None:
        """Local rank 0, in the background: every local rank's entries of the backlog, the
        outer steps after this node's up to `last`."""
        membership = self.run.placement.membership
        assert membership is not None
        ranks = self.run.placement.world_size
        try:
            got = fetch_entries(membership, self.mine, last, ranks, self.backlog)
        except Exception as e:  # any failure: the joiner leaves and listens again
            self._failed = f"fetching the rounds it missed failed: {type(e).__name__}: {e}"
            return
        self.joining.row.backlog_seconds = got.seconds
        self._got = got

    def collective(self) -> AbstractContextManager[None]:
        """Around the round's all-reduce: the snapshot under way holds (`LinkGate`)."""
        snapshot = self.joining.snapshot  # (local rank 0's fetch)
        return snapshot.gate.held() if snapshot is not None else nullcontext()

    def _state(self) -> tuple[bool, str | None, Snapshot | None]:
        """(backlog in, why it failed, the snapshot once in), agreed by the local ranks."""

        def ask() -> tuple[bool, str | None, Snapshot | None]:
            snapshot = self.joining.snapshot
            if snapshot is not None:
                if snapshot.failed is not None:
                    return False, f"fetching the snapshot failed: {snapshot.failed}", None
                return False, None, snapshot.got if snapshot.done else None
            done = not self._needed or (self._thread is not None and not self._thread.is_alive())
            return done, self._failed, None

        return self.run.placement.from_rank0(ask)

    def listened(self, got: Averaged, step: int) -> bool:
        """A committed round this node took part in without contributing (its average is in
        the outer step's buffer): keep it (False), or, its state being in, catch up and let
        the round apply as the members' does (True). JoinedLate when it cannot catch up."""
        assert self.count is not None, "admitted() comes first"
        self.step = step
        row = self.joining.row
        row.listened += 1
        average = self.outer.round_update(self.count)
        done, failed, snapshot = self._state()
        if snapshot is not None:
            with _kept_aside(average, got):  # (a delayed snapshot's pending round uses it)
                self._load(snapshot)
            done, failed, _ = self._state()
        if failed is not None:
            self.close()
            raise JoinedLate(failed)
        # (a snapshot of this very round: keep it, as it is in the snapshot already)
        if not done or self.joining.waiting or self.mine > self.count:
            if row.listened > 1:  # (the fetch began with the first)
                row.listened_fetching += 1
            if self.joining.waiting:
                row.snapshot_rounds += 1
            self._keep(got, average)
            self.outer.rollback_to_outer()  # its model goes back to its own outer weights
            self._check_bound()
            return False
        with _kept_aside(average, got):  # (replaying uses the buffer)
            self._catch_up()
        self.caught_up = True
        self.run.log.info(
            f"caught up after listening to {row.listened} round(s): from outer step "
            f"{self.mine} replayed {row.replayed} logged and {self.applied} kept round(s) to "
            f"outer step {self.count} (backlog in {row.backlog_seconds:.1f} s, "
            f"{row.listened_fetching} round(s) committed meanwhile) and contributes from the "
            "next round"
        )
        return True

    def _check_bound(self) -> None:
        """MeshTimeout once it listened longer than the mesh's `join_timeout` (decided on
        local rank 0 for all ranks): a snapshot or backlog that never comes must not keep it
        listening, holding the donors' logs, for ever."""
        bound = self.outer.mesh.join_timeout
        if bound is None:
            return
        listened = self.run.placement.from_rank0(lambda: time.monotonic() - self.t0)
        if listened <= bound:
            return
        self.close()
        raise MeshTimeout(
            f"listened for {listened:.0f} s ({self.joining.row.listened} round(s)) without "
            f"catching up, past the mesh's join_timeout of {bound:g} s: the snapshot or the "
            "rounds it missed did not come in time (check this node's link to the members, "
            "then rerun the same command to join again)"
        )

    def _load(self, snapshot: Snapshot) -> None:
        """The snapshot came: load it (every local rank); a backlog between it and the first
        round kept comes next, in the background (none when the snapshot is of the boundary
        that admitted this node, or later)."""
        assert self.count is not None
        self.joining.snapshot = None
        load_snapshot(self.run, self.outer, self.joining, snapshot)
        self.outer.settle_loaded()  # (delayed: the donor's pending round applies first)
        self.mine = self.outer.outer_steps
        first = self.kept[0].outer_step if self.kept else self.count + 1
        if self.mine + 1 < first:
            self._start_backlog(first - 1)
        self.run.log.info(
            f"snapshot of outer step {self.mine} in after listening to "
            f"{self.joining.row.listened} round(s); {max(0, first - 1 - self.mine)} logged "
            f"round(s) to fetch before the {len(self.kept)} kept"
        )

    def _keep(self, got: Averaged, update: torch.Tensor) -> None:
        """This round's update on disk (each local rank its shard), the rest in memory: with
        fragments, the update of the one the members synced (that of their count before it)."""
        assert self.count is not None
        self.count += 1
        entry = Entry(self.count, self.step, self.outer.local_rank, "", "", update)
        entry = entry.pack(got.encoded)
        (self.folder / str(self.count)).write_bytes(entry.encode(self.run.log_key))
        self.kept.append(_Kept(self.count, got.consumed, tuple(self.outer.mesh.global_members)))

    def _catch_up(self) -> None:
        """Replay the backlog (hash-checked), then the kept rounds after the state; restore
        the data state."""
        if self._needed:
            got = self.run.placement.from_rank0(lambda: self._got)
            assert got is not None
            t0 = time.monotonic() - got.seconds  # (the row's replay time: fetch and apply)
            problem = replay_fetched(self.run, self.outer, self.joining, got, self.backlog, t0)
            if problem is not None:
                self.close()
                raise JoinedLate(f"replaying the rounds it missed failed: {problem}")
        data = self.outer.data
        for kept in self.kept:
            if kept.outer_step <= self.outer.outer_steps:  # already in its snapshot
                continue
            self.applied += 1
            path = self.folder / str(kept.outer_step)
            self.outer.apply_update(Entry.decode(path.read_bytes(), self.run.log_key).update)
            if data is not None and kept.consumed is not None:
                data.commit(kept.consumed, kept.members)  # as the members moved them
        self.outer.take_members_state()
        self.close(caught_up=True)

    def close(self, caught_up: bool = False, wait: bool = True) -> None:
        """Done (`caught_up`, or given up): its files go and, with `wait`, its backlog's fetch
        ends first (bounded; a node that stops does not wait). Idempotent."""
        if self._thread is not None and wait:  # (caught up: it ended; else it is bounded)
            self._thread.join(timeout=BACKLOG_JOIN_S)
            if self._thread.is_alive():
                self.run.log.warn(f"the backlog's fetch is still on after {BACKLOG_JOIN_S:g} s")
            self._thread = None
        if caught_up and self.joining.holder is not None:  # nothing older is needed
            self.joining.holder.hold_from(entry_name((self.count or 0) + 1, 0), now=False)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def _kept_aside(average: torch.Tensor, got: Averaged) -> Iterator[None]:
    """`average` (this round's, in the outer step's buffer) holds the same values after the
    block as before: decoded again from the all-reduce's bytes the round kept (no copy of the
    model's size meanwhile), or, without compression, from a copy."""
    kept = average.clone() if got.encoded is None else None
    try:
        yield
    finally:
        if got.encoded is not None:
            decode(got.encoded, out=average)
        else:
            average.copy_(kept)


# The outer step's side: a listener's rounds (the header, `diloco/average.py`, tells it at
# its first round how many outer steps the members are ahead: `behind`)


def sync_count(outer: JoinSide) -> int:
    """The committed count this node's next sync states and takes its fragment from: a
    listener's is the members' (it will have applied their rounds when it enters)."""
    listener = outer.listener
    if listener is not None and listener.count is not None:
        return listener.count
    return outer.outer_steps


def sync_part(outer: JoinSide) -> OuterOptimizer:
    """The outer optimizer of the fragment this node's next sync averages (`sync_count`)."""
    return outer.fragments.part(sync_count(outer))


def settle_late(outer: JoinSide, got: Averaged, step: int, contributing: bool = True) -> int | None:
    """A committed round `got` ending at inner step `step`: the inner step of the members'
    round, for the round to apply as theirs does (its buffer holding the average); None: a
    round a listener only kept. JoinedLate when it cannot catch up, when the header says
    this node, not listening, lacks rounds the members applied, or when it did not
    contribute (`contributing`: left out of the round) and its outer state is not the
    contributors' (`check_holds_agreed`)."""
    listener = outer.listener
    if listener is None:
        if got.late is not None:
            raise JoinedLate(got.late)  # the members commit; this node leaves
        if not contributing:
            check_holds_agreed(outer)
        return step
    if listener.count is None:  # its first round: its count is 0, or a rejoiner's stale one
        step = (outer.outer_steps + got.behind + 1) * outer.period
        listener.admitted(outer.outer_steps + got.behind)
    if got.members_step is not None:  # the header's: a delayed run's count does not tell it
        step = got.members_step  # (a dropped round moves the step, not the count)
    if not listener.listened(got, step):
        return None  # kept, not applied: it still fetches its snapshot or backlog
    check_holds_agreed(outer)
    outer.listen(None)  # caught up: this round applies as theirs
    return step


def check_holds_agreed(outer: JoinSide) -> None:
    """JoinedLate unless this node, which did not contribute to the round just committed (a
    listener that has caught up, a member left out of it), holds the outer state the
    contributors voted with (`mesh.agreed_outer`): its weights are compared only when it
    contributes, and a change made outside the update stream (a fault, a bit flip on the
    only contributor) cannot be replayed from it; applying the round on other weights would
    write a row of another hash; so would applying it at another outer step count (a round
    it missed). The node then takes the members' state again."""
    agreed = outer.mesh.agreed_outer
    if agreed is None:
        return
    if agreed[0] != outer.outer_steps:
        raise JoinedLate(
            f"this node is at outer step {outer.outer_steps}, the contributors at {agreed[0]}: "
            "it missed or repeated a round; it takes the members' state again"
        )
    mine = outer.rounds.node_digest()
    if mine != agreed[1]:
        raise JoinedLate(
            f"outer weights differ from the contributors' at outer step {agreed[0]}: this node "
            f"holds hash {mine[:16]}, the contributors voted with {agreed[1][:16]}; it takes "
            "the members' state again"
        )
