"""A joiner waiting for its admission whose connection to the coordinator ends: the wait
ends with the loss (the join path then registers again), it does not ask on until the mesh's
join_timeout. Churn seed 27: a joiner SIGSTOPped past the heartbeat timeout while it waited
found its connection ended as CoordinatorLost on SIGCONT and waited on for good."""

from types import SimpleNamespace

import pytest

from prime_mesh import Coordinator, CoordinatorLost, ElasticDeviceMesh
from prime_train.diloco.join import wait_admitted

TOKEN = "join-wait-test-token"


@pytest.mark.timeout(60)
def test_a_joiner_whose_connection_ends_while_it_waits_for_admission_stops_waiting():
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    mesh = None
    try:  # one node of min_nodes 2: never admitted
        mesh = ElasticDeviceMesh(coord.address, token=TOKEN, wait=False, wait_until_ready=True,
                                 heartbeat_interval=0.2, heartbeat_timeout=1.0)  # fmt: skip
        run = SimpleNamespace(
            primary=True,
            placement=SimpleNamespace(  # a node of one rank: rank 0 decides alone
                membership=SimpleNamespace(mesh=mesh), from_rank0=lambda decide: decide()
            ),
        )
        coord.close()  # its connection ends, as a stall past the heartbeat timeout ends it
        with pytest.raises(CoordinatorLost):
            wait_admitted(run, SimpleNamespace(snapshot=None))  # (a real run: a Run, a Joining)
    finally:
        coord.close()
        if mesh is not None:
            mesh.close()
