"""A node that did not contribute to a committed round (a listener that has caught up, a
member left out of it) checks its outer state against the one the contributors voted with.
Churn seed 23: the only contributor's weights were changed outside the update stream, and a
listener replaying that stream entered with other weights and wrote a row of another hash
before its first vote could find it. Seed 26: a member left out of a round (a NaN) applied
the only contributor's update on weights that differed from its."""

from types import SimpleNamespace

import pytest
import torch

from prime_train.diloco.late_joiner import JoinedLate, check_holds_agreed
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
    check_holds_agreed(listener([1.0, 2.5], 16, (17, theirs)))  # another step: cannot compare


def test_a_listener_holding_other_weights_takes_the_members_state_again():
    theirs = listener([1.0, 2.0], 17, None).rounds.node_digest()
    odd = listener([1.0, 2.5], 17, (17, theirs))
    with pytest.raises(
        JoinedLate, match=f"at outer step 17: .* contributors voted with {theirs[:16]}"
    ):
        check_holds_agreed(odd)
