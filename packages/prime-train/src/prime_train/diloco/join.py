"""Joining a running job: the one way in, for every case.

A fresh node, a node run again after it was killed, a woken or cut-off node, a node left out
of a round, a node whose weights differed (the vote evicts it), a listener sent away by a
restarted coordinator and a joiner evicted before it was admitted all go through
`join_running_job`, and it does one thing:

1. Register as a joiner (`diloco.membership`; a rerun node is registered by its placement,
   every other case registers again here, `_register_again`): the members never wait for it.
   A run whose every member left has nobody to join: the coordinator sends its joiners away
   and registering again makes them founders, which resume from the newest checkpoint any
   of them holds (`Run.resume`; a node lacking it joins the run the holders form).
2. Say `ready()` at once: the members admit it at their next sync point. Meanwhile local
   rank 0 fetches a snapshot (the members' first checkpoint after it said ready, made at the
   boundary that admitted it: `diloco/fetch.py`) in the background, and holds the
   members' update logs from there on (`fetch.hold_logs`).
3. Listen (`diloco/listen.py`): each round it takes part in the all-reduce contributing
   nothing and keeps the committed update; once the snapshot is in it loads it, replays the
   logged rounds between the snapshot and the first kept one (checked against the members'
   hash), then the kept rounds, and applies that round's update with the members: its outer
   weights are theirs, bit for bit, and it contributes from the next round.

If it loses its place on the way (evicted, the coordinator restarted, a round it cannot use:
`JoinedLate`), it stops listening, drops what it kept and goes back to step 1, at most
`MAX_TRIES` times. What the join did is one `joined` metrics row (`join_state.JoinedRow`);
what a try holds while it runs is a `join_state.Joining`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prime_mesh import (
    CoordinatorLost,
    MeshError,
    MeshEvicted,
    MeshRefused,
    MeshTimeout,
    RunCompleted,
)
from prime_train import faults
from prime_train.diloco.fetch import (
    JOIN_TIMEOUT_S,
    Background,
    JoinFailed,
    completed_meanwhile,
    hold_logs,
)
from prime_train.diloco.join_state import JoinedRow, Joining
from prime_train.diloco.listen import JoinedLate, Listener
from prime_train.diloco.membership import Membership
from prime_train.diloco.resume_agreement import LacksNewestStep, NothingToFormFrom

if TYPE_CHECKING:
    from prime_train.run import Run
    from prime_train.seam import ElasticOuterStep, OuterStepReport

MAX_TRIES = 10  # tries that lost their place (then joining again) before giving up
FORM_AGAIN_S = 10.0  # a founder holding nothing, among founders holding nothing, waits so long
LOADED_AT = time.monotonic()  # about when the process started (the trainer imports this early)
LOST = (MeshEvicted, CoordinatorLost, JoinedLate)  # a try lost its place: join again


def join_running_job(
    run: Run,
    outer: ElasticOuterStep,
    lost: BaseException | None = None,
    rejoined: int | None = None,
) -> int:
    """Join the running job (module doc); returns the inner step the loop continues from.
    `lost`: why this node lost its membership (None: it is registered as a joiner already);
    `rejoined`: the count, for a node rejoining by itself."""
    row = JoinedRow(rejoined=rejoined)
    started = time.monotonic()
    for tries in range(1, MAX_TRIES + 2):
        # (registered again as a founder: the run had no members left)
        if lost is not None and not _register_again(run, outer, lost).joining:
            try:
                return _form_anew(run, outer, lost)
            except (LacksNewestStep, NothingToFormFrom) as e:  # join the holders, or wait
                if tries > MAX_TRIES:
                    raise
                run.log.info(f"{e}; registering again")
                lost = e
                continue
        joining = Joining(row, started)
        listener = Listener(run, outer, joining)
        try:
            step = _listen_and_enter(run, outer, joining, listener)
        except LOST as e:
            _end(outer, joining, listener, again=True)
            if tries > MAX_TRIES:
                raise
            row.late_admissions += 1
            run.log.warn(
                f"lost its place while joining ({type(e).__name__}: {e}); registering again "
                f"and listening again ({tries} of at most {MAX_TRIES})"
            )
            lost = e
        except BaseException:  # a stop or an error: the process ends, nothing waits
            _end(outer, joining, listener, again=False)
            raise
        else:
            _end(outer, joining, listener, again=False)
            return step
    raise AssertionError("unreachable")


REGISTER_POLL_S = 1.0


class RejoinFailed(MeshError):
    """No coordinator took this node's registration within `diloco.rejoin_wait_s`."""


