"""What joining (`diloco/join.py`, `listen.py`, `fetch.py`) uses of the outer step, beside
its rounds: replaying a logged update, applying a kept one, listening. `Diloco` (and so
`DelayedDiloco`) is a `JoinSide`; `prime_train.seam.ElasticOuterStep` declares it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from prime_mesh import ElasticDeviceMesh
    from prime_train.diloco.error_feedback import ErrorFeedback
    from prime_train.diloco.fragments import Fragments
    from prime_train.diloco.listen import Listener
    from prime_train.diloco.outer_optimizer import OuterOptimizer
    from prime_train.diloco.replay_log import Entry
    from prime_train.diloco.round_log import RoundLog
    from prime_train.slot_loader import SlotLoader


class JoinSide:
    """A joiner's side of the outer step (module doc); the attributes are `Diloco`'s."""

    mesh: ElasticDeviceMesh
    data: SlotLoader | None
    fragments: Fragments
    optimizer: OuterOptimizer
    feedback: ErrorFeedback
    totals: dict[str, Any]
    rounds: RoundLog
    listener: Listener | None
    period: int  # inner steps between two syncs

    @property
    def part(self) -> OuterOptimizer:
        """The outer optimizer of the fragment the next sync averages (the whole model when
        `fragments` = 1): chosen by the committed outer step count."""
        return self.fragments.part(self.outer_steps)

    @property
    def outer_steps(self) -> int:
        """Outer steps applied so far in the run (as loaded, replayed or taken)."""
        return self.rounds.outer_steps

    def replay(self, entry: Entry) -> str | None:
        """Apply a logged update (the next outer step) to the outer weights, momentum and the
        model, as the members did; None if this rank's shard then has the members' hash, else
        what differs (the state is then unusable: load another checkpoint)."""
        opt = self.part  # (the entry's fragment: the one after this node's count)
        misfit = entry.misfit(self.outer_steps, opt.pseudo_gradient.numel())
        if misfit is not None:
            return misfit
        opt.pseudo_gradient.copy_(entry.update)
        opt.apply()
        self.totals["outer_steps"] += 1
        mine = self.optimizer.digest()
        if mine != entry.shard_sha256:
            return (
                f"outer step {entry.outer_step} replayed to hash {mine[:16]}, the members' is "
                f"{entry.shard_sha256[:16]} (another torch build or CPU?)"
            )
        return None

    def apply_update(self, update: torch.Tensor) -> None:
        """Apply an update this node received in the all-reduce as the next outer step (a
        round a listener kept: the same bits every member applied, see `diloco/listen.py`)."""
        self.part.pseudo_gradient.copy_(update)
        self.part.apply()
        self.totals["outer_steps"] += 1

    def replayed(self, outer_sha256: str) -> None:
        """After a replay: tell the mesh where this node now is."""
        self.mesh.note_outer_step(self.outer_steps, outer_sha256)

    def restore_shared(self, shared: dict[str, Any]) -> None:
        """Take the data slots' shared state of the last replayed entry (see `log_update`)."""
        if self.data is not None and shared:
            self.data.load_shared(shared)

    def listen(self, listener: Listener | None) -> None:
        """From its next round this node listens through `listener` (None: it stops)."""
        self.listener = listener

    def round_update(self, count: int) -> torch.Tensor:
        """The buffer that holds a committed round's average: of the fragment synced at
        committed count `count` (the whole model with one fragment)."""
        return self.fragments.part(count).pseudo_gradient

    def settle_loaded(self) -> None:
        """A loaded snapshot holds no round of its own to settle (`DelayedDiloco`'s may)."""

    def take_members_state(self) -> None:
        """A listener that caught up: its model takes the outer weights of every fragment (a
        fragment not replayed holds the donor's) and its residual is zero (the snapshot
        brought the donor's)."""
        if self.fragments.count > 1:
            self.optimizer.load_into_model()
        self.feedback.reset()
