"""A node's registration with the run's mesh (`diloco/membership.py`): a node told to found
the run at a restarted coordinator, which the run's members then re-form, is evicted before
its admission and registers again, as a joiner (churn seed 16). A real coordinator, a
reconnecting member that says what it held, and the trainer's `Membership.join`."""

import threading

import pytest

from prime_mesh import Coordinator
from prime_mesh.client import CoordinatorClient
from prime_mesh.wire import resolve_token
from prime_testkit import wait_until
from prime_train.config import Config
from prime_train.diloco.membership import Membership

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