def _register_again(run: Run, outer: ElasticOuterStep, lost: BaseException) -> Membership:
    """Leave what is left of the old membership and register again, trying for up to
    `diloco.rejoin_wait_s` (`lost`: why, for the line if it cannot). The coordinator decides,
    as for a node started afresh: a joiner of the running job (`Membership.joining`), or,
    when the run has no members left, a founder forming it anew (returned once formed)."""
    cfg, old = run.cfg, run.placement.membership
    assert old is not None
    try:
        old.close()
    except Exception as e:  # an evicted node's connection is already gone: nothing to leave
        run.log.info(f"closing the old membership: {type(e).__name__}: {e}")
    t0 = time.monotonic()
    while True:
        try:
            membership = Membership.join(cfg, run.ckpt_dir, serve=run.primary,
                                         warn=run.log.warn, name=run.placement.node.name,
                                         launcher_index=run.placement.node.launcher_index)  # fmt: skip
            break
        except MeshRefused:  # the run completed, or this node cannot take part: said once
            raise
        except (MeshError, OSError) as e:  # the coordinator away or the link flapping
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 > cfg.diloco.rejoin_wait_s:
            raise RejoinFailed(
                f"this node lost its mesh membership ({type(lost).__name__}: {lost}) and "
                f"could not register again within diloco.rejoin_wait_s = "
                f"{cfg.diloco.rejoin_wait_s:g} s ({last}); check its link to the coordinator "
                f"at {cfg.mesh.coordinator}, then rerun the same command to join again"
            )
        time.sleep(REGISTER_POLL_S)
    run.placement.membership = membership
    outer.reattach(membership.mesh)
    run.log.info(
        f"registered again as {membership.mesh.node_id} after {time.monotonic() - t0:.1f} s "
        f"({membership.members_seen} member(s))"
    )
    return membership


def _form_anew(run: Run, outer: ElasticOuterStep, lost: BaseException) -> int:
    """Registered again into a run with no members left: this node is one of the nodes
    forming it anew, resuming from the newest checkpoint any of them holds (`Run.resume`;
    LacksNewestStep where this node lacks it). Where none holds the run's newest state
    (`NothingToFormFrom`: no checkpoint, or one behind the newest a node reported), it
    leaves again and waits a while for nodes that come back with it, rather than start the
    run over or roll it back."""
    run.log.warn(
        f"the run has no members left ({type(lost).__name__}: {lost}); this node is one of "
        "the nodes forming it anew, from the newest checkpoint any of them holds"
    )
    try:
        start = run.resume(outer)
        if start == 0:
            raise NothingToFormFrom(
                "the nodes forming the run anew hold no checkpoint: the run's state left with "
                "its members. Start the nodes that hold its checkpoints again (this node then "
                "joins them), or move every node's checkpoints aside to start the run over"
            )
    except NothingToFormFrom:
        membership = run.placement.membership
        assert membership is not None
        membership.close()  # (before the pause: a node coming back with state founds, not joins)
        time.sleep(FORM_AGAIN_S)
        raise
    return start


def _end(outer: ElasticOuterStep, joining: Joining, listener: Listener, again: bool) -> None:
    """A try ended (entered, stopped, or lost its place): the outer step stops listening, the
    listener's files go, the donors may prune again. Before it starts `again`, a snapshot
    still under way ends first (bounded by its own timeouts), so that nothing writes into
    the folder meanwhile."""
    outer.listen(None)
    listener.close(wait=again)
    if again and joining.snapshot is not None:
        joining.snapshot.join(JOIN_TIMEOUT_S)
        joining.snapshot = None
    if joining.holder is not None:
        joining.holder.__exit__(None, None, None)
        joining.holder = None


