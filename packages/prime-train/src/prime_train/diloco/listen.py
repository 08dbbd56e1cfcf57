"""A joiner listens: a member that contributes nothing until it holds the run's state, so the
members never wait for its transfer (synchronous DiLoCo, or `overlap = "delayed"`, with one
fragment).

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
- Meanwhile local rank 0 fetches the snapshot in the background (`snapshot.Background`), from
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
  point, all-reduce and vote at once, then `late_joiner.settle_late`), and a snapshot
  holding the donor's finished, unapplied round settles it first (`settle_loaded`).

With streaming fragments (`[diloco] fragments` > 1, `diloco/fragments.py`) it listens the
same way: each round it sends zeros as long as the fragment the *members* sync (that of
their count, `Listener.count`, not of its own stale one: `late_joiner.sync_part`) and keeps
that fragment's update; the backlog's entries and the kept rounds are each one fragment's
update, applied in order, each to its own fragment (the fragment follows the count). Its
model then takes the outer weights of every fragment, as a joiner's entry does (`enter`).

So its link carries the snapshot once beside the members' all-reduce traffic, however many
rounds that takes; the kept rounds cost ~1.25 B/param each on its disk for the rounds the
snapshot takes. A joiner admitted late after loading a snapshot first (the path it takes
again after a failed listen) listens the same way while its backlog comes. If the snapshot or
backlog cannot be had (every donor gone, pruned, a hash that differs), it leaves with
`JoinedLate` and catches up again as a waiting node (`diloco/join.py`).
"""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_mesh import CoordinatorLost, MeshEvicted, MeshTimeout, RunCompleted
from prime_train import faults
from prime_train.diloco.catch_up import (
    Fetched,
    Holder,
    fetch_entries,
    log_key,
    on_primary,
    replay_fetched,
)
from prime_train.diloco.late_joiner import JoinedLate
from prime_train.diloco.replay_log import Entry
from prime_train.diloco.snapshot import (
    JOIN_TIMEOUT_S,
    Background,
    JoinFailed,
    JoinRecord,
    fetch_rate,
    load_snapshot,
    shared_tensors,
)

if TYPE_CHECKING:
    from prime_train.diloco.average import Averaged
    from prime_train.diloco.outer_step import Diloco
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep


BACKLOG_JOIN_S = 60.0  # how long closing a listener waits for its backlog's fetch to end


@dataclass
class _Kept:
    outer_step: int  # the count after it
    consumed: list[float] | None  # the round's counted reads per slot
    members: tuple[str, ...]


