"""A restarted coordinator re-forms the run from the nodes that reconnect to it.

When the coordinator dies, the nodes keep training and, at their next sync point, reconnect
to the same address (`prime_mesh.reconnect`). Each registers with a `resume` record: the epoch
it was in, that epoch's members in rank order (but those a newer epoch the lost coordinator
pushed to it left out: they left or were evicted, and are not waited for), and its outer step
and outer weight hash (told by the trainer through `ElasticDeviceMesh.note_outer_step`). A
coordinator that has formed no epoch yet collects them until every member of the newest
reported epoch is back (or `reform_wait` seconds pass since the first one; one that came back
and was evicted again, killed or stalled, is not waited for), then adopts the
nodes at the newest outer step whose hash agrees with the first of them in the old rank order,
keeps that order, and numbers its epoch above the highest one reported (nodes ignore epochs not newer than theirs). The
others are evicted with a reason that tells them to rejoin through live recovery. `min_nodes`
is not applied: it only gates the first formation of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Refused(Exception):
    """Registration refused; the message is sent to the node."""

    kind = "refused"


class Rejoin(Refused):
    """A reconnecting node the run re-formed without: it must rejoin through live recovery."""

    kind = "rejoin"


class Completed(Refused):
    """The run this node registers for was completed by its members."""

    kind = "completed"


class NameTaken(Refused):
    """A live node of the run already goes by the name this node registered with."""

    kind = "name_taken"


class ResumeError(ValueError):
    """A malformed resume record (the registration is refused with this message)."""


@dataclass(frozen=True)
class Resume:
    """What a reconnecting node says about the run it was in."""

    node_id: str
    epoch: int
    members: tuple[str, ...]  # the node ids of its epoch, in rank order
    outer_step: int
    outer_hash: str

    @classmethod
    def parse(cls, raw: object) -> Resume:
        if not isinstance(raw, dict):
            raise ResumeError("malformed resume record (expected a map)")
        node_id, epoch, members = raw.get("node_id"), raw.get("epoch"), raw.get("members")
        outer_step, outer_hash = raw.get("outer_step"), raw.get("outer_hash")
        if not (
            isinstance(node_id, str)
            and isinstance(epoch, int)
            and epoch >= 1
            and isinstance(members, list | tuple)
            and all(isinstance(m, str) for m in members)
            and node_id in members
            and isinstance(outer_step, int)
            and outer_step >= 0
            and isinstance(outer_hash, str)
        ):
            raise ResumeError(
                "malformed resume record (node_id, epoch >= 1, members holding node_id, "
                "outer_step >= 0, outer_hash)"
            )
        return cls(node_id, epoch, tuple(members), outer_step, outer_hash)

    @property
    def highest_number(self) -> int:
        """The highest N among its members' ids ("node-N"; 0 if none): fresh node ids must
        not take the id of a member that has yet to reconnect."""
        nums = [m.rpartition("-")[2] for m in self.members]
        return max((int(n) for n in nums if n.isdigit()), default=0)


def expected_ids(resumes: list[Resume]) -> set[str]:
    """The members of the newest epoch any reconnected node reports: who the re-formed run
    waits for."""
    newest = max(resumes, key=lambda r: r.epoch)
    return set(newest.members)


def choose(resumes: list[Resume]) -> tuple[list[Resume], list[tuple[Resume, str]]]:
    """Split reconnected nodes into the adopted (in the old rank order) and the sent-away
    (with the reason). The adopted are at the newest outer step with the hash of the first
    such node in the old rank order."""
    order = {m: i for i, m in enumerate(max(resumes, key=lambda r: r.epoch).members)}
    ranked = sorted(resumes, key=lambda r: (order.get(r.node_id, len(order)), r.node_id))
    newest = max(r.outer_step for r in resumes)
    head = next(r for r in ranked if r.outer_step == newest)
    adopted = [r for r in ranked if r.outer_step == newest and r.outer_hash == head.outer_hash]
    away = []
    for r in ranked:
        if r in adopted:
            continue
        if r.outer_step != newest:
            why = f"it is at outer step {r.outer_step}, the run at {newest}"
        else:
            why = f"its outer weights differ from the run's at outer step {newest}"
        away.append((r, f"{why}; rejoin through live recovery (rerun the same command)"))
    return adopted, away


def resume_of(raw: Any, *, epoch: int, other_ids: set[str]) -> Resume | None:
    """The resume record of a node reconnecting after a coordinator restart (None for a
    plain registration), checked against the coordinator's `epoch` and the node ids its other
    nodes hold. Only a coordinator that formed no epoch yet re-forms a run."""
    if raw is None:
        return None
    try:
        resume = Resume.parse(raw)
    except ResumeError as e:
        raise Refused(str(e)) from None
    if epoch:
        raise Rejoin(
            f"the run already re-formed (epoch {epoch}) without {resume.node_id}; "
            "rejoin through live recovery (rerun the same command)"
        )
    if resume.node_id in other_ids:
        raise Refused(f"{resume.node_id} already reconnected with another node key")
    return resume


@dataclass(frozen=True)
class ReformPlan:
    """What a coordinator that formed no epoch yet does with the reconnected nodes (the
    membership applies it): number its next epoch above `above_epoch`, make `adopted` (node
    ids, in the old rank order) its members, and evict each of `away` with its reason."""

    above_epoch: int
    adopted: tuple[str, ...]
    away: tuple[tuple[str, str], ...]  # (node id, why it must rejoin)
    why: str  # for the log
    event: tuple[str, str, str]  # for the status page's history: (kind, node ids, reason)


def plan_reform(
    resumes: list[Resume], waited: float, reform_wait: float, departed: set[str]
) -> ReformPlan | None:
    """The re-formation from reconnected nodes once every member of the newest reported
    epoch is back (or came back and departed again: `departed`, node ids) or `reform_wait`
    passed (`waited` seconds since the first came back), else None (wait on). min_nodes is
    not applied, and plain joiners wait for the members' next sync point."""
    back = {r.node_id for r in resumes}
    if not expected_ids(resumes) - departed <= back and waited < reform_wait:
        return None
    adopted, away = choose(resumes)
    ids = ", ".join(r.node_id for r in adopted)
    missing = sorted(expected_ids(resumes) - back - departed)
    step = adopted[0].outer_step
    return ReformPlan(
        above_epoch=max(r.epoch for r in resumes),
        adopted=tuple(r.node_id for r in adopted),
        away=tuple((r.node_id, why) for r, why in away),
        why=f"re-formed after a coordinator restart at outer step {step}"
        + (f" (not back after {waited:.0f}s: {', '.join(missing)})" if missing else ""),
        event=("reformed", ids, f"reconnected at outer step {step}"),
    )
