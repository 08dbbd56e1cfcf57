"""The trainer's seam: the outer step taken at each outer boundary, and what a mesh node adds.

`OuterStep` is everything the loop asks of an outer step; `ElasticOuterStep` adds what a node
of an elastic mesh needs to join, rejoin and outlive its coordinator.
`prime_train.diloco.Diloco` implements both. `train(cfg, outer=X)` accepts any object that
implements `OuterStep` (all of its members: a plain synchronous step sets `overlapped = False`
and has an empty `close`); in a multi-node run (`mesh.coordinator` set) it must implement
`ElasticOuterStep` too. What `train()` is given as `outer` is also what gets checkpointed and
what decides where the run resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from prime_mesh import ElasticDeviceMesh
    from prime_train.diloco.listen import Listener
    from prime_train.diloco.replay_log import Entry
    from prime_train.slot_loader import SlotLoader


@dataclass
class OuterStepReport:
    """What one applied outer step cost and who took part."""

    step: int  # the inner step it followed
    outer_step: int  # applied outer steps so far in the run, this one included
    attempts: int
    seconds: float
    allreduce_seconds: float
    bytes_sent: int
    nodes: int
    epoch: int
    outer_sha256: str
    contributors: int = 0  # nodes whose pseudo-gradients were averaged (a joiner's is not)
    compute_seconds: float = 0.0  # inner compute of the round that ended with this report
    round_seconds: float = 0.0  # its wall time (from the previous outer step's end)


@runtime_checkable
class OuterStep(Protocol):
    """The outer step, taken at every outer boundary the step itself defines.

    With `overlapped = True`, `start` returns with the step's communication in flight and the
    loop goes on training; the next `start` completes it first, and the loop calls `finish`
    only after the last step's `start`."""

    overlapped: bool

    def is_boundary(self, step: int) -> bool:
        """Whether inner step `step` ends a round (the loop also ends one at its last step)."""

    def start(self, step: int) -> None:
        """Begin the outer step that follows inner step `step` (the model holds its weights)."""

    def finish(self) -> OuterStepReport | None:
        """Complete the step begun by `start`; the model then holds the new weights. Returns
        the applied step's report (None: nothing applied, or the step keeps no reports)."""

    def add_compute_time(self, seconds: float) -> None:
        """The loop reports each inner step's duration (for compute utilisation)."""

    def state_dict(self) -> dict[str, Any]:
        """The outer state to checkpoint, as live tensors and plain values (loaded in place)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state after a checkpoint was loaded into `state_dict()`'s structure."""

    def agree_resume_step(self, local_steps: list[int]) -> int | None:
        """The step this node resumes from, given the steps it holds (None: a fresh start).
        An `ElasticOuterStep` whose node lacks the run's step raises
        `prime_train.diloco.LacksNewestStep`: the node joins the run instead."""

    def summary(self) -> dict[str, Any] | None:
        """Totals and settings for the run's summary (None: nothing to add)."""

    def close(self) -> None:
        """On the way out, whatever happened: end any communication still in flight."""


@runtime_checkable
class ElasticOuterStep(OuterStep, Protocol):
    """An outer step over an elastic mesh: what joining, rejoining and a lost coordinator need
    (`prime_train.diloco.join`, `.rejoin`, `prime_train.outer_boundary`). Joining uses
    nothing of the outer step but what is declared here."""

    mesh: ElasticDeviceMesh  # this node's registration (`reattach` replaces it)
    data: SlotLoader | None  # the node's data slots, moved by each committed round
    listener: Listener | None  # while this node listens (`listen`)

    @property
    def outer_steps(self) -> int:
        """Outer steps applied so far in the run (as loaded, replayed or taken)."""

    @property
    def local_rank(self) -> int:
        """This rank's index in its node (each rank keeps and replays its own shard)."""

    def round_end(self, step: int) -> int:
        """The inner step that ends the round running after inner step `step`."""

    def enter(self, step: int) -> OuterStepReport | None:
        """A joiner's round ending at inner step `step`: it contributes nothing (its model is
        the outer weights it holds) and, through its listener, keeps the members' update or,
        caught up, applies it as they do. None: a round it only kept."""

    def listen(self, listener: Listener | None) -> None:
        """From the next round this node listens through `listener` (None: it stops)."""

    def round_update(self, count: int) -> torch.Tensor:
        """The buffer holding a committed round's average: the fragment synced at committed
        count `count` (the whole model with one fragment)."""

    def apply_update(self, update: torch.Tensor) -> None:
        """Apply a round's update (one a listener kept) as the next outer step."""

    def replay(self, entry: Entry) -> str | None:
        """Apply a logged update as the next outer step; None if this rank's shard then has
        the members' hash, else what differs."""

    def replayed(self, outer_sha256: str) -> None:
        """After replaying: tell the mesh where this node now is."""

    def restore_shared(self, shared: dict[str, Any]) -> None:
        """Take the data slots' shared state of the last replayed entry."""

    def settle_loaded(self) -> None:
        """After loading a snapshot: settle a round it holds finished but unapplied."""

    def take_members_state(self) -> None:
        """A listener that caught up: its model takes the outer weights, its residual is zero."""

    def joiners_waiting(self) -> bool:
        """Whether a node waits to join (it needs the state of the round that starts now)."""

    def reattach(self, mesh: ElasticDeviceMesh) -> None:
        """Use `mesh`, a new registration of this node after it lost its membership."""

    def rollback_to_outer(self) -> None:
        """Put the model back to the outer weights of the last committed outer step."""
