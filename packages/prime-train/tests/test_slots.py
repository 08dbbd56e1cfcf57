"""Data slots: the assignment (balance, stability, hand-over) and the loader's exactly-once reads
over random join / leave / kill sequences, simulated in one process with the real SlotLoader and
the outer step's rule (a round's reads counted only for the nodes that contributed to it)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from prime_testkit.fixed_data import IndexDataset
from prime_train.slot_loader import SlotLoader
from prime_train.slots import TooManyReaders, assign_slots, slots_of
from prime_train.tokens import DataError


def check_assignment(owners: list[str], members: list[str]) -> None:
    assert set(owners) == set(members)  # every slot held by a member, every member holds one
    loads = Counter(owners)
    assert max(loads.values()) - min(loads.values()) <= 1


@pytest.mark.parametrize("seed", range(20))
def test_assignment_over_random_membership_changes(seed):
    rng = random.Random(seed)
    slots = rng.choice([4, 7, 16, 64])
    members = [f"n{i}" for i in range(rng.randint(1, min(4, slots)))]
    owners = assign_slots([None] * slots, members)
    check_assignment(owners, members)
    pool = [f"n{i}" for i in range(12)]
    for _ in range(30):
        before = list(owners)
        event = rng.choice(["join", "leave", "same"])
        if event == "join" and len(members) < slots:
            members.append(rng.choice([p for p in pool if p not in members] or ["x"]))
        elif event == "leave" and len(members) > 1:
            members.remove(rng.choice(members))
        owners = assign_slots(before, members)
        check_assignment(owners, members)
        if event == "same":  # stable: nothing moves while membership does not change
            assert owners == before
        # only what must move moves: a member keeps its slots up to its share
        base = slots // len(members)
        for m in members:
            kept = [s for s in slots_of(before, m) if owners[s] == m]
            assert len(kept) >= min(len(slots_of(before, m)), base)


def test_leaver_slots_go_to_survivors_and_a_joiner_takes_from_the_most_loaded():
    owners = assign_slots([None] * 6, ["a", "b", "c"])
    after = assign_slots(owners, ["a", "c"])
    assert [after[s] for s in slots_of(owners, "a")] == ["a"] * 2  # survivors keep theirs
    assert [after[s] for s in slots_of(owners, "c")] == ["c"] * 2
    assert sorted(Counter(after).values()) == [3, 3]
    joined = assign_slots(after, ["a", "c", "d"])
    assert Counter(joined) == {"a": 2, "c": 2, "d": 2}


def test_a_returning_node_gets_its_free_slots_back():
    owners = ["a", "a", "b", "b", "c", "c"]
    # c is gone, then back before its slots were handed on: they are free, and still its
    assert assign_slots(owners, ["a", "b", "c"]) == owners
    assert assign_slots(["a", "a", "b", "b", "c", "c"], ["c", "a", "b"]) == owners


def test_more_nodes_than_slots_is_refused():
    with pytest.raises(TooManyReaders, match="data.slots = 2"):
        assign_slots([None, None], ["a", "b", "c"])


def loader(
    name: str, slots: int, n: int = 10_000, batch: int = 3, lag: int = 0, **kw
) -> SlotLoader:
    return SlotLoader(IndexDataset(n), batch, slots, name, seed=7, lag=lag, **kw)


def test_slots_cut_the_sequences_and_a_new_pass_reshuffles_without_restarting_positions():
    ld = loader("a", slots=4, n=20, batch=5)  # 5 sequences per slot
    ld.reassign(["a"])
    seen = [int(x) for _ in range(8) for x in ld.next_batch()[0][:, 0]]  # 40: two passes
    per_slot = {s: [i for i in seen if i % 4 == s] for s in range(4)}
    for s, got in per_slot.items():
        assert sorted(got[:5]) == sorted(got[5:]) == [s + 4 * k for k in range(5)]
    ld.end_round()
    assert ld.uncommitted() == [10, 10, 10, 10]  # positions count across passes


def test_the_ranks_of_a_node_share_its_slots_without_overlap():
    ranks = [loader("a", slots=3, batch=2, rank=r, ranks=2) for r in range(2)]
    for ld in ranks:
        ld.reassign(["a"])
    reads = [[int(x) for _ in range(5) for x in ld.next_batch()[0][:, 0]] for ld in ranks]
    assert not set(reads[0]) & set(reads[1])
    for ld in ranks:
        ld.end_round()
    assert ranks[0].uncommitted() == ranks[1].uncommitted() == [7, 7, 6]  # 20 reads, 3 slots


def test_state_checks():
    ld = loader("a", slots=4)
    with pytest.raises(DataError, match="data.slots = 8"):
        ld.load_state_dict({**loader("a", slots=8).state_dict()})
    with pytest.raises(DataError, match="before data slots"):
        ld.load_state_dict({"epoch": 0, "pos": 3})
    with pytest.raises(DataError, match="too little data"):
        loader("a", slots=64, n=10)


def simulate(seed: int, rounds: int = 40, slots: int = 8) -> None:
    """Members read rounds of random length; at each boundary some die mid-round (their reads
    never count) and some join (they load a live member's state and enter contributing
    nothing). Checks that, from the counted reads of every node, each slot is one unbroken
    chain from 0 whose sequences are the ones read, each sequence is counted at most once, and
    every slot advances within a few rounds."""
    rng = random.Random(seed)
    names = iter(f"n{i}" for i in range(1000))
    live = {name: loader(name, slots) for name in (next(names) for _ in range(3))}
    for ld in live.values():
        ld.reassign(sorted(live))
    counted: dict[int, list[tuple[int, int]]] = {s: [] for s in range(slots)}
    seqs_counted: Counter[int] = Counter()
    read_by: dict[str, dict[int, list[int]]] = {n: {} for n in live}  # not counted yet
    last_moved = dict.fromkeys(range(slots), 0)
    for k in range(1, rounds + 1):
        for name, ld in live.items():  # the round's inner steps (reading every slot held)
            for _ in range(rng.randint(3, 5)):
                for i in ld.next_batch()[0][:, 0].tolist():
                    read_by[name].setdefault(i % slots, []).append(i)
        if len(live) > 1 and rng.random() < 0.3:  # one dies mid-round
            dead = rng.choice(sorted(live))
            del live[dead], read_by[dead]
        joiners = []
        if len(live) < slots - 1 and rng.random() < 0.3:  # one enters with the state it loaded
            name, donor = next(names), live[rng.choice(sorted(live))]
            joiners.append(name)
        for ld in live.values():
            ld.end_round()
        sent = {n: ld.uncommitted() for n, ld in live.items()}
        for name in joiners:
            live[name] = loader(name, slots)
            live[name].load_state_dict(donor.state_dict())
            live[name].forget_own()
            read_by[name] = {}
            assert not any(live[name].uncommitted())
        # the outer step's exact header: the contributors' reads, summed
        consumed = [float(sum(v[s] for v in sent.values())) for s in range(slots)]
        members = sorted(live)
        for name, ld in live.items():
            for s, (a, b) in ld.commit(consumed, members).items():
                s = int(s)
                counted[s].append((a, b))
                mine = read_by[name][s][: b - a]
                assert sorted(mine) == sorted(ld.index(s, p) for p in range(a, b))
                seqs_counted.update(mine)
                read_by[name][s] = read_by[name][s][b - a :]
                last_moved[s] = k
        assert all(not rest for r in read_by.values() for rest in r.values())
        assert all(k - last_moved[s] <= 4 for s in range(slots)), (k, last_moved)
    for s, chain in counted.items():
        at = 0
        for a, b in chain:
            assert a == at, f"slot {s}: a gap or overlap at {a} (expected {at})"
            at = b
    assert max(seqs_counted.values()) == 1


@pytest.mark.parametrize("seed", range(12))
def test_exactly_once_under_random_churn(seed):
    simulate(seed)


@pytest.mark.parametrize("third_round", ["committed", "dropped"])
def test_delayed_rounds_hand_a_slot_over_only_once_its_last_reads_are_settled(third_round):
    """overlap = "delayed": round k settles at the end of round k+1 (on a joiner, its entry
    round at once). A joiner admitted at round 2's sync point takes slots from the members;
    they read those slots in round 3 still, so the joiner starts on them only once round 3
    settled, at the committed position, whether round 3 committed or was dropped."""
    slots = 4
    nodes = {n: loader(n, slots, lag=1) for n in ("a", "b")}
    for ld in nodes.values():
        ld.reassign(["a", "b"])
    read: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    rows: list[tuple[str, dict]] = []

    def read_round():
        for n, ld in nodes.items():
            for _ in range(2):
                batch = ld.next_batch()
                if batch is not None:
                    read[n] += batch[0][:, 0].tolist()

    def settle(ld, result):
        consumed, members, ok = result
        if ok:
            rows.append((ld.name, ld.commit(consumed, members)))
        else:
            ld.drop()

    def sync(members, contributors, ok=True):
        """The background round: the header's sum over the contributors."""
        sent = {n: nodes[n].uncommitted() for n in contributors}
        return [float(sum(v[s] for v in sent.values())) for s in range(slots)], members, ok

    read_round()  # round 1
    for ld in nodes.values():
        ld.end_round()
    r1 = sync(["a", "b"], ["a", "b"])
    checkpoint = nodes["a"].state_dict()  # a's checkpoint at this boundary, round 1 pending
    read_round()  # round 2
    for ld in nodes.values():
        ld.end_round()
        settle(ld, r1)
    r2 = sync(["a", "b", "c"], ["a", "b"])  # c admitted here
    c = nodes["c"] = loader("c", slots, lag=1)
    c.load_state_dict(checkpoint)
    c.forget_own()
    settle(c, r1)  # c's entry: the pending round, then its own, at once
    settle(c, r2)
    assert c.mine == []
    read_round()  # round 3: a and b still read the slots c was given
    for n in ("a", "b"):
        nodes[n].end_round()
        settle(nodes[n], r2)
    moved = slots_of(c.owners, "c")
    assert moved and not set(moved) & set(nodes["a"].mine + nodes["b"].mine + c.mine)
    r3 = sync(["a", "b", "c"], ["a", "b"], ok=third_round == "committed")
    read_round()  # round 4: nobody reads c's slots yet
    assert not read["c"]
    for ld in nodes.values():
        ld.end_round()
        settle(ld, r3)
    assert c.mine == moved
    r4 = sync(["a", "b", "c"], ["a", "b", "c"])
    read_round()  # round 5: c reads its slots from their settled positions
    for ld in nodes.values():
        ld.end_round()
        settle(ld, r4)
    r5 = sync(["a", "b", "c"], ["a", "b", "c"])
    read_round()  # round 6
    for ld in nodes.values():
        ld.end_round()
        settle(ld, r5)
    chains: dict[int, list[tuple[str, int, int]]] = {s: [] for s in range(slots)}
    for name, row in rows:
        for s, (a, b) in row.items():
            chains[int(s)].append((name, a, b))
    for s in moved:  # handed from a or b to c: one chain, c's part after the others'
        at = 0
        for _, a, b in chains[s]:
            assert a == at
            at = b
        assert chains[s][-1][0] == "c" and chains[s][0][0] != "c"
        assert nodes["c"].positions[s] == at
    if third_round == "committed":  # no sequence counted twice
        counted = [i for n in "abc" for i in read[n]]
        assert len(set(read["c"])) == len(read["c"])
        assert not set(read["c"]) & (set(read["a"]) | set(read["b"])), (read, chains)
        assert len(counted) == len(set(counted))


