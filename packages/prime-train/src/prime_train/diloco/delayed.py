"""The overlapped outer step (`[diloco] overlap = "delayed"`): round k's all-reduce runs in a
background thread while round k+1's inner steps compute; its update lands one round late.

Buffers (flat, CPU, float32, this rank's shards): the outer weights O and momentum (as in
`Diloco`), the pseudo-gradient P in flight, and X, the replica's weights when the current round
began. With θ the model (the local replica):

- `start(step)` at the end of round k+1: wait for round k's background round, then
  - if it committed: O' = O - lr * nesterov(avg P) (momentum updated), else O' = O (dropped);
  - rebase the replica: θ <- θ + (O' - X), i.e. θ = O' + (θ - X): the new outer weights plus
    this round's own progress. Written with Δ = O' - O and g_k = O - X this node's own round-k
    pseudo-gradient: θ <- θ + Δ + g_k (the replica takes the same delta as the outer weights
    and gives back its own round-k contribution, which the average now stands for);
  - P = O' - θ (round k+1's pseudo-gradient: θ - X, its own progress), X = θ, and the
    background thread starts round k+1: `maybe_reinit_global_pg`, the compressed all-reduce
    of P on the inter-node group, `should_commit`. The main thread calls none of them while a
    round is in flight; it only joins the thread. P is written only when no round is in flight.
- `finish()` (the loop calls it only at the last step): wait for the round in flight, apply
  it, and load the outer weights O into the model: the final model, evaluation and checkpoint
  are the outer weights, not a replica.
- `state_dict()` (a checkpoint, also at a stop) waits for the round in flight and saves its
  averaged P with the vote's outcome, unapplied, beside O, momentum and X; the model holds the
  replica. A resumed run applies it at the end of the next round, as the uninterrupted run does.

A failed all-reduce votes no: the round is dropped on every node (O unchanged, each replica
gives back its own contribution) and the next round's sync point re-forms the group.

With `[diloco] fragments = F` > 1 (streaming, `diloco/fragments.py`) a round is H / F inner
steps and syncs one fragment: its all-reduce starts at its sync point and runs behind the H / F
inner steps until the next fragment's sync point, where it is applied (to that fragment's
outer weights, momentum and replica range only) right before the next fragment's starts; so
exactly one fragment is in flight, and each fragment still syncs once every H steps. Why that
delay and not a shorter one: the next sync point is the one place the main thread meets the
mesh anyway, a fragment's traffic has the whole H / F steps to hide behind (1/F of the bytes
of a whole-model round in 1/F of its time: the same bandwidth need as whole-model overlap),
and a fragment's update landing H / F steps late is small against the H steps it covers. The
fragment a round syncs is the committed count's (`outer_steps % F` once the previous round is
applied), as on every node; a dropped round leaves the count, so the next sync point syncs the
same fragment again, on every node alike. X and P stay whole-model buffers (only the fragment
in flight's range is meaningful), so a checkpoint's keys are the same at every sync point.

With error feedback (`diloco/error_feedback.py`) the background thread sends P plus the
node's residual and, when the vote commits, keeps the round's new residual at once: a
checkpoint of a committed, unapplied round holds the residual that round left, as the
uninterrupted run does when it applies it.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any

import torch

import prime_comm
from prime_mesh import ElasticDeviceMesh, MeshTimeout
from prime_train import faults
from prime_train.diloco.average import Averaged
from prime_train.diloco.contribution import every_rank, outlier, stated_norm
from prime_train.diloco.listen import settle_late, sync_part
from prime_train.diloco.outer_step import Diloco
from prime_train.diloco.round_log import join_cost, members_before, round_counts
from prime_train.diloco.update_codec import Encoded
from prime_train.seam import OuterStepReport

_NO_ROUND = {"state": "none", "step": 0, "seconds": 0.0, "allreduce_seconds": 0.0,
             "bytes_sent": 0, "nodes": 0, "epoch": 0, "contributors": 0, "error": "",
             "late": "", "behind": 0, "consumed": None, "members": [], "inner_steps": 0,
             "counted": None, "admitted": [], "join_seconds": 0.0,
             "members_step": 0, "contributed": True}  # fmt: skip


class DelayedDiloco(Diloco):
    """DiLoCo whose outer all-reduce overlaps the next round's inner steps (see module doc)."""

    overlapped = True  # the loop calls `finish` only at the last step

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        opt = self.optimizer
        self.round_start = opt.weights.clone()  # X: the model holds the outer weights now
        self._round: dict[str, Any] = dict(_NO_ROUND)  # the round in flight or done, unapplied
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        # the finished round's average as its all-reduce's bytes (for the update log; not
        # checkpointed with the round: a round resumed from a checkpoint logs its floats)
        self._encoded: Encoded | None = None
        self._last_step = 0
        self._rounds = 0  # rounds started in this process (names the threads)

    # -- the outer step ---------------------------------------------------------------------

    def start(self, step: int) -> None:
        """End of a round: apply the previous round's update, rebase the replica on it, and
        start this round's all-reduce in the background."""
        self._start(step, contributing=True)

    def enter(self, step: int) -> OuterStepReport | None:
        """A joiner's first round (see the seam): its zero pseudo-gradient's round, settled at
        once. JoinedLate if it was admitted after a later round than the state it loaded."""
        self.feedback.reset()
        self.settle_loaded()
        self._start(step, contributing=False)
        return self.finish()

    def settle_loaded(self) -> None:
        """A joiner whose snapshot holds the donor's finished, unapplied round (no update
        replayed since, which would have dropped it): apply it, or drop it, as the members do
        at the sync point this joiner enters at, before it is admitted there (a listener:
        as soon as its snapshot is loaded, before the rounds it kept). No row: its
        report would read the mesh, not this node's yet; the next sync's row has the hash."""
        rnd, self._round = self._round, dict(_NO_ROUND)
        if rnd["state"] != "committed":
            if rnd["state"] != "none" and self.data is not None:
                self.data.drop()
            return
        self.part.apply(to_model=False)
        self._commit_data(rnd["consumed"], rnd["members"])
        self.totals["outer_steps"] += 1

    def _start(self, step: int, contributing: bool) -> None:
        opt = self.optimizer
        self._last_step = step
        waited = self._wait()
        if self.data is not None:
            self.data.end_round()
        if self._round["state"] != "none":
            applied = self._apply_round(step, waited)
            # θ <- θ + (O' - X) over the fragment the round synced (the whole model when F = 1):
            # the round start becomes the new outer weights' offset
            span = self.fragments.span(self.outer_steps - (applied is not None))
            torch.sub(opt.weights[span], self.round_start[span], out=self.round_start[span])
            self.fragments.part(self.outer_steps - (applied is not None)).shift_model(
                self.round_start
            )
        else:  # the first round (or the first after a settle): no update to apply yet
            self.rounds.end_round()
        reads = self.data.uncommitted() if self.data is not None else None
        contributing = contributing and (reads is None or any(reads))  # read nothing: no part
        part = self.part  # this round's fragment: the committed count's, as every node's
        part.compute_pseudo_gradient()  # P = O' - θ
        norm2 = None
        if contributing:
            norm2 = stated_norm(part.pseudo_gradient, self.outer_steps + 1, self.log)
        # one bad shard leaves the node out, decided by every rank here on the main thread:
        # the background thread must not use the node's group while the inner steps use it
        every_rank_ok = every_rank(norm2 is not None, self.node_group)
        if contributing and not every_rank_ok:
            contributing, norm2 = False, None  # bad numbers: left out, not fatal; its model
            part.load_into_model()  # restarts from the outer weights (θ + (O'' - X) is O'')
        if not contributing:
            part.pseudo_gradient.zero_()
        part.copy_model_into(self.round_start)  # X = θ (that fragment's range of the buffer)
        self._round = dict(_NO_ROUND, state="running", step=step,
                           inner_steps=self.round_inner_steps)  # fmt: skip
        self.round_inner_steps = 0
        self._rounds += 1
        self._thread = threading.Thread(
            target=self._background_round,
            args=(self._round, contributing, reads, norm2),
            name=f"prime-outer-{self._rounds}",
            daemon=True,
        )
        self._thread.start()

    def finish(self) -> OuterStepReport | None:
        """Settle: wait for the round in flight, apply it, and load the outer weights."""
        waited = self._wait()
        report = None
        if self._round["state"] != "none":
            report = self._apply_round(self._last_step, waited)
        self.optimizer.load_into_model()
        self.round_start.copy_(self.optimizer.weights)
        return report

    def _background_round(
        self,
        rnd: dict[str, Any],
        contributing: bool,
        reads: list[int] | None,
        norm2: float | None,
    ) -> None:
        """One attempt, in the background thread: sync point, all-reduce, vote. `norm2`: the
        norm this node states (`diloco/contribution.py`); one far outside the others' leaves
        its update out of the round (its model keeps its own progress: the main thread trains
        on meanwhile)."""
        mesh, t0 = self.mesh, time.monotonic()
        listener = self.listener  # (set by the main thread between rounds only)
        self._encoded = None
        try:
            before = members_before(mesh)
            # a listener may come a round early: not its clock
            mesh.maybe_reinit_global_pg(
                listening=listener is not None, norm2=norm2, norm_bound=self.cfg.norm_bound
            )
            if contributing and outlier(mesh.norm_outlier, self.outer_steps + 1,
                                        self.cfg.norm_bound, self.log):  # fmt: skip
                contributing = False
                sync_part(self).pseudo_gradient.zero_()
            sync_seconds = time.monotonic() - t0
            faults.hold_outer_round(rnd["step"], self.log)
            with listener.collective() if listener is not None else nullcontext():
                got = self.average(contributing, reads, step=int(rnd["step"]))
            self._encoded = got.encoded
            committed = self.vote(got, contributing)  # a committed round's residual is kept at once
            epoch, members = mesh.installed_group  # (never raises for a later eviction)
            cost = join_cost(mesh, before, sync_seconds)  # (a round that admitted a node)
            rnd.update(
                state="committed" if committed else "dropped",
                seconds=time.monotonic() - t0,
                allreduce_seconds=got.stats.seconds if got.stats else 0.0,
                bytes_sent=got.stats.bytes_sent if got.stats else 0,
                nodes=len(members),
                epoch=epoch,
                contributors=got.contributors,
                error="" if committed else (got.error or "a peer failed"),
                late=got.late or "",
                behind=got.behind,
                members_step=got.members_step or 0,  # (0: not sent; a listener's entry step)
                consumed=got.consumed,
                members=list(members),
                contributed=contributing,
                # this node's reads that counted (None: it sent none, or was not counted)
                counted=reads if contributing and got.late is None else None,
                # flat, always present: the round is checkpointed, and a checkpoint's keys must
                # not depend on whether its round admitted a node
                admitted=cost.get("admitted", []),
                join_seconds=cost.get("join_seconds", 0.0),
            )
        except BaseException as e:  # the mesh is gone (coordinator lost, closed): re-raised
            self._fatal = e
            rnd.update(state="failed", error=f"{type(e).__name__}: {e}")

    def _wait(self) -> float:
        """Join the round in flight (if any); seconds the caller waited for it. Every mesh
        call in the round is bounded, so the round ends within the mesh's `round_bound()`
        (plus a fault hook's hold): past it, MeshTimeout instead of a hang (the thread is
        a daemon, and `close()` gives it one more bounded chance)."""
        if self._thread is None:
            return 0.0
        t = time.monotonic()
        bound = self.mesh.round_bound() + faults.HOLD_ROUND_S
        self._thread.join(bound)
        if self._thread.is_alive():
            raise MeshTimeout(
                f"the background outer round of step {self._round['step']} did not end within "
                f"{bound:.0f} s (the bound of its sync point, all-reduce and vote)"
            )
        self._thread = None
        if self._fatal is not None:
            fatal, self._fatal = self._fatal, None
            raise fatal  # as the synchronous step would (the CLI reports MeshError in one line)
        return time.monotonic() - t

    def _apply_round(self, step: int, waited: float) -> OuterStepReport | None:
        """Apply the finished round's averaged pseudo-gradient to the outer weights (or drop
        it), and report it; the model is not touched."""
        rnd, self._round = self._round, dict(_NO_ROUND)
        encoded, self._encoded = self._encoded, None
        if rnd["state"] != "committed":
            self._warn(
                f"outer round of step {rnd['step']} not committed ({rnd['error']}); dropped on "
                "every node: outer weights unchanged, each replica gives back its own update"
            )
            self.rounds.end_round()
            if self.data is not None:
                self.data.drop()
            return None
        # (a member left out of the round checks it holds the contributors' outer state)
        if rnd["late"] or self.listener is not None or not rnd["contributed"]:
            got = Averaged(None, None, int(rnd["contributors"]), late=rnd["late"] or None,
                           consumed=rnd["consumed"], behind=int(rnd["behind"]),
                           members_step=int(rnd["members_step"]) or None,
                           encoded=encoded)  # fmt: skip
            settled = settle_late(self, got, step, contributing=bool(rnd["contributed"]))
            if settled is None:
                return None  # a round it listened to: kept, not applied
            # its row is the members' round's
            step, rnd["step"] = settled, int(rnd["step"]) + settled - step
        fragment = self.fragments.index(self.outer_steps)  # (before it counts)
        self.part.apply(to_model=False)
        data = self._commit_data(rnd["consumed"], rnd["members"])
        stats = prime_comm.AllReduceStats(
            bytes_sent=int(rnd["bytes_sent"]),
            bytes_received=0,
            seconds=float(rnd["allreduce_seconds"]),
            numel=self.fragments.numel(fragment),
            world_size=int(rnd["nodes"]),
            compression=self.cfg.compression,
        )
        report = self.rounds.record(
            self.mesh,
            step,
            1,
            float(rnd["seconds"]),
            stats,
            int(rnd["contributors"]),
            extra={
                "round_step": int(rnd["step"]),
                "waited_s": waited,
                **({"fragment": fragment} if self.fragments.count > 1 else {}),
                **(data or {}),
                **self.feedback.metrics(),
                **round_counts(int(rnd["inner_steps"]), self.data, rnd["consumed"], rnd["counted"]),
                **(
                    {"admitted": rnd["admitted"], "join_seconds": rnd["join_seconds"]}
                    if rnd["admitted"]
                    else {}
                ),
            },
            note=f" | round of step {rnd['step']}, waited {waited:.2f} s",
        )
        # logged under its round's step: a joiner that replayed it joins the round after
        self.log_update(report, step=int(rnd["step"]), encoded=encoded)
        return report

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Outer state plus the finished, unapplied round (waits for the round in flight)."""
        self._wait()
        return {
            **super().state_dict(),
            "averaged": self.optimizer.pseudo_gradient,
            "round_start": self.round_start,
            "round": self._round,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key, buf in (("averaged", self.optimizer.pseudo_gradient),
                         ("round_start", self.round_start)):  # fmt: skip
            if state[key] is not buf:
                buf.copy_(state[key])
        self._round = dict(_NO_ROUND, **state["round"])

    def replay(self, entry) -> str | None:
        """A logged update (see `Diloco.replay`); a loaded round still pending is dropped
        first (it is the first entry replayed), and the replica restarts from the outer
        weights, as after `finish`."""
        self._round = dict(_NO_ROUND)
        problem = super().replay(entry)
        self.round_start.copy_(self.optimizer.weights)
        return problem

    def rollback_to_outer(self) -> None:
        """The outer weights into the model with no round in flight or pending: the round whose
        end raised (the coordinator gone) is dropped, and the next `start` begins afresh."""
        assert self._thread is None, "rollback with a round in flight"
        self._round, self._fatal = dict(_NO_ROUND), None
        super().rollback_to_outer()
        self.round_start.copy_(self.optimizer.weights)

    def reattach(self, mesh: ElasticDeviceMesh) -> None:
        """A new registration after this node lost its membership (`diloco/rejoin.py`): the
        round in flight or pending belonged to the old one and is dropped (the members' state
        the rejoin loads holds it when they committed it)."""
        if self._thread is not None:  # its mesh calls fail fast on the old registration
            self._thread.join(self.mesh.round_bound())
        self._thread, self._fatal, self._round = None, None, dict(_NO_ROUND)
        super().reattach(mesh)

    def close(self, timeout: float = 60.0) -> None:
        """On the way out (the loop failed with a round in flight): give the round `timeout`
        seconds to end before the mesh closes; never hang the exit on it (daemon thread)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._warn(f"the background outer round did not end within {timeout:g} s")
            self._thread, self._fatal = None, None
        super().close()  # the update log's last write
