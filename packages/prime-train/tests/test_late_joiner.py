"""A node that did not contribute to a committed round (a listener that has caught up, a
member left out of it) checks its outer state against the one the contributors voted with.
Churn seed 23: the only contributor's weights were changed outside the update stream, and a
listener replaying that stream entered with other weights and wrote a row of another hash
before its first vote could find it. Seed 26: a member left out of a round (a NaN) applied
the only contributor's update on weights that differed from its. The delayed overlap's left-out
member checks when it applies the round, over a real 2-process gloo group."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from prime_testkit import WorldMesh, gloo_world
from prime_train.config import DilocoConfig
from prime_train.diloco import DelayedDiloco
from prime_train.diloco.listen import JoinedLate, check_holds_agreed
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.diloco.round_log import RoundLog


def listener(values: list[float], outer_steps: int, agreed) -> SimpleNamespace:
    """A caught-up listener's outer step as `check_holds_agreed` reads it: real outer weights and
    round log, and the mesh's `agreed_outer` from the round's vote."""
    optimizer = OuterOptimizer([torch.nn.Parameter(torch.tensor(values))])
    rounds = RoundLog(optimizer, "uint8", None, None, None)
    return SimpleNamespace(
        mesh=SimpleNamespace(agreed_outer=agreed), outer_steps=outer_steps, rounds=rounds
    )


def test_a_listener_holding_the_contributors_state_enters():
    theirs = listener([1.0, 2.0], 17, None).rounds.node_digest()
    check_holds_agreed(listener([1.0, 2.0], 17, (17, theirs)))  # the same weights: no error
    check_holds_agreed(listener([1.0, 2.5], 17, None))  # not told (an older coordinator)


def test_a_listener_a_round_short_of_the_contributors_takes_the_members_state_again():
    """The same weights one outer step behind the contributors' count (an update it missed
    while listening): it would apply the round at the wrong count, so it leaves."""
    theirs = listener([1.0, 2.0], 17, None).rounds.node_digest()
    with pytest.raises(JoinedLate, match="at outer step 16, the contributors at 17"):
        check_holds_agreed(listener([1.0, 2.0], 16, (17, theirs)))


def test_a_listener_holding_other_weights_takes_the_members_state_again():
    theirs = listener([1.0, 2.0], 17, None).rounds.node_digest()
    odd = listener([1.0, 2.5], 17, (17, theirs))
    with pytest.raises(
        JoinedLate, match=f"at outer step 17: .* contributors voted with {theirs[:16]}"
    ):
        check_holds_agreed(odd)


def _left_out_worker(rank, world, port, q):
    """Two delayed-overlap replicas of one weight vector; rank 1's outer weights were changed
    outside the update stream and its round's numbers are NaN, so it is left out of the round.
    The vote says the contributors' (rank 0's) outer state."""
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        weights = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        mesh = WorldMesh()
        outer = DelayedDiloco(DilocoConfig(inner_steps=2, overlap="delayed", compression="none"),
                              mesh, [weights])  # fmt: skip
        mesh.agreed_outer = (0, outer.rounds.node_digest())  # (every rank starts the same)
        with torch.no_grad():
            weights.add_(1.0 if rank == 0 else float("nan"))  # the round's inner steps
            if rank == 1:
                outer.optimizer.weights[0] += 0.5  # (a fault: not in any update)
        outer.start(2)  # the round goes to the background; rank 1 states no norm
        try:
            outer.finish()  # applies it
            q.put((rank, ("applied", outer.outer_steps)))
        except JoinedLate as e:
            q.put((rank, ("left", str(e))))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_delayed_member_left_out_with_other_weights_takes_the_members_state_again(children):
    got = children.ranks(_left_out_worker, 2)
    assert got[0] == ("applied", 1), got  # the contributor commits without it
    kind, why = got[1]
    assert kind == "left" and "differ from the contributors' at outer step 0" in why, got