class Listener:
    """One joiner's listening, from its admission round until it has caught up (module doc).
    Made by the outer step's `listen_late` hook; `listened` is called each round."""

    def __init__(self, run: Run, outer: Diloco, record: JoinRecord, mine: int, behind: int):
        """`mine`: the outer steps this node applied; `behind`: how many more the members
        applied before the round it was admitted to. With `record.pending` its snapshot is
        still under way (admitted before it came): `mine` means nothing until it is loaded."""
        self.run, self.outer, self.record = run, outer, record
        self.mine, self.count = mine, mine + behind  # `count`: the members', for the header
        self.loaded = record.pending is None  # its state is a snapshot's (and backlog's)
        self.step = 0  # inner step of the last round it listened to
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
        if self.loaded:
            record.late += 1
            self._start_backlog(mine + behind)
            run.log.info(
                f"admitted {behind} round(s) late: listening (a member contributing nothing) "
                f"while outer steps {mine + 1}..{mine + behind} come from the donors in the "
                "background"
            )
        else:
            if record.holder is not None:  # its snapshot will be of a boundary from here on
                record.holder.first = max(0, self.count - 2)
                record.holder.renew()
            run.log.info(
                f"admitted before its snapshot arrived: listening (a member contributing "
                f"nothing) from outer step {self.count + 1} while the snapshot comes in the "
                "background"
            )

    def _start_backlog(self, last: int) -> None:
        """Fetch outer steps mine+1..last in the background (local rank 0)."""
        self._needed = True
        if not self.run.primary:
            return
        holder = self.record.holder
        if holder is not None:  # pin the backlog on every donor until it is in
            holder.first = self.mine + 1
            holder.renew()
        self._thread = threading.Thread(
            target=self._fetch, args=(last,), name="prime-join-backlog", daemon=True
        )
        self._thread.start()

    def _fetch(self, last: int) -> None:
        """Local rank 0, in the background: every local rank's entries of the backlog, the
        outer steps after this node's up to `last`."""
        membership = self.run.placement.membership
        assert membership is not None
        want = list(range(self.mine + 1, last + 1))
        t0 = time.monotonic()
        try:
            # one download at a time: the all-reduce it takes part in keeps half its link
            got = fetch_entries(membership, self.mine, self.run.placement.world_size,
                                self.backlog, until=last, one_at_a_time=True)  # fmt: skip
        except Exception as e:  # any failure: the joiner leaves and catches up again
            self._failed = f"fetching the rounds it missed failed: {type(e).__name__}: {e}"
            return
        if got.outer_steps != want:
            self._failed = (
                f"the donors' logs offered outer steps {got.outer_steps[:1]}.. of "
                f"{want[0]}..{want[-1]} (pruned, or a donor left)"
            )
            return
        self.record.backlog_seconds = time.monotonic() - t0
        self._got = got

    def collective(self) -> AbstractContextManager[None]:
        """Around the round's all-reduce: the snapshot under way holds (`LinkGate`)."""
        gate = getattr(self.record.pending, "gate", None)  # (local rank 0's fetch)
        return gate.held() if gate is not None and not self.loaded else nullcontext()

    def _state(self) -> tuple[bool, str | None, Any]:
        """(backlog in, why it failed, the snapshot's record once in), agreed by the node's
        local ranks."""

        def ask() -> tuple[bool, str | None, Any]:
            pending = self.record.pending
            if pending is not None and not self.loaded:
                if pending.failed is not None:
                    return False, f"fetching the snapshot failed: {pending.failed}", None
                return False, None, pending.got if pending.done else None
            done = not self._needed or (self._thread is not None and not self._thread.is_alive())
            return done, self._failed, None

        return on_primary(self.run, ask)

    def listened(self, got: Averaged, step: int) -> bool:
        """A committed round this node took part in without contributing (its average is in
        the outer step's buffer): keep it (False), or, its state being in, catch up and let
        the round apply as the members' does (True). JoinedLate when it cannot catch up."""
        self.step = step
        self.record.listened += 1
        average = self.outer.optimizer.pseudo_gradient.clone()  # loading and replaying reuse it
        done, failed, snapshot = self._state()
        if snapshot is not None:
            self._load(snapshot)
            done, failed, _ = self._state()
        if failed is not None:
            self.close()
            raise JoinedLate(failed)
        if done and self.loaded and faults.holds_listening(self.run.log, self.mine):
            done = False  # (a test's: as if its backlog were still under way)
        # (a snapshot of this very round: keep it, as it is in the snapshot already)
        if not done or not self.loaded or self.mine > self.count:
            if self.record.listened > 1:  # (the fetch began with the first)
                self.record.listened_fetching += 1
            if not self.loaded:
                self.record.snapshot_rounds += 1
            self.outer.optimizer.pseudo_gradient.copy_(average)
            self._keep(got)
            self.outer.rollback_to_outer()  # its model goes back to its own outer weights
            self._check_bound()
            return False
        self._catch_up()
        self.outer.optimizer.pseudo_gradient.copy_(average)
        self.run.log.info(
            f"caught up after listening to {self.record.listened} round(s): from outer step "
            f"{self.mine} replayed {self.record.replayed} logged and {self.applied} kept "
            f"round(s) to outer step {self.count} (backlog in {self.record.backlog_seconds:.1f} "
            f"s, {self.record.listened_fetching} round(s) committed meanwhile) and contributes "
            "from the next round"
        )
        return True

    def _check_bound(self) -> None:
        """MeshTimeout once it listened longer than the mesh's `join_timeout` (decided on
        local rank 0 for all ranks): a snapshot or backlog that never comes must not keep it
        listening, holding the donors' logs, for ever."""
        bound = self.outer.mesh.join_timeout
        if bound is None:
            return
        listened = on_primary(self.run, lambda: time.monotonic() - self.t0)
        if listened <= bound:
            return
        self.close()
        raise MeshTimeout(
            f"listened for {listened:.0f} s ({self.record.listened} round(s)) without "
            f"catching up, past the mesh's join_timeout of {bound:g} s: the snapshot or the "
            "rounds it missed did not come in time (check this node's link to the members, "
            "then rerun the same command to join again)"
        )

    def _load(self, snapshot: JoinRecord) -> None:
        """The snapshot came: load it (every local rank); a backlog between it and the first
        round kept comes next, in the background (none when the snapshot is of the boundary
        that admitted this node, or later)."""
        load_snapshot(self.run, self.outer, self.record, snapshot)
        settle = getattr(self.outer, "settle_loaded", None)  # (delayed: the donor's pending
        if settle is not None:  # round, which this node may not have kept, applies first)
            settle()
        self.loaded, self.mine = True, self.outer.outer_steps
        first = self.kept[0].outer_step if self.kept else self.count + 1
        if self.mine + 1 < first:
            self._start_backlog(first - 1)
        self.run.log.info(
            f"snapshot of outer step {self.mine} in after listening to {self.record.listened} "
            f"round(s); {max(0, first - 1 - self.mine)} logged round(s) to fetch before the "
            f"{len(self.kept)} kept"
        )

    def _keep(self, got: Averaged) -> None:
        """This round's update on disk (each local rank its shard), the rest in memory: with
        fragments, the update of the one the members synced (that of their count before it)."""
        update = self.outer.fragments.part(self.count).pseudo_gradient
        self.count += 1
        rank = self.outer.local_rank
        entry = Entry(self.count, self.step, rank, "", "", update)
        (self.folder / str(self.count)).write_bytes(entry.encode(log_key(self.run)))
        self.kept.append(_Kept(self.count, got.consumed, tuple(self.outer.mesh.global_members)))

    def _catch_up(self) -> None:
        """Replay the backlog (hash-checked), then the kept rounds after the state; restore
        the data state."""
        if self._needed:
            got = on_primary(self.run, lambda: self._got)
            assert got is not None
            t0 = time.monotonic() - got.seconds  # (the record's replay time: fetch and apply)
            problem = replay_fetched(self.run, self.outer, self.record, got, self.backlog, t0)
            if problem is not None:
                self.close()
                raise JoinedLate(f"replaying the rounds it missed failed: {problem}")
        data: Any = self.outer.data
        for kept in self.kept:
            if kept.outer_step <= self.outer.outer_steps:  # already in its snapshot
                continue
            self.applied += 1
            path = self.folder / str(kept.outer_step)
            self.outer.apply_update(Entry.decode(path.read_bytes(), log_key(self.run)).update)
            if data is not None and kept.consumed is not None:
                data.commit(kept.consumed, kept.members)  # as the members moved them
        if self.outer.fragments.count > 1:  # its local weights: the outer ones, as `enter`'s
            self.outer.rollback_to_outer()  # (a fragment not replayed holds the donor's)
        self.outer.feedback.reset()  # the snapshot brought the donor's residual: not its own
        self.close(caught_up=True)

    def close(self, caught_up: bool = False) -> None:
        """Done (`caught_up`, or given up): the outer step stops listening; files go. A node
        that gives up keeps its hold where it is: catching up again needs the entries after
        its own state, which the kept rounds it drops no longer stand in for."""
        self.outer.listener = None
        faults.end_hold_listening()
        if self._thread is not None:  # (caught up: it ended; given up: its fetch is bounded)
            self._thread.join(timeout=BACKLOG_JOIN_S)
            if self._thread.is_alive():
                self.run.log.warn(f"the backlog's fetch is still on after {BACKLOG_JOIN_S:g} s")
            self._thread = None
        if caught_up and self.record.holder is not None:
            self.record.holder.first = self.count + 1  # nothing older is needed any more
        shutil.rmtree(self.folder, ignore_errors=True)


