"""Joining a running job through live checkpoint recovery (a new node, or one that died).

A node that finds live members when it starts registers *waiting* (see `Membership.join`):
the members never wait for it. Here it fetches their state and enters:

1. While a node waits, every member checkpoints at each outer boundary
   (`Membership.joiners_waiting`, checked by the loop), so a donor's newest checkpoint holds
   the outer weights and momentum the members start the current round from.
2. The joiner notes the donor's newest step when it starts, and waits for a newer one: that
   one was made at a boundary after it registered, so it is the current round's start.
3. It fetches that checkpoint (`prime_ckpt.fetch_from_peer`: verified, resumable) into its own
   checkpoint folder, beside its older ones (nothing is removed before it verifies), and
   loads it. If the donor made a newer one meanwhile it fetches again, then says `ready()`.
4. The members admit it at their next sync point, the end of that round. The joiner takes
   its entry outer step at once: its model equals the outer weights it loaded, so its
   pseudo-gradient is zero; the members average over the nodes that contributed (the
   header in `Diloco._average`), and all apply the same update to the same outer weights:
   the same bits everywhere. The header also compares outer step counts: a joiner admitted
   a round late (its fetch outlasted a round) leaves with `JoinedLate` instead of diverging.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prime_train.diloco.membership import Membership
from prime_train.metrics import Log
from prime_train.rundir import RunDirError

JOIN_TIMEOUT_S = 600.0  # the longest a joiner waits for a donor's fresh checkpoint
POLL_S = 0.2


class JoinFailed(RunDirError):
    """No member could give this node the run's state in time."""


def _newest(urls: list[str], token: str | None) -> int | None:
    """The newest step any of `urls` offers (None: none offers one yet)."""
    from prime_ckpt import PeerError, ask_donors, resolve_token

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


def fetch_members_state(membership: Membership, ckpt_dir: Path, log: Log) -> dict[str, Any]:
    """Steps 2 and 3 of the module doc, on the node's local rank 0: returns what was fetched
    (`step`, `donor`, `bytes`, `seconds`)."""
    from prime_ckpt import PeerError, fetch_from_peer, step_dirname

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
    return {"step": step, "donor": donor, "bytes": size, "seconds": seconds}
