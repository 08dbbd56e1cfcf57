"""A joiner catching up from its snapshot to the members: fetch the committed updates since
(the members' update logs, `diloco/replay_log.py`) and replay them, checking the hash.

- `Holder`, on the node's local rank 0 while it joins: asks every donor, every few seconds, to
  keep the log entries from a given outer step on (the checkpoint server's side-file holds),
  so the entries it still needs are not pruned while it fetches. A joiner that dies stops
  renewing and the hold lapses after the server's lease.
- `fetch_entries`, on local rank 0: which entries after outer step S the donors offer, and
  the download of all of them (every local rank's), spread over the donors that have them
  (the entries are bit-identical on every member); `stale` when the log no longer reaches S.
- `replay_fetched`, on every local rank: apply its own entries in order (`Diloco.replay`),
  each checked against the members' hash (`on_primary`: a step run on local rank 0 only,
  its result handed to every local rank).
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from prime_ckpt import PeerError, fetch_side_file, list_side_files
from prime_train.diloco.membership import Membership
from prime_train.diloco.replay_log import BadEntry, Entry, entry_key, entry_name, parse_name

if TYPE_CHECKING:
    from prime_train.diloco.join_state import Joining
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep

RENEW_S = 10.0  # hold renewals (the server's lease is 120 s)
TIMEOUT_S = 20.0  # every connect and read of a listing or entry


class Holder:
    """Keeps the donors' log entries from outer step `.first` on while it runs (module doc)."""

    def __init__(self, membership: Membership, first: int = 0):
        """`first`: the outer step from which on entries are held (0: all the donors have)."""
        self.membership, self.first = membership, first
        self._stop = threading.Event()
        self._held: set[tuple[str, str]] = set()  # (url, name) holds asked for
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="prime-join-hold", daemon=True)

    def __enter__(self) -> Holder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S + 5)
        for url, name in self._held:  # done: the donors may prune again (else a lease later)
            try:
                list_side_files(url, self.membership.token, 5.0, release=name)
            except PeerError:
                pass

    def renew(self) -> None:
        """Ask every donor now (failures are the next renewal's)."""
        with self._lock:
            self._renew()

    def _renew(self) -> None:
        for _, url in self._donors():
            name = self.name
            try:
                list_side_files(url, self.membership.token, TIMEOUT_S, hold=name)
            except PeerError:
                continue
            for old in [h for h in self._held if h[0] == url and h[1] != name]:
                try:  # the hold moved on: drop the older one
                    list_side_files(url, self.membership.token, TIMEOUT_S, release=old[1])
                    self._held.discard(old)
                except PeerError:
                    pass
            self._held.add((url, name))

    @property
    def name(self) -> str:
        return entry_name(max(self.first, 0), 0)

    def _donors(self) -> list[tuple[str, str]]:
        try:
            return self.membership.donors()
        except Exception:  # the coordinator is briefly away: the next renewal asks again
            return []

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.renew()
            self._stop.wait(RENEW_S)


@dataclass
class Fetched:
    """What `fetch_entries` got: the outer steps after S it downloaded, in order, into
    `folder`; `stale`: the log no longer reaches S (take a newer snapshot)."""

    outer_steps: list[int] = field(default_factory=list)
    stale: bool = False
    bytes: int = 0
    seconds: float = 0.0
    donors: set[str] = field(default_factory=set)