@pytest.mark.parametrize("slots,reads", [(8, 4), (8, 3), (32, 8), (5, 2)])
def test_a_node_reading_fewer_sequences_a_round_than_it_holds_slots_moves_every_slot(slots, reads):
    """A slow node (time-budgeted rounds: one step a round) reads fewer sequences than it holds
    slots; its turn goes on across rounds, so every slot moves at least every ceil(k / r)
    rounds (a round starting at the first slot would never read the last ones)."""
    ld = loader("a", slots=slots, batch=reads)
    ld.reassign(["a"])
    every = -(-slots // reads)
    last_moved = dict.fromkeys(range(slots), 0)
    for k in range(1, 4 * every + 1):
        seen = [int(x) for x in ld.next_batch()[0][:, 0]]
        assert len({i % slots for i in seen}) == reads  # one read per slot, `reads` slots
        ld.end_round()
        for s, (a, b) in ld.commit(ld.uncommitted(), ["a"]).items():
            assert b > a
            last_moved[int(s)] = k
        assert all(k - last_moved[s] < every or last_moved[s] == k for s in range(slots))
        assert max(ld.positions) - min(ld.positions) <= 1  # the turn keeps the slots level


def test_the_turn_is_part_of_the_checkpoint_and_a_joiner_starts_its_own():
    a = loader("a", slots=8, batch=3)
    a.reassign(["a"])
    a.next_batch()
    a.end_round()
    a.commit(a.uncommitted(), ["a"])
    state = a.state_dict()
    assert state["next_slot"] == 3
    resumed = loader("a", slots=8, batch=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch()[0][:, 0].tolist() == a.next_batch()[0][:, 0].tolist()
    fresh = loader("b", slots=8, batch=3)
    fresh.load_shared(a.shared_state())
    assert fresh.next_slot == 0
