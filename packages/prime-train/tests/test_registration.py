"""A node's registration with the run's mesh (`diloco/membership.py`): a node told to found
the run at a restarted coordinator, which the run's members then re-form, is evicted before
its admission and registers again, as a joiner (churn seed 16). A real coordinator, a
reconnecting member that says what it held, and the trainer's `Membership.join`. And a
joiner whose coordinator went away before its outer step was built: the outer step is built
(the join then finds the coordinator gone and registers again), not a CoordinatorLost."""

import threading

import pytest

from prime_mesh import Coordinator, CoordinatorLost, ElasticDeviceMesh
from prime_mesh.client import CoordinatorClient
from prime_mesh.wire import resolve_token
from prime_testkit import wait_until
from prime_train.config import Config, DilocoConfig
from prime_train.diloco import Diloco
from prime_train.diloco.membership import Membership
from prime_train.model import Transformer, model_args

TOKEN = "test-token-registration"


@pytest.mark.timeout(120)
def test_a_founder_the_run_re_formed_without_registers_again_as_a_joiner(tmp_path):
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=2).start()
    member = None
    try:
        cfg = Config.model_validate(
            {"mesh": {"coordinator": coord.address, "token": TOKEN, "heartbeat_timeout_s": 5}}
        )
        warned: list[str] = []
        got: dict = {}

        def join() -> None:  # a founder: it waits for a second one (min_nodes 2)
            got["membership"] = Membership.join(cfg, tmp_path, serve=False, warn=warned.append,
                                                name="fresh")  # fmt: skip

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        wait_until(lambda: coord.status()["nodes"], 30, what="the founder's registration")
        # the run's member reconnects, saying what it held before the coordinator restarted
        member = CoordinatorClient(coord.address, resolve_token(TOKEN), heartbeat_timeout=5)
        resume = {"node_id": "node-1", "epoch": 4, "members": ["node-1"], "outer_step": 9,
                  "outer_hash": "h"}  # fmt: skip
        member.request({"type": "register", "node_key": "m", "local_rank": 0,
                        "local_world_size": 1, "resume": resume, "heartbeat_timeout": 5,
                        "metadata": {"config_hash": cfg.fingerprint_hash()}},
                       timeout=10)  # fmt: skip
        member.start_heartbeats()
        joiner.join(60)
        assert not joiner.is_alive(), "the founder never registered again"
        membership = got["membership"]
        try:
            assert membership.joining and membership.members_seen == 1
            assert len(warned) == 1 and "re-formed from its members" in warned[0], warned
            assert "registering again" in warned[0]
        finally:
            membership.close()
    finally:
        if member is not None:
            member.close()
        coord.close()


def _lost(mesh: ElasticDeviceMesh) -> bool:
    try:
        mesh.state  # noqa: B018 (the check raises what the connection's end left)
    except CoordinatorLost:
        return True
    return False


@pytest.mark.timeout(60)
def test_an_outer_step_is_built_for_a_joiner_whose_coordinator_went_away():
    """Churn seed 0 (stop 42): a node registered as a joiner, and the coordinator was killed
    before the node built its outer step, which asked the mesh for its state: the node exited
    1 on CoordinatorLost instead of registering again once its join began."""
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=1).start()
    mesh = ElasticDeviceMesh(coord.address, host="127.0.0.1", token=TOKEN, wait=False)
    try:
        coord.close()
        wait_until(lambda: _lost(mesh), 30, what="the joiner seeing its coordinator gone")
        model = Transformer(model_args("debug", n_layers=2))
        names = [n for n, _ in model.named_parameters()]
        outer = Diloco(DilocoConfig(), mesh, list(model.parameters()), names=names)
        assert outer.rounds.last_epoch is None  # not admitted: its first round says the epoch
    finally:
        try:
            mesh.close()
        except CoordinatorLost:  # (nothing left to leave)
            pass