def fetch_entries(
    membership: Membership,
    after: int,
    ranks: int,
    folder: Path,
    until: int | None = None,
    one_at_a_time: bool = False,
) -> Fetched:
    """Download every local rank's entries of the outer steps after `after` that the donors
    offer (all of them, or up to `until`) into `folder`; see `Fetched`. `one_at_a_time`: one
    download at a time (still spread over the donors), for a joiner already in the members'
    all-reduce: its link then carries at most one donor's capped rate beside it."""
    t0 = time.monotonic()
    token = membership.token
    offers: dict[int, list[tuple[str, str]]] = {}  # outer step -> donors with every rank's
    for node_id, url in membership.donors():
        try:
            names = list_side_files(url, token, TIMEOUT_S)
        except PeerError:
            continue
        have: dict[int, set[int]] = {}
        for name in names:
            parsed = parse_name(name)
            if parsed is not None:
                have.setdefault(parsed[0], set()).add(parsed[1])
        for outer, got in have.items():
            if outer > after and got >= set(range(ranks)):
                offers.setdefault(outer, []).append((node_id, url))
    if not offers:
        return Fetched(seconds=time.monotonic() - t0)
    if after + 1 not in offers:  # pruned past our snapshot, or never written
        return Fetched(stale=True, seconds=time.monotonic() - t0)
    steps = []
    for outer in range(after + 1, max(offers) + 1):
        if outer not in offers or (until is not None and outer > until):
            break
        steps.append(outer)
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(o, r) for o in steps for r in range(ranks)]
    used: set[str] = set()

    def get(i_job: tuple[int, tuple[int, int]]) -> int:
        i, (outer, rank) = i_job
        donors = offers[outer]
        errors = []
        for k in range(len(donors)):  # start at a different donor for each entry
            node_id, url = donors[(i + k) % len(donors)]
            name = entry_name(outer, rank)
            try:
                data = fetch_side_file(url, name, token, TIMEOUT_S)
                Entry.decode(data, entry_key(token))  # a torn, corrupt or forged one: refused
            except (PeerError, BadEntry) as e:
                errors.append(f"{node_id}: {e}")
                continue
            (folder / name).write_bytes(data)
            used.add(node_id)
            return len(data)
        raise PeerError(f"no donor could give {name}: {'; '.join(errors)}")

    n_donors = len({d for ds in offers.values() for d in ds})
    workers = 1 if one_at_a_time else max(1, n_donors)
    with ThreadPoolExecutor(workers, thread_name_prefix="prime-join-entries") as pool:
        try:
            sizes = list(pool.map(get, enumerate(jobs)))
        except PeerError:  # an entry went missing meanwhile (pruned): keep what came before
            sizes = []
            steps = [o for o in steps if all((folder / entry_name(o, r)).is_file()
                                             for r in range(ranks))]  # fmt: skip
            steps = [o for i, o in enumerate(steps) if o == after + 1 + i]
            if not steps:
                return Fetched(stale=True, seconds=time.monotonic() - t0)
    total = sum(sizes) or sum(
        (folder / entry_name(o, r)).stat().st_size for o in steps for r in range(ranks)
    )
    return Fetched(steps, False, total, time.monotonic() - t0, used)


def read_entry(folder: Path, outer_step: int, rank: int, key: bytes) -> Entry:
    """A fetched entry (checked again: it was written by this process, but disks fail)."""
    return Entry.decode((folder / entry_name(outer_step, rank)).read_bytes(), key)


def log_key(run: Run) -> bytes:
    """The key of this run's update-log entries (`replay_log.entry_key` of its token)."""
    token = run.cfg.mesh.token
    return entry_key(token.get_secret_value() if token else None)


def on_primary(run: Run, fn):
    """`fn()` on the node's local rank 0, its result on every local rank."""
    got = [fn() if run.primary else None]
    if run.placement.world_size > 1:
        dist.broadcast_object_list(got, src=0, group=run.placement.group)
    return got[0]


def replay_fetched(
    run: Run, outer: ElasticOuterStep, joining: Joining, got: Fetched, folder: Path, t0: float
) -> str | None:
    """Every local rank replays its fetched entries (`got`, in `folder`); None when all
    matched the members' hashes (the join's row then counts them), else the first mismatch."""
    ranks, rank = run.placement.world_size, run.placement.rank
    problem, last = None, None
    for o in got.outer_steps:
        entry = read_entry(folder, o, rank, log_key(run))
        problem = outer.replay(entry)
        if problem is not None:
            break
        last = entry
    problems = [problem]
    if ranks > 1:
        problems = [None] * ranks
        dist.all_gather_object(problems, problem, group=run.placement.group)
    problem = next((p for p in problems if p), None)
    if run.primary:
        shutil.rmtree(folder, ignore_errors=True)
    if problem is not None:
        return problem
    assert last is not None
    outer.replayed(last.outer_sha256)
    row = joining.row
    row.replayed += len(got.outer_steps)
    row.replay_bytes += got.bytes
    row.replay_seconds += time.monotonic() - t0
    row.replay_donors = sorted(set(row.replay_donors) | got.donors)
    joining.step = last.step
    outer.restore_shared(last.shared)
    return None
