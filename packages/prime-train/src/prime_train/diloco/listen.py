"""A joiner admitted late listens: it is a member that contributes nothing until it holds the
rounds it missed, so the members never wait for its transfer (synchronous DiLoCo only).

Admitted `behind` rounds after the state it loaded (the members committed meanwhile), the
joiner does not fetch those rounds' entries while the members wait at their next sync point:

- it stays a member that contributes nothing. Each round it trains as the members do (so it
  reaches their sync point when they do: arriving a whole round early would start the
  coordinator's clock on them), from its own outer weights; its pseudo-gradient is zeroed and
  its reads count as nothing (the exact header: not a contributor, and the members' outer
  step count, so nobody sees a mismatch). It takes part in the all-reduce and keeps the
  round's committed update, the same bits every member applies (what their log entry of that
  round holds), on disk (packed, ~1.25 B/param), with the round's counted reads and members;
- meanwhile local rank 0 fetches the backlog, the entries between its state and its
  admission, from the donors in the background (held on them, under their serving cap), one
  download at a time: with the cap at about half a link, the all-reduce keeps the other half
  of the joiner's link (several at once starved it: measured, members' rounds 2.5x longer);
- at the end of the first round after the backlog is in, it replays the backlog (each entry
  checked against the members' hash), then the rounds it kept, in order, restores the data
  positions (the backlog's last `shared`, then each kept round's counted reads), and applies
  this round's average with the members: its outer weights are theirs, bit for bit, and it
  contributes from the next round.

Its link carries the members' own all-reduce traffic plus the backlog once, however long an
entry takes to move. If the backlog cannot be had (pruned, a hash that differs), it leaves
with `JoinedLate` and catches up again as a waiting node (`diloco/join.py`).
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_train.diloco.catch_up import Fetched, fetch_entries, on_primary, replay_fetched
from prime_train.diloco.outer_step import JoinedLate
from prime_train.diloco.replay_log import Entry

if TYPE_CHECKING:
    from prime_train.diloco.average import Averaged
    from prime_train.diloco.outer_step import Diloco
    from prime_train.diloco.snapshot import JoinRecord
    from prime_train.run import Run


@dataclass
class _Kept:
    outer_step: int  # the count after it
    consumed: list[float] | None  # the round's counted reads per slot
    members: tuple[str, ...]


class Listener:
    """One late joiner's listening, from its admission round until it has caught up (module
    doc). Made by the outer step's `listen_late` hook; `listened` is called each round."""

    def __init__(self, run: Run, outer: Diloco, record: JoinRecord, mine: int, behind: int):
        """`mine`: the outer steps this node applied; `behind`: how many more the members
        applied before the round it was admitted to."""
        self.run, self.outer, self.record = run, outer, record
        self.mine, self.count = mine, mine + behind  # `count`: the members', for the header
        self.step = 0  # inner step of the last round it listened to
        self.kept: list[_Kept] = []
        self.folder = run.ckpt_dir / f"listened-r{outer.local_rank}"  # this rank's shards
        self.backlog = run.ckpt_dir / "replay-in"
        self.t0 = time.monotonic()
        record.late += 1
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        if outer.data is not None:  # slots to read, so that its rounds take the members' time
            outer.data.reassign(outer.mesh.global_members)
        self._got: Fetched | None = None
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        if run.primary:
            holder = record.holder
            if holder is not None:  # pin the backlog on every donor until it is in
                holder.first = mine + 1
                holder.renew()
            self._thread = threading.Thread(
                target=self._fetch, args=(mine + behind,), name="prime-join-backlog", daemon=True
            )
            self._thread.start()
        run.log.info(
            f"admitted {behind} round(s) late: listening (a member contributing nothing) while "
            f"outer steps {mine + 1}..{mine + behind} come from the donors in the background"
        )

    def _fetch(self, last: int) -> None:
        """Local rank 0, in the background: every local rank's entries of the backlog, the
        outer steps after this node's up to `last`."""
        membership = self.run.placement.membership
        assert membership is not None
        want = list(range(self.mine + 1, last + 1))
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
        self.record.backlog_seconds = time.monotonic() - self.t0
        self._got = got

    def _state(self) -> tuple[bool, str | None]:
        """(backlog in, why it failed), agreed by the node's local ranks."""

        def ask() -> tuple[bool, str | None]:
            done = self._thread is not None and not self._thread.is_alive()
            return done, self._failed

        return on_primary(self.run, ask)

    def listened(self, got: Averaged, step: int) -> bool:
        """A committed round this node took part in without contributing (its average is in
        the outer step's buffer): keep it (False), or, the backlog being in, catch up and let
        the round apply as the members' does (True). JoinedLate when it cannot catch up."""
        self.step = step
        done, failed = self._state()
        self.record.listened += 1
        if failed is not None:
            self.close()
            raise JoinedLate(failed)
        if not done:
            if self.record.listened > 1:  # (the backlog's fetch began with the first)
                self.record.listened_fetching += 1
            self._keep(got)
            self.outer.rollback_to_outer()  # it trains the next round from its own weights
            return False
        average = self.outer.optimizer.pseudo_gradient.clone()  # the replay reuses the buffer
        self._catch_up()
        self.outer.optimizer.pseudo_gradient.copy_(average)
        self.run.log.info(
            f"caught up after listening to {self.record.listened} round(s): replayed outer "
            f"steps {self.mine + 1}..{self.count} (backlog in {self.record.backlog_seconds:.1f} "
            f"s, {self.record.listened_fetching} round(s) committed meanwhile) and contributes "
            "from the next round"
        )
        return True

    def _keep(self, got: Averaged) -> None:
        """This round's update on disk (each local rank its shard), the rest in memory."""
        self.count += 1
        rank = self.outer.local_rank
        entry = Entry(self.count, self.step, rank, "", "", self.outer.optimizer.pseudo_gradient)
        (self.folder / str(self.count)).write_bytes(entry.encode())
        self.kept.append(_Kept(self.count, got.consumed, tuple(self.outer.mesh.global_members)))

    def _catch_up(self) -> None:
        """Replay the backlog (hash-checked), then the kept rounds; restore the data state."""
        got = on_primary(self.run, lambda: self._got)
        assert got is not None
        t0 = time.monotonic() - got.seconds  # (the record's replay time: fetch and apply)
        problem = replay_fetched(self.run, self.outer, self.record, got, self.backlog, t0)
        if problem is not None:
            self.close()
            raise JoinedLate(f"replaying the rounds it missed failed: {problem}")
        data: Any = self.outer.data
        for kept in self.kept:
            path = self.folder / str(kept.outer_step)
            self.outer.apply_update(Entry.decode(path.read_bytes()).update)
            if data is not None and kept.consumed is not None:
                data.commit(kept.consumed, kept.members)  # as the members moved them
        self.close()

    def close(self) -> None:
        """Done (caught up or given up): the outer step stops listening; files go."""
        self.outer.listener = None
        if self.record.holder is not None:
            self.record.holder.first = self.count + 1  # nothing older is needed any more
        shutil.rmtree(self.folder, ignore_errors=True)


def empty_round(run: Run, step: int, end: int) -> None:
    """A listener's inner steps `step`+1..`end`, trained as the members train theirs (the
    result is dropped: `enter` zeroes its pseudo-gradient), so that it reaches the next sync
    point when they do."""
    for s in range(step + 1, end + 1):
        run.inner_step(s)
