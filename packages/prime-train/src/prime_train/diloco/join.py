"""Joining a running job through live checkpoint recovery, start to finish: register, fetch,
load, enter. A new node, one restarted after it died, and one rejoining by itself after it lost
its membership (`diloco/rejoin.py`) all take this path.

1. Register (`diloco.membership.register`, while the placement is built, before the model:
   the node's index comes from it): a node that finds live members registers *waiting*
   (`Membership.join`): the members never wait for it.
2. While a node waits, every member checkpoints at each outer boundary (the outer step's
   `joiners_waiting`, checked by the loop), so a donor's newest checkpoint holds the outer
   weights and momentum the members start the current round from.
3. Fetch (`fetch_members_state`, on the node's local rank 0): the joiner notes the donor's
   newest step when it starts, and waits for a newer one: that one was made at a boundary
   after it registered, so it is the current round's start. It fetches that checkpoint
   (`prime_ckpt.fetch_from_peer`: verified, resumable) into its own checkpoint folder, beside
   its older ones (nothing is removed before it verifies). If the donor made a newer one
   meanwhile it fetches again.
4. Load (`load_members_state`): every local rank loads it and the node says `ready()`.
5. Enter (`enter_running_job`): the members admit it at their next sync point, the end of that
   round. The joiner takes its first round at once (the outer step's `enter`): its model
   equals the outer weights it loaded, so its pseudo-gradient is zero; the members average
   over the nodes that contributed, and all apply the same update to the same outer weights:
   the same bits everywhere. A joiner admitted a round late (its fetch outlasted a round)
   leaves with `JoinedLate` instead of diverging.

What happened is one typed record, `JoinRecord`, logged and written as the entry's metrics row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from prime_ckpt import PeerError, ask_donors, fetch_from_peer, resolve_token, step_dirname
from prime_train.diloco.membership import Membership
from prime_train.metrics import Log
from prime_train.rundir import RunDirError
from prime_train.seam import ElasticOuterStep

if TYPE_CHECKING:
    from prime_train.run import Run

JOIN_TIMEOUT_S = 600.0  # the longest a joiner waits for a donor's fresh checkpoint
POLL_S = 0.2


class JoinFailed(RunDirError):
    """No member could give this node the run's state in time."""


@dataclass
class JoinRecord:
    """What a joiner fetched and loaded: the members' checkpoint of inner step `step`."""

    step: int
    donor: str | None
    bytes: int
    seconds: float  # fetching
    load_seconds: float = 0.0
    rejoined: int | None = None  # the how-manieth rejoin by itself (None: a fresh join)


def _newest(urls: list[str], token: str | None) -> int | None:
    """The newest step any of `urls` offers (None: none offers one yet)."""
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


def fetch_members_state(membership: Membership, ckpt_dir: Path, log: Log) -> JoinRecord:
    """Step 3 of the module doc, on the node's local rank 0: what was fetched."""
    token = membership.token
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    baseline: int | None = None
    baseline_known = False
    while True:
        donors = membership.donors()
        if donors:
            urls = [u for _, u in donors]
            newest = _newest(urls, token)
            if not baseline_known:
                baseline, baseline_known = newest, True
                log.info(
                    f"joining a running job: {len(donors)} member(s); waiting for a checkpoint "
                    f"newer than step {baseline} (made at an outer boundary while this node waits)"
                )
            elif newest is not None and (baseline is None or newest > baseline):
                break
        if baseline_known and not donors:
            raise JoinFailed(
                "the running job's members left (finished or died) before this node could "
                "fetch their state; rerun the same command to resume with the others"
            )
        if time.monotonic() > deadline:
            raise JoinFailed(
                f"no member offered a fresh checkpoint within {JOIN_TIMEOUT_S:.0f} s "
                f"(members: {[n for n, _ in donors] or 'none'}); check that the members run and "
                "that their checkpoint servers are reachable from this machine"
            )
        time.sleep(POLL_S)

    t0 = time.monotonic()
    step, donor, errors = None, None, []
    for _ in range(3):  # the donor made a newer checkpoint meanwhile: fetch that one
        for node_id, url in _newest_first(membership.donors(), token):
            try:
                step = fetch_from_peer([url], ckpt_dir, token=token)
                donor = node_id
                break
            except (PeerError, OSError) as e:  # this donor died or refused: the next one
                errors.append(f"{node_id}: {e}")
        if step is None:
            raise JoinFailed(f"fetching the members' checkpoint failed: {'; '.join(errors)}")
        newer = _newest([u for _, u in membership.donors()], token)
        if newer is None or newer <= step:
            break
    seconds = time.monotonic() - t0
    size = _folder_bytes(ckpt_dir / step_dirname(step))
    return JoinRecord(step=step, donor=donor, bytes=size, seconds=seconds)


def load_members_state(
    run: Run, outer: ElasticOuterStep, rejoined: int | None = None
) -> JoinRecord:
    """Steps 3 and 4: fetch a member's fresh checkpoint into this node's folder and load it
    (every local rank), then say `ready()`. `rejoined`: the count, for a rejoin by itself."""
    membership = run.placement.membership
    assert membership is not None and membership.joining
    got: list[JoinRecord | None] = [None]
    if run.primary:
        got[0] = fetch_members_state(membership, run.ckpt_dir, run.log)
    if run.placement.world_size > 1:
        dist.broadcast_object_list(got, src=0, group=run.placement.group)
    record = got[0]
    assert record is not None
    record.rejoined = rejoined
    t = time.monotonic()
    run.load(record.step, outer)
    run.loader.forget_own()  # the members' shared data positions, none of the donor's reads
    record.load_seconds = time.monotonic() - t
    membership.mesh.ready()
    mbps = record.bytes / 1e6 / record.seconds if record.seconds else float("inf")
    run.log.info(
        f"fetched the step-{record.step} checkpoint from {record.donor}: "
        f"{record.bytes / 1e6:.2f} MB in {record.seconds:.2f} s ({mbps:.1f} MB/s), "
        f"loaded in {record.load_seconds:.2f} s; ready, admitted at the members' next "
        "outer step"
    )
    return record


def enter_running_job(run: Run, outer: ElasticOuterStep, record: JoinRecord) -> int:
    """Step 5: the joiner's first round, ending where the members' round that started from
    the loaded checkpoint ends; returns the step it continues from."""
    step = min(outer.round_end(record.step), run.cfg.train.steps)
    report = outer.enter(step)
    run.log.info(
        ("re" if record.rejoined else "")
        + f"entered the running job at outer step {report.outer_step if report else '?'} "
        f"(step {step}), donor {record.donor}: {record.bytes / 1e6:.2f} MB "
        f"fetched in {record.seconds:.2f} s"
    )
    run.metrics.write(
        {
            "step": step,
            "joined": True,
            "donor": record.donor,
            "fetched_step": record.step,
            "fetch_bytes": record.bytes,
            "fetch_seconds": record.seconds,
            "load_seconds": record.load_seconds,
            **({"rejoined": record.rejoined} if record.rejoined else {}),
        }
    )
    run.progress["step"] = step
    return step
