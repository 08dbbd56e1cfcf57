"""What a joiner fetches while it listens (`diloco/listen.py`), on its local rank 0, in the
background: the members' newest checkpoint (its *snapshot*), and the committed updates after
it from their update logs (`diloco/replay_log.py`). The whole join: `diloco/join.py`.

- `Background` fetches the snapshot from every member at once (`prime_ckpt.fetch_checkpoint`):
  what all members hold alike (the outer weights and momentum, and in synchronous runs the
  model weights, which equal the outer weights at a boundary) from all of them, each under
  its own serving cap; what is a node's own (inner optimizer moments, RNG, error-feedback
  residual, data positions) from one of them, the *primary*, whose checkpoint it is. A donor
  that dies mid-transfer is replaced by the others; if it was the primary, another member's
  checkpoint of the same step is taken, keeping the shared bytes already in. `load_snapshot`
  loads it on every local rank; `members_left` says what a joiner does when the members
  leave meanwhile.
- `hold_logs` asks every donor, every few seconds, to keep the log entries from a given outer
  step on (`prime_ckpt.SideFileHold`), so those it still needs are not pruned; a joiner that
  dies stops renewing and the hold lapses after the donors' lease.
- `fetch_entries` downloads the entries after the snapshot's outer step (every local rank's),
  spread over the donors that have them (bit-identical on every member); `replay_fetched`
  applies them on every local rank (`Diloco.replay`), each checked against the members' hash.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from prime_ckpt import (
    LinkGate,
    PeerError,
    SideFileHold,
    ask_donors,
    fetch_checkpoint,
    fetch_side_file,
    list_side_files,
    resolve_token,
    step_dirname,
)
from prime_mesh import RunCompleted
from prime_train.diloco.membership import Membership
from prime_train.diloco.replay_log import BadEntry, Entry, entry_key, entry_name, parse_name
from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_train.config import Config
    from prime_train.diloco.join_state import Joining
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep

JOIN_TIMEOUT_S = 600.0  # the longest a joiner waits for a donor's (fresh) checkpoint
POLL_S = 0.2
# Range requests of 1 MiB: small enough that a tensor's bytes spread over every donor (the
# request overhead is hidden by the parallel connections)
CHUNK_BYTES = 1 << 20
OUTER_STATE = ("diloco", "outer")  # outer weights and momentum: alike on every member


class JoinFailed(RunDirError):
    """No member could give this node the run's state in time."""


@dataclass
class Snapshot:
    """A fetched checkpoint of the members: inner step `step`, its own state from `donor`."""

    step: int
    donor: str
    bytes: int
    seconds: float
    donors: dict[str, int] = field(default_factory=dict)  # node -> bytes it served
    held_seconds: float = 0.0  # of `seconds`, held while the rounds' all-reduces ran
    commit_seconds: float = 0.0  # of `seconds`, making it durable (fsync) once all was in


def _newest(urls: list[str], token: str | None) -> int | None:
    """The newest step any of `urls` offers (None: none offers one yet)."""
    if not urls:
        return None
    try:
        return max(o.step for o in ask_donors(urls, resolve_token(token), 10.0))
    except PeerError:
        return None


def _newest_first(donors: list[tuple[str, str]], token: str | None) -> list[tuple[str, str]]:
    """`(node_id, url)` donors ordered by the step each offers, newest first: a member that
    has not yet written this round's checkpoint would hand over the previous round's."""
    steps = {url: _newest([url], token) for _, url in donors}
    return sorted(donors, key=lambda d: -1 if steps[d[1]] is None else steps[d[1]], reverse=True)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def fetch_members_state(
    membership: Membership, ckpt_dir: Path, newer_than: int | None, shared: list, gate: LinkGate
) -> Snapshot:
    """On the node's local rank 0: wait (bounded) until a donor offers a checkpoint newer than
    `newer_than` that this node's folder does not hold, then fetch it from every member at
    once (`shared`: the tensors they hold alike), each read paced by `gate`."""
    token = membership.token
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    gone_since: float | None = None  # since when no member serves
    while True:
        donors = membership.donors()
        if donors:
            gone_since = None
            newest = _newest([u for _, u in donors], token)
            if (
                newest is not None
                and (newer_than is None or newest > newer_than)
                # a restarted node holds its own checkpoint of that step (its own inner state):
                # never overwritten; the members make a newer one while it waits
                and not (ckpt_dir / step_dirname(newest)).exists()
            ):
                break
        else:
            gone_since = gone_since or time.monotonic()
            error = members_left(membership, gone_since)
            if error is not None:
                raise error
        if time.monotonic() > deadline:
            raise JoinFailed(
                f"no member offered a checkpoint within {JOIN_TIMEOUT_S:.0f} s (members: "
                f"{[n for n, _ in donors] or 'none'}); check that the members run and that "
                "their checkpoint servers are reachable from this machine"
            )
        time.sleep(POLL_S)
    t0, held0 = time.monotonic(), gate.held_seconds
    got, names = _fetch_from_members(membership, ckpt_dir, shared, gate.wait)
    served: dict[str, int] = {}
    for url, n in got.bytes_by_donor.items():
        who = names.get(url, url)
        served[who] = served.get(who, 0) + n
    return Snapshot(
        step=got.step,
        donor=names.get(got.primary, got.primary),
        bytes=_folder_bytes(ckpt_dir / step_dirname(got.step)),
        seconds=time.monotonic() - t0,
        donors=served,
        held_seconds=gate.held_seconds - held0,
        commit_seconds=got.commit_seconds,
    )