def _listen_and_enter(
    run: Run, outer: ElasticOuterStep, joining: Joining, listener: Listener
) -> int:
    """Steps 2 and 3: ready at once, admitted, listen until caught up; the entry's row."""
    membership = run.placement.membership
    assert membership is not None
    if run.primary:
        joining.holder = hold_logs(membership)
        joining.snapshot = Background(membership, run.ckpt_dir, run.cfg)
    outer.listen(listener)
    faults.delay_first_ready(run.log)
    membership.mesh.ready()
    run.log.info(
        "joining a running job: ready at once, admitted at the members' next sync point; "
        "the snapshot comes in the background while this node listens"
    )
    wait_admitted(run, joining)
    total = run.cfg.train.steps
    report = outer.enter(min(outer.round_end(0), total))
    while report is None and not listener.caught_up:
        if listener.step >= total:
            run.log.info(
                "the run completed while this node waited to join (it listened to the members' "
                "last rounds); nothing to enter"
            )
            return total
        # no training: straight to the next sync point, which its arrival does not time
        report = outer.enter(min(outer.round_end(listener.step), total))
    if report is None:  # (caught up in a round that then applied nothing)
        return min(outer.round_end(listener.step), total)
    _entered(run, joining, report)
    return report.step


def _entered(run: Run, joining: Joining, report: OuterStepReport) -> None:
    """The line and the `joined` row of an entry."""
    row = joining.row
    admitted = time.monotonic() - joining.started
    startup = joining.started - LOADED_AT
    run.log.info(
        ("re" if row.rejoined else "")
        + f"entered the running job at outer step {report.outer_step} (step {report.step}), "
        f"donor {row.donor}: {row.fetch_bytes / 1e6:.2f} MB fetched in "
        f"{row.fetch_seconds:.2f} s; timeline: start-up {startup:.1f} s, snapshot "
        f"{row.fetch_seconds:.1f} s, load {row.load_seconds:.1f} s, replay {row.replayed} "
        f"round(s) in {row.replay_seconds:.1f} s, admitted {admitted:.1f} s after the join "
        f"began ({row.late_admissions} late admission(s))"
    )
    run.metrics.write(row.row(report.step, startup, admitted))
    run.progress["step"] = report.step


def wait_admitted(run: Run, joining: Joining) -> None:
    """Until the coordinator lists this node as a member (the members' next sync point), or
    the members are gone: `RunCompleted` (exit 0) when they finished the run (also after its
    snapshot came); `JoinedLate` when the snapshot's fetch failed (its donors left: the join
    registers again, as after admission); `MeshTimeout` past the
    mesh's `join_timeout` (as its own wait for admission); `MeshEvicted` when it was evicted
    meanwhile, `CoordinatorLost` when its connection ended (a stall past the heartbeat
    timeout ends it so, often before the eviction's notice is read): decided on local rank 0
    for all ranks."""
    membership = run.placement.membership
    assert membership is not None
    me = membership.mesh.node_id
    bound = membership.mesh.join_timeout  # (as the mesh's own wait for admission)
    deadline = None if bound is None else time.monotonic() + bound

    def ask() -> tuple[str, str] | None:
        failed = joining.snapshot.failed if joining.snapshot is not None else None
        if isinstance(failed, RunCompleted):
            return "RunCompleted", str(failed)
        if isinstance(failed, JoinFailed):
            return "JoinedLate", f"fetching the snapshot failed: {failed}"
        if deadline is not None and time.monotonic() > deadline:
            return "MeshTimeout", (
                f"not admitted within the mesh's join_timeout of {bound:g} s (the members' "
                "sync point never came, or the coordinator stayed away)"
            )
        try:
            members = membership.mesh.members()
        except (MeshEvicted, CoordinatorLost) as e:  # its connection is gone: join again
            return type(e).__name__, str(e)
        except MeshTimeout:  # the coordinator slow to answer: ask again
            return None
        if any(m.get("node_id") == me and m.get("state") == "member" for m in members):
            return "member", ""
        if not any(m.get("state") == "member" for m in members):  # (its snapshot may be in)
            done = completed_meanwhile(membership)
            return ("RunCompleted", str(done)) if done is not None else None
        return None

    while (got := run.placement.from_rank0(ask)) is None:
        time.sleep(0.2)
    kind, why = got
    errors = {"RunCompleted": RunCompleted, "JoinedLate": JoinedLate, "MeshTimeout": MeshTimeout,
              "MeshEvicted": MeshEvicted, "CoordinatorLost": CoordinatorLost}  # fmt: skip
    if kind in errors:
        raise errors[kind](why)
