"""Training batches drawn from fixed data slots, with positions that only committed rounds move.

The run's training sequences are cut into `S = [data] slots` disjoint slots at sequence
granularity: slot s holds sequences s, s + S, s + 2S, ... (the same `N // S` of them in every
slot). Each slot is read in a fixed order, a new shuffle per pass seeded by (seed, slot, pass),
and its *position* counts the sequences consumed from it since the run began, across passes.

Shared state (every member holds the same, checkpointed, handed to joiners): each slot's
committed position, its owner (`slots.assign_slots`), from which settled round its owner may
read it, and how many rounds have settled. A node's own state: how far it has read each slot
(`cursor`, ahead of the committed position by what is not counted yet).

A round: the node's ranks read batches across the node's readable slots in turn (item i of
the round -> slot `mine[(start + i) % k]`, the next unread sequence of it), each rank its own
contiguous share of every step, so each slot's reads in a round are one contiguous range. The
turn goes on across rounds (`start` follows the last slot read: the node's own `next_slot`), so
a node that reads r < k sequences a round still moves every slot it holds at least every
ceil(k / r) rounds; starting each round at its first slot would starve the others for good. At
the outer step the node sends how far it read past the committed positions (`uncommitted`);
the members sum those vectors in the outer step's exact header, and a committed round moves
each slot's position by the sum (one reader per slot: its reads). A contribution that is not
counted (a node killed mid-round, a joiner's entry round) moves nothing, and the next reader
of the slot starts at its committed position.

With `overlap = "delayed"` a round is settled one round late, while the next one reads: a slot
handed to another node becomes readable to it one settled round later (`lag = 1`), once the
previous owner's last reads of it are settled; reads of a dropped round on a slot the node
still holds are sent again with the next round (their update is lost, they are not re-read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from prime_train.data import Sequences
from prime_train.slots import assign_slots, slots_of, too_many_readers
from prime_train.tokens import DataError


class SlotLoader:
    """Batches of `batch_size` sequences for local rank `rank` of a node of `ranks` ranks named
    `name`, drawn across the node's data slots (see the module doc)."""

    def __init__(
        self,
        data: Sequences,
        batch_size: int,
        slots: int,
        name: str,
        rank: int = 0,
        ranks: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        lag: int = 0,
    ):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} outside 0..{ranks - 1}")
        self.per_slot = len(data) // slots
        if self.per_slot < 1:
            raise DataError(
                f"too little data: {len(data)} sequences of {data.seq_len + 1} tokens for "
                f"data.slots = {slots}; add text, or lower data.slots / data.seq_len"
            )
        self.data, self.batch_size, self.slots, self.name = data, batch_size, slots, name
        self.rank, self.ranks, self.seed, self.shuffle, self.lag = rank, ranks, seed, shuffle, lag
        # shared
        self.positions = [0] * slots
        self.owners: list[str | None] = [None] * slots
        self.readable_from = [0] * slots
        self.settled = 0
        # this node's own
        self.cursor: dict[int, int] = {}
        self.count = 0  # sequences the node read this round (all ranks)
        self.next_slot = 0  # the slot the next round's turn starts at (or the next one held)
        self.mine: list[int] = []
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    # -- reading ----------------------------------------------------------------------------

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(inputs, targets), each (batch_size, seq_len) int64; None when the node holds no
        readable slot this round (a joiner waiting for its slots in a delayed run)."""
        if not self.mine:
            return None
        first = self.count + self.rank * self.batch_size
        seqs = torch.stack([self.data[self._item(first + j)] for j in range(self.batch_size)])
        self.count += self.ranks * self.batch_size
        return seqs[:, :-1], seqs[:, 1:]

    def _start(self) -> int:
        """Where in `mine` this round's turn starts: at `next_slot`, or the next slot held."""
        return next((j for j, s in enumerate(self.mine) if s >= self.next_slot), 0)

    def _item(self, i: int) -> int:
        """Dataset index of the round's item `i`."""
        k = len(self.mine)
        slot = self.mine[(self._start() + i) % k]
        return self.index(slot, self.cursor[slot] + i // k)

    def index(self, slot: int, position: int) -> int:
        """Dataset index of the sequence at `position` of `slot` (positions run across passes)."""
        pass_, k = divmod(position, self.per_slot)
        if self.shuffle:
            cached = self._perms.get(slot)
            if cached is None or cached[0] != pass_:
                perm = np.random.default_rng([self.seed, slot, pass_]).permutation(self.per_slot)
                cached = self._perms[slot] = (pass_, perm)
            k = int(cached[1][k])
        return slot + self.slots * k

    def _read_in_round(self, j: int) -> int:
        """Sequences of the round's slot `mine[j]` read so far this round."""
        k = len(self.mine)
        return self.count // k + ((j - self._start()) % k < self.count % k)

    # -- rounds -----------------------------------------------------------------------------

    def end_round(self) -> None:
        """The round's reads are done: fold them into the cursor."""
        for j, slot in enumerate(self.mine):
            self.cursor[slot] += self._read_in_round(j)
        if self.mine:
            self.next_slot = self.mine[(self._start() + self.count) % len(self.mine)]
        self.count = 0

    def uncommitted(self) -> list[int]:
        """Per slot, the sequences this node read that no committed round counts yet."""
        out = [0] * self.slots
        for slot, at in self.cursor.items():
            out[slot] = at - self.positions[slot]
        return out

    def commit(self, consumed: Sequence[float], members: Sequence[str]) -> dict[str, list[int]]:
        """A round settled with these counted reads (`consumed`: per slot, summed over the
        contributors) and these `members`: move the positions, re-assign the slots. Returns
        this node's counted reads, `{slot: [from, to)}` (empty when it sent none)."""
        sent = self.uncommitted()  # (with overlap, also the reads of the round now running)
        mine: dict[str, list[int]] = {}
        for slot in range(self.slots):
            n = round(float(consumed[slot]))
            if n and sent[slot]:  # one reader per slot: these are this node's reads
                if n > sent[slot]:
                    raise RuntimeError(
                        f"data slot {slot}: this node read {sent[slot]} sequences but the "
                        f"round counted {n}: two nodes read the same slot (a bug; please "
                        "report it)"
                    )
                mine[str(slot)] = [self.positions[slot], self.positions[slot] + n]
            self.positions[slot] += n
        self.settled += 1
        self.reassign(members)
        return mine

    def drop(self) -> None:
        """A round settled without a commit (delayed mode): nothing moves; reads of slots this
        node no longer holds are forgotten (their next reader starts at the position)."""
        self.settled += 1
        self._begin_round(forget_lost=True)

    def reassign(self, members: Sequence[str]) -> None:
        """Give the slots to `members` (`slots.assign_slots`); a slot changing hands becomes
        readable `lag` settled rounds later (at once if it never had an owner).

        More members than slots is refused when the run forms (TooManyReaders); later (a
        joiner got in anyway) the extra nodes, by name, hold no slot: they read nothing and
        contribute nothing, and the run goes on."""
        names = sorted(set(members))
        if len(names) > self.slots:
            if all(o is None for o in self.owners):
                raise too_many_readers(len(names), self.slots)
            holders = [n for n in names if n in self.owners]
            names = (holders + [n for n in names if n not in holders])[: self.slots]
        new = assign_slots(self.owners, names)
        if new != self.owners and self.count:  # reads under the old assignment end here
            self.end_round()
        for slot, (old, now) in enumerate(zip(self.owners, new, strict=True)):
            if old != now:
                self.readable_from[slot] = self.settled + (self.lag if old is not None else 0)
        self.owners = list(new)
        self._begin_round()

    def _begin_round(self, forget_lost: bool = False) -> None:
        """The slots this node reads in the next round; the cursors it keeps (reads not
        counted yet, also of a slot it just handed over: they go with the next round, unless
        `forget_lost`)."""
        held = slots_of(self.owners, self.name)
        self.mine = [s for s in held if self.readable_from[s] <= self.settled]
        keep = {
            s: at
            for s, at in self.cursor.items()
            if at > self.positions[s] and (s in held or not forget_lost)
        }
        keep.update({s: max(self.positions[s], keep.get(s, 0)) for s in self.mine})
        self.cursor = keep

    def forget_own(self) -> None:
        """Drop this node's own reads (a node that loaded another member's state)."""
        self.cursor, self.count = {}, 0
        self._begin_round(forget_lost=True)

    # -- state ------------------------------------------------------------------------------

    def shared_state(self) -> dict[str, Any]:
        """What every member holds alike: positions, owners, readability, settled rounds."""
        return {
            "slots": self.slots,
            "positions": list(self.positions),
            "owners": list(self.owners),
            "readable_from": list(self.readable_from),
            "settled": self.settled,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.shared_state(),
            # a list of fixed length (-1: no read pending), so every node's state has the same
            # keys: a checkpoint loads strictly into another node's state (a joiner's)
            "cursor": [self.cursor.get(s, -1) for s in range(self.slots)],
            "count": self.count,
            "next_slot": self.next_slot,
        }

    def load_shared(self, shared: dict[str, Any]) -> None:
        """Take the members' shared state (`shared_state()` of a member) and none of their
        own reads: a node catching up to them."""
        self.load_state_dict({**shared, "cursor": [-1] * self.slots, "count": 0, "next_slot": 0})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "slots" not in state:
            raise DataError(
                "this checkpoint's data position is from before data slots (prime-train "
                "< 0.x): it cannot resume with exactly-once data; start the run afresh"
            )
        if int(state["slots"]) != self.slots:
            raise DataError(
                f"the checkpoint was made with data.slots = {state['slots']} but the config "
                f"says {self.slots}; use the run's value"
            )
        self.positions = [int(p) for p in state["positions"]]
        self.owners = list(state["owners"])
        self.readable_from = [int(r) for r in state["readable_from"]]
        self.settled = int(state["settled"])
        self.cursor = {s: int(at) for s, at in enumerate(state["cursor"]) if int(at) >= 0}
        self.count = int(state.get("count", 0))
        self.next_slot = int(state.get("next_slot", 0))
        self._begin_round()