def _fetch_from_members(
    membership: Membership,
    ckpt_dir: Path,
    shared: list[tuple],
    pace: Callable[[int], object] | None,
) -> tuple[Any, dict[str, str]]:
    """The newest checkpoint from every member at once (a second try with the members left,
    if that failed): (`prime_ckpt.fetch_checkpoint`'s result, url -> node id)."""
    errors = []
    for _attempt in range(2):
        donors = _newest_first(membership.donors(), membership.token)
        names = {url.rstrip("/"): node_id for node_id, url in donors}
        if not donors:
            break
        try:
            got = fetch_checkpoint(
                list(names),
                ckpt_dir,
                token=membership.token,
                # paced: one per donor, so that little is in flight when it holds
                connections=len(names) if pace else max(4, 2 * len(names)),
                chunk_bytes=CHUNK_BYTES,
                shared=shared,
                pace=pace,
            )
        except (PeerError, OSError) as e:  # every donor died or refused
            errors.append(f"{sorted(names.values())}: {e}")
            continue
        return got, names
    if not membership.donors():  # they left mid-transfer: completed, or gone
        left = members_left(membership, time.monotonic() - MEMBERS_GONE_S - 1)
        if left is not None:
            raise left
    raise JoinFailed(f"fetching the members' checkpoint failed: {'; '.join(errors)}")


MEMBERS_GONE_S = 30.0  # no member for this long: the joiner stops


def completed_meanwhile(membership: Membership) -> RunCompleted | None:
    """RunCompleted (exit 0) when the coordinator says the run's members finished it while
    this node waited to join; None otherwise."""
    if not membership.run_completed():
        return None
    return RunCompleted(
        "the run completed while this node waited to join (its members finished every step)"
    )


def members_left(membership: Membership, since: float) -> Exception | None:
    """No member serves since `since`: RunCompleted when the coordinator says the run is
    complete (exit 0), JoinFailed once that lasted `MEMBERS_GONE_S` (a brief gap is a
    coordinator re-forming the run); None: wait on."""
    if (completed := completed_meanwhile(membership)) is not None:
        return completed
    if time.monotonic() - since > MEMBERS_GONE_S:
        return JoinFailed(
            f"the running job's members left (finished or died) and none came back within "
            f"{MEMBERS_GONE_S:.0f} s while this node waited to join; rerun the same command "
            "to resume with the others"
        )
    return None


