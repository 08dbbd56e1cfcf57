"""Getting a node's session back after the coordinator died.

`recover` runs at a sync point (or vote) once the coordinator is lost: it retries the same
address for `coordinator_grace_s` seconds, registers with what the node knows of the run
(epoch, members, outer step and weight hash; see `prime_mesh.reform` for what the restarted
coordinator does with it), and installs the re-formed epoch. The node's inner steps went on
meanwhile: only sync points need a coordinator.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prime_mesh.epoch import Epoch
from prime_mesh.errors import CoordinatorGone, CoordinatorLost
from prime_mesh.install import install
from prime_mesh.session import Session

log = logging.getLogger("prime_mesh")

_NOTE_EVERY = 10.0  # seconds between "still waiting" lines


def recover(
    session: Session, epoch: Epoch, outer: tuple[int, str], grace: float, cause: Exception
) -> tuple[Any, Epoch]:
    """Reconnect `session` (of a member of `epoch` that lost its coordinator; `outer` is its
    last committed outer step and weight hash) to a coordinator restarted on the same address
    and install the re-formed epoch: returns its group and epoch. Raises CoordinatorGone when
    none answers within `grace` seconds, MeshEvicted when the run re-formed without this node
    (it rejoins through live recovery), MeshAuthError when the coordinator there does not
    share the token."""
    session.client.close()
    # Who the re-formed run waits for: the installed epoch's members but those a newer epoch
    # the lost coordinator pushed left out (they left or were evicted meanwhile: they do not
    # come back to it); that epoch itself, never installed, is void.
    pushed = session.latest
    newer = pushed.members if pushed is not None and pushed.number > epoch.number else None
    members = [m for m in epoch.members
               if newer is None or m in newer or m == session.node_id]  # fmt: skip
    session.void_after(epoch)
    started = time.monotonic()
    deadline = started + grace
    log.warning(
        "%s: lost the coordinator at %s (%s); waiting up to %gs (coordinator_grace_s) for a "
        "coordinator at that address to re-form the run at outer step %d",
        session.node_id,
        session.address,
        cause,
        grace,
        outer[0],
    )
    resume = {
        "node_id": session.node_id,
        "epoch": epoch.number,
        "members": members,
        "outer_step": outer[0],
        "outer_hash": outer[1],
    }
    _reopen(session, resume, started, grace)
    log.info(
        "%s: reconnected to the coordinator at %s after %.1fs; waiting for the run to re-form",
        session.node_id,
        session.address,
        time.monotonic() - started,
    )
    _wait_reformed(session, epoch, started, until=max(deadline, time.monotonic() + 2 * grace))
    assert session.latest is not None
    return install(session, session.latest)


def _reopen(session: Session, resume: dict, started: float, grace: float) -> None:
    """Register again with `resume` until a coordinator answers, or raise CoordinatorGone
    `grace` seconds after `started`."""
    deadline = started + grace
    note = started + _NOTE_EVERY
    while True:
        try:
            session.open({"resume": resume})
            return
        except (CoordinatorLost, TimeoutError) as e:  # not back yet (or not answering yet)
            now = time.monotonic()
            if now >= deadline:
                raise CoordinatorGone(
                    f"no coordinator answered at {session.address} for {grace:g}s "
                    f"(mesh.coordinator_grace_s) after it was lost: {e}"
                ) from None
            if now >= note:
                log.warning(
                    "%s: still waiting for the coordinator at %s (%.0fs of %gs)",
                    session.node_id,
                    session.address,
                    now - started,
                    grace,
                )
                note = now + _NOTE_EVERY
            time.sleep(min(1.0, max(deadline - now, 0.0)))


def _wait_reformed(session: Session, epoch: Epoch, started: float, until: float) -> None:
    """Wait for the restarted coordinator to push an epoch newer than `epoch`. It waits for
    the other members (up to its --reform-wait), so `until` allows that even when it came
    back late in the grace period."""
    while not session.client.wait_for(lambda: session.newer_than(epoch.number), _NOTE_EVERY):
        session.client.check()  # MeshEvicted: the run re-formed without this node
        if time.monotonic() >= until:
            raise CoordinatorGone(
                f"the coordinator at {session.address} came back but did not re-form the run "
                f"within {until - started:.0f}s"
            )
        log.info("%s: waiting for the other members to reconnect", session.node_id)
