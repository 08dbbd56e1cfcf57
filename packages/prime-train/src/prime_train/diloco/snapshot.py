"""A joiner's snapshot: the members' newest checkpoint, fetched in the background while it
listens (`Background`, on the node's local rank 0, paced by `LinkGate`), loaded when it is in
(`load_snapshot`), and what a joiner does when the members leave meanwhile (`members_left`).
The whole join: `diloco/join.py`.

The snapshot comes from every member at once (`prime_ckpt.fetch_checkpoint`): what all
members hold alike (`shared_tensors`: the outer weights and momentum, and in synchronous runs
the model weights, which equal the outer weights at a boundary) from all of them, each under
its own serving cap; what is a node's own (inner optimizer moments, RNG, error-feedback
residual, data positions) from one of them, the *primary*, whose checkpoint it is. A donor that
dies mid-transfer is replaced by the others; if it was the primary, another member's
checkpoint of the same step is taken, keeping the shared bytes already in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_ckpt import PeerError, ask_donors, fetch_checkpoint, resolve_token, step_dirname
from prime_mesh import RunCompleted
from prime_train.diloco.membership import Membership
from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_train.config import MeshConfig
    from prime_train.diloco.join_state import Joining
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep

JOIN_TIMEOUT_S = 600.0  # the longest a joiner waits for a donor's (fresh) checkpoint
POLL_S = 0.2
# Range requests of 1 MiB: small enough that a tensor's bytes spread over every donor (the
# request overhead is hidden by the parallel connections)
CHUNK_BYTES = 1 << 20
OUTER_STATE = ("diloco", "outer")  # outer weights and momentum: alike on every member


def shared_tensors(overlap: str) -> list[tuple]:
    """The checkpoint's tensors every member holds alike at an outer boundary: the outer
    state, and with synchronous rounds the model weights (set to the outer weights at each
    boundary; with `overlap = "delayed"` each node's model has trained on)."""
    return [OUTER_STATE] if overlap == "delayed" else [OUTER_STATE, ("model",)]


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
    membership: Membership,
    ckpt_dir: Path,
    newer_than: int | None,
    shared: list[tuple],
    gate: LinkGate,
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


def members_left(membership: Membership, since: float) -> Exception | None:
    """No member serves since `since`: RunCompleted when the coordinator says the run is
    complete (exit 0), JoinFailed once that lasted `MEMBERS_GONE_S` (a brief gap is a
    coordinator re-forming the run); None: wait on."""
    if membership.run_completed():
        return RunCompleted(
            "the run completed while this node waited to join (its members finished every step)"
        )
    if time.monotonic() - since > MEMBERS_GONE_S:
        return JoinFailed(
            f"the running job's members left (finished or died) and none came back within "
            f"{MEMBERS_GONE_S:.0f} s while this node waited to join; rerun the same command "
            "to resume with the others"
        )
    return None


HOLD_MAX_S = 10.0  # the longest a held snapshot waits per read (a donor drops a silent reader)


class LinkGate:
    """A listener's snapshot yields the link to the round's collective and keeps under a cap:
    the listener holds the gate (`held`) from its sync point until the round's all-reduce is
    done, and the fetch's reads wait meanwhile (`wait`, each at most `HOLD_MAX_S`), and
    otherwise keep to `bytes_per_s` (None: no cap). Its reads are small and its receive window
    too (`prime_ckpt.fetch_checkpoint`'s `pace`), so its donors stop sending within a fraction
    of a second: the all-reduce has the joiner's link, and each donor's uplink, to itself,
    and the snapshot takes (most of) the link while the members compute."""

    def __init__(self, bytes_per_s: float | None = None) -> None:
        self.rate = bytes_per_s
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the cap lets the next read start
        self.held_seconds = 0.0  # held so far, in all

    def wait(self, n: int) -> None:
        """Before each read of `n` bytes of the snapshot: wait while the gate is held, then
        for the cap (shared by every connection)."""
        self._open.wait(HOLD_MAX_S)
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The round's collective runs: the snapshot waits."""
        self._open.clear()
        t = time.monotonic()
        try:
            yield
        finally:
            self._open.set()
            self.held_seconds += time.monotonic() - t
            with self._lock:  # no burst to make up for the time held
                self._next = max(self._next, time.monotonic())


class Background:
    """A listener's snapshot, fetched on local rank 0 in the background while it listens:
    the members' first checkpoint newer than `baseline` (the newest they offered before it
    said ready, so one made at the boundary that admitted it, or later), from every member at
    once (each at its serving cap), holding off while the round's collective runs (`gate`,
    held by the listener): the snapshot has the joiner's link while the members compute, the
    all-reduce has it the rest of the round. (Taking it from both donors without holding
    off filled a 2 Mbit/s link and timed the all-reduce out; one donor at a time without
    holding off still doubled the members' all-reduce.) `.got` once in, `.failed` (why) if
    not."""

    def __init__(
        self,
        membership: Membership,
        ckpt_dir: Path,
        shared: list[tuple],
        bytes_per_s: float | None = None,
    ):
        """`bytes_per_s`: the cap on the fetch (None: none), see `LinkGate`."""
        self.got: Snapshot | None = None
        self.failed: BaseException | None = None
        self.gate = LinkGate(bytes_per_s)
        self.baseline = _newest([u for _, u in membership.donors()], membership.token)
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


def fetch_rate(mesh: MeshConfig) -> float | None:
    """A listener's cap on its snapshot's fetch, bytes/s (None: none): `mesh.fetch_mbit`, by
    default 2 x `mesh.serve_mbit` (the whole link when the donors serve at half of it)."""
    mbit = mesh.fetch_mbit if mesh.fetch_mbit is not None else 2 * mesh.serve_mbit
    return mbit * 1e6 / 8 or None