def admit_first(run: Run, outer: ElasticOuterStep, rejoined: int | None) -> JoinRecord:
    """A joiner that listens says `ready()` at once: admitted at the members' next sync point,
    it listens while its snapshot comes in the background (`diloco/listen.py`)."""
    membership = run.placement.membership
    assert membership is not None
    record = JoinRecord(step=0, donor=None, bytes=0, seconds=0.0, rejoined=rejoined)
    if run.primary:
        record.holder = Holder(membership).__enter__()  # (`enter_running_job` ends it)
        record.pending = Background(
            membership,
            run.ckpt_dir,
            run.log,
            shared_tensors(run.cfg.diloco.overlap),
            fetch_rate(run.cfg.mesh),
        )
    else:
        record.pending = True  # (local rank 0's fetch, told through `on_primary`)
    outer.listen_first = True  # type: ignore[attr-defined]
    try:
        faults.delay_first_ready(run.log)
        membership.mesh.ready()
        run.log.info(
            "joining a running job: ready at once, admitted at the members' next sync point; "
            "the snapshot comes in the background while this node listens"
        )
        _wait_admitted(run, record)
    except (MeshEvicted, CoordinatorLost):  # (it joins again: nothing may write meanwhile)
        if record.holder is not None:
            record.holder.__exit__(None, None, None)
        if isinstance(record.pending, Background):
            record.pending.join(JOIN_TIMEOUT_S)
        raise
    return record