class Background:
    """A listener's snapshot, fetched on local rank 0 in the background while it listens:
    the members' first checkpoint newer than `baseline` (the newest they offered before it
    said ready: one made at the boundary that admitted it, or later), from every member at
    once, paced by `gate`, which the listener holds while each round's all-reduce runs: the
    snapshot has the joiner's link while the members compute. (Without holding off, both
    donors filled a 2 Mbit/s link and timed the all-reduce out.) `.got` once in, `.failed`
    (why) if not. Its cap: `mesh.fetch_mbit`, by default 2 x `mesh.serve_mbit` (the whole
    link when the donors serve at half of it)."""

    def __init__(self, membership: Membership, ckpt_dir: Path, cfg: Config):
        self.got: Snapshot | None = None
        self.failed: BaseException | None = None
        mesh = cfg.mesh
        mbit = mesh.fetch_mbit if mesh.fetch_mbit is not None else 2 * mesh.serve_mbit
        self.gate = LinkGate(mbit * 1e6 / 8 or None)
        self.baseline = _newest([u for _, u in membership.donors()], membership.token)
        # alike on every member at a boundary: the outer state, and with synchronous rounds
        # the model (set to the outer weights; a delayed node's model has trained on)
        shared = [OUTER_STATE] if cfg.diloco.overlap == "delayed" else [OUTER_STATE, ("model",)]
        self._args = (membership, ckpt_dir, shared)
        self._thread = threading.Thread(target=self._run, name="prime-join-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        membership, ckpt_dir, shared = self._args
        try:
            self.got = fetch_members_state(membership, ckpt_dir, self.baseline, shared, self.gate)
        except BaseException as e:  # told to the listener at its next round
            self.failed = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until the fetch ended, in or failed."""
        self._thread.join(timeout)


def load_snapshot(run: Run, outer: ElasticOuterStep, joining: Joining, got: Snapshot) -> None:
    """A listener's snapshot (`got`, fetched in the background) came: load it on every local
    rank (the data positions are the members' shared ones, none of the donor's own reads)."""
    t = time.monotonic()
    run.load(got.step, outer)
    run.loader.forget_own()
    row = joining.row
    row.load_seconds += time.monotonic() - t
    row.fetched_step, row.donor, row.snapshots = got.step, got.donor, row.snapshots + 1
    row.fetch_bytes += got.bytes
    row.fetch_seconds += got.seconds
    row.fetch_held_seconds += got.held_seconds
    row.fetch_commit_seconds += got.commit_seconds
    for who, n in got.donors.items():
        row.snapshot_donors[who] = row.snapshot_donors.get(who, 0) + n
    joining.step, joining.waiting = got.step, False
    mbps = got.bytes / 1e6 / got.seconds if got.seconds else float("inf")
    served = ", ".join(f"{n} {b / 1e6:.2f} MB" for n, b in sorted(got.donors.items()))
    run.log.info(
        f"fetched the step-{got.step} checkpoint while listening: {got.bytes / 1e6:.2f} MB "
        f"in {got.seconds:.2f} s ({mbps:.1f} MB/s; held {got.held_seconds:.2f} s for the "
        f"rounds' all-reduces, fsync {got.commit_seconds:.2f} s) from {served or got.donor} "
        f"(its own state from {got.donor}), loaded in {time.monotonic() - t:.2f} s"
    )


# The members' update logs

TIMEOUT_S = 20.0  # every connect and read of a listing or entry


def hold_logs(membership: Membership) -> SideFileHold:
    """A hold, started, on every donor's update-log entries (from the first on, until
    `hold_from(entry_name(outer_step, 0))` moves it on; see the module doc)."""

    def donors() -> list[str]:
        return [url for _, url in membership.donors()]

    return SideFileHold(donors, membership.token, entry_name(0, 0), timeout=TIMEOUT_S).__enter__()


@dataclass
class Fetched:
    """The entries `fetch_entries` downloaded: `outer_steps`, in order, every local rank's."""

    outer_steps: list[int]
    bytes: int
    seconds: float
    donors: set[str]


def _offers(membership: Membership, after: int, ranks: int) -> dict[int, list[tuple[str, str]]]:
    """outer step (after `after`) -> the `(node_id, url)` donors whose log has every rank's."""
    offers: dict[int, list[tuple[str, str]]] = {}
    for node_id, url in membership.donors():
        try:
            names = list_side_files(url, membership.token, TIMEOUT_S)
        except PeerError:
            continue
        have: dict[int, set[int]] = {}
        for parsed in filter(None, map(parse_name, names)):
            have.setdefault(parsed[0], set()).add(parsed[1])
        for outer, got in have.items():
            if outer > after and got >= set(range(ranks)):
                offers.setdefault(outer, []).append((node_id, url))
    return offers


def fetch_entries(
    membership: Membership, after: int, until: int, ranks: int, folder: Path
) -> Fetched:
    """Download every local rank's entries of outer steps `after`+1..`until` into `folder`, one
    at a time (the joiner's link carries the members' all-reduce too), each from the next donor
    that offers it (they are bit-identical on every member); PeerError when one cannot be had
    (pruned past `after`, or every donor that had it left)."""
    t0, token = time.monotonic(), membership.token
    offers = _offers(membership, after, ranks)
    folder.mkdir(parents=True, exist_ok=True)
    got = Fetched(list(range(after + 1, until + 1)), 0, 0.0, set())
    for i, (outer, rank) in enumerate((o, r) for o in got.outer_steps for r in range(ranks)):
        donors, name, errors = offers.get(outer, []), entry_name(outer, rank), []
        for k in range(len(donors)):  # start at a different donor for each entry
            node_id, url = donors[(i + k) % len(donors)]
            try:
                data = fetch_side_file(url, name, token, TIMEOUT_S)
                Entry.decode(data, entry_key(token))  # a torn, corrupt or forged one: refused
            except (PeerError, BadEntry) as e:
                errors.append(f"{node_id}: {e}")
                continue
            (folder / name).write_bytes(data)
            got.bytes += len(data)
            got.donors.add(node_id)
            break
        else:
            raise PeerError(
                f"no donor could give {name} ({'; '.join(errors) or 'none offers it: pruned'})"
            )
    got.seconds = time.monotonic() - t0
    return got


def replay_fetched(
    run: Run, outer: ElasticOuterStep, joining: Joining, got: Fetched, folder: Path, t0: float
) -> str | None:
    """Every local rank replays its fetched entries (`got`, in `folder`); None when all
    matched the members' hashes (the join's row then counts them), else the first mismatch."""
    ranks, rank = run.placement.world_size, run.placement.rank
    problem, last = None, None
    for o in got.outer_steps:
        # (checked again: this process wrote it, but disks fail)
        entry = Entry.decode((folder / entry_name(o, rank)).read_bytes(), run.log_key)
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
