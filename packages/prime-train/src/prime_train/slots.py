"""Which node reads which data slot: a stable, balanced assignment every node computes alike.

The training sequences are cut into `[data] slots` disjoint slots (see `slot_loader.py`). At
each committed outer step every member computes the next assignment from the same inputs -
the previous one (in the committed state every member holds) and the members of the group
that committed (in rank order, the same on every member) - so no coordinator round trip and
no message carries it, and a joiner computes it from the state it loaded.

Rules (`assign_slots`): every slot gets exactly one member; loads differ by at most one; a
member keeps the slots it holds while membership does not change (a balanced assignment is a
fixed point); a member that left gives its slots to the others; a joiner takes slots from the
most loaded members; a slot whose last holder comes back goes back to it when it is free.
"""

from __future__ import annotations

from collections.abc import Sequence

from prime_train.errors import ConfigError


class TooManyReaders(ConfigError):
    """More nodes than data slots: some node would read nothing, or two the same slot."""


def too_many_readers(nodes: int, slots: int) -> TooManyReaders:
    return TooManyReaders(
        f"{nodes} nodes but data.slots = {slots}: each node needs a data slot of its own; "
        f"start the run with --data.slots of at least {nodes} (part of the run's config: "
        "every node must use the same value)"
    )


def assign_slots(previous: Sequence[str | None], members: Sequence[str]) -> list[str]:
    """The next owner of each slot, given each slot's `previous` owner (a name, None for a
    slot never held) and the current `members` (node names). See the module doc."""
    slots, names = len(previous), sorted(set(members))
    if not names:
        raise ValueError("no members to assign data slots to")
    if len(names) > slots:
        raise too_many_readers(len(names), slots)
    held: dict[str, list[int]] = {n: [] for n in names}
    for s, owner in enumerate(previous):
        if owner in held:
            held[owner].append(s)
    base, extra = divmod(slots, len(names))
    # the `extra` members allowed one more slot: those holding most now (then by name), so a
    # balanced assignment stays as it is
    ranked = sorted(names, key=lambda n: (-len(held[n]), n))
    quota = {n: base + (i < extra) for i, n in enumerate(ranked)}
    owner: list[str | None] = [None] * slots
    for n in names:
        for s in held[n][: quota[n]]:  # keep the lowest-numbered ones; give the rest back
            owner[s] = n
    free = [s for s in range(slots) if owner[s] is None]
    # first a member's own former slots (a returning node gets its slots back), then the rest
    for n in names:
        need = quota[n] - sum(1 for o in owner if o == n)
        for s in [s for s in free if previous[s] == n][:need]:
            owner[s] = n
            free.remove(s)
    for n in names:
        need = quota[n] - sum(1 for o in owner if o == n)
        take, free = free[:need], free[need:]
        for s in take:
            owner[s] = n
    assert not free and all(o is not None for o in owner)
    return [str(o) for o in owner]


def slots_of(owners: Sequence[str | None], name: str) -> list[int]:
    """The slots `name` holds, in slot order."""
    return [s for s, o in enumerate(owners) if o == name]