def _wait_admitted(run: Run, record: JoinRecord) -> None:
    """Until the coordinator lists this node as a member (the members' next sync point), or
    the snapshot's fetch finds the members gone: `RunCompleted` (exit 0) when they finished
    the run, else `JoinFailed`; `MeshTimeout` past the mesh's `join_timeout` (as its own wait
    for admission), decided on local rank 0 for all ranks."""
    membership = run.placement.membership
    assert membership is not None
    me = membership.mesh.node_id

    bound = membership.mesh.join_timeout  # (as the mesh's own wait for admission)
    deadline = None if bound is None else time.monotonic() + bound

    def ask() -> tuple[str, str] | None:
        pending = record.pending
        failed = getattr(pending, "failed", None)
        if isinstance(failed, RunCompleted | JoinFailed):
            return type(failed).__name__, str(failed)
        if deadline is not None and time.monotonic() > deadline:
            return "MeshTimeout", (
                f"not admitted within the mesh's join_timeout of {bound:g} s (the members' "
                "sync point never came, or the coordinator stayed away)"
            )
        try:
            members = membership.mesh.members()
        except MeshEvicted as e:  # stalled or cut off before its admission: it joins again
            return "MeshEvicted", str(e)
        except Exception:  # the coordinator briefly away: ask again
            return None
        return ("member", "") if any(m.get("node_id") == me and m.get("state") == "member"
                                     for m in members) else None  # fmt: skip

    while (got := on_primary(run, ask)) is None:
        time.sleep(0.2)
    kind, why = got
    if kind == "RunCompleted":
        raise RunCompleted(why)
    if kind == "JoinFailed":
        raise JoinFailed(why)
    if kind == "MeshTimeout":
        raise MeshTimeout(why)
    if kind == "MeshEvicted":
        raise MeshEvicted(why)
