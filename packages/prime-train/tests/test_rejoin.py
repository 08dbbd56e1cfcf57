"""The bound on a node rejoining by itself after it lost its membership (diloco/rejoin.py);
the rejoin itself runs end to end in tests/test_diloco_join.py and tests/test_cut_link.py."""

from types import SimpleNamespace

import pytest

from prime_mesh import CoordinatorLost, MeshError, MeshEvicted
from prime_train.config import Config
from prime_train.config_load import load_config
from prime_train.diloco import JoinedLate
from prime_train.diloco.rejoin import (
    MEMBERSHIP_LOST,
    LeftOutTooOften,
    RejoinsExhausted,
    check_missed_allowed,
    check_rejoin_allowed,
    left_out,
    rejoin_running_job,
)


class Recorder:
    """A stand-in for what a rejoin would touch: it records any use."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def __getattr__(self, name: str):
        self.used.append(name)
        raise AssertionError(f"{name} used after the bound was passed")


def fake_run(max_rejoins: int) -> SimpleNamespace:
    cfg = load_config(None, ["--diloco.max_rejoins", str(max_rejoins)], env={})
    membership = Recorder()
    return SimpleNamespace(
        cfg=cfg, placement=SimpleNamespace(membership=membership), log=Recorder()
    )


def test_default_bound_and_it_is_machine_local():
    assert Config().diloco.max_rejoins == 3
    a = load_config(None, ["--diloco.max_rejoins", "0"], env={})
    assert a.fingerprint_hash() == Config().fingerprint_hash()  # nodes may differ in patience


def test_the_losses_that_trigger_a_rejoin():
    # (JoinedLate: a round's header says this member lacks rounds the others applied)
    assert set(MEMBERSHIP_LOST) == {MeshEvicted, CoordinatorLost, JoinedLate}


@pytest.mark.parametrize("allowed", [0, 2])
def test_one_loss_past_the_bound_stops_with_a_clear_line_and_touches_nothing(allowed):
    run = fake_run(allowed)
    with pytest.raises(RejoinsExhausted) as e:
        rejoin_running_job(run, Recorder(), MeshEvicted("evicted: cut off"), allowed + 1)
    msg = str(e.value)
    assert f"lost its mesh membership {allowed + 1} times" in msg
    assert f"diloco.max_rejoins = {allowed}" in msg and "MeshEvicted: evicted: cut off" in msg
    assert "rerun the same command" in msg
    assert isinstance(e.value, MeshError)  # the CLI prints it as one line and exits 1
    assert run.placement.membership.used == [] and run.log.used == []


def test_rejoins_up_to_the_bound_are_allowed():
    run = fake_run(2)
    for n in (1, 2):
        check_rejoin_allowed(run, MeshEvicted("x"), n)
    with pytest.raises(RejoinsExhausted):
        check_rejoin_allowed(run, MeshEvicted("x"), 3)


def test_leave_outs_are_bounded_in_a_row_by_max_missed_rounds():
    late = MeshEvicted(
        "evicted: did not reach the sync point within 6.0s of the first member (waited 6.0s; "
        "sync timeout): stuck or too slow, left out of the round"
    )
    assert left_out(late) and not left_out(MeshEvicted("evicted: heartbeat timeout"))
    assert not left_out(CoordinatorLost("left out of the round"))  # only an eviction
    assert Config().diloco.max_missed_rounds == 3
    a = load_config(None, ["--diloco.max_missed_rounds", "9"], env={})
    assert a.fingerprint_hash() == Config().fingerprint_hash()  # a node's own patience
    run = fake_run(0)
    for missed in (1, 2):
        check_missed_allowed(run, late, missed)
    with pytest.raises(LeftOutTooOften) as e:
        check_missed_allowed(run, late, 3)
    msg = str(e.value)
    assert "left out of 3 rounds in a row" in msg and "diloco.max_missed_rounds = 3" in msg
    assert isinstance(e.value, MeshError)  # the CLI prints it as one line and exits 1


def test_the_leave_out_marker_is_prime_meshs_reason():
    import inspect

    import prime_mesh.membership
    from prime_train.diloco.rejoin import LEFT_OUT

    # the coordinator's reason for a member late at a sync point ends with it
    assert LEFT_OUT in inspect.getsource(prime_mesh.membership)
