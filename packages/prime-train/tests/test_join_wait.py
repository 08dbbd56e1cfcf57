"""A joiner waiting for its admission stops waiting when it can never come, rather than ask on
until the mesh's join_timeout (1800 s): its connection to the coordinator ended (the join
path then registers again; churn seed 27: a joiner SIGSTOPped past the heartbeat timeout
while it waited found its connection ended as CoordinatorLost on SIGCONT and waited on for
good), or the run's members finished it and left (exit 0; in CI a joiner whose snapshot had
come waited so after its only member completed the run). A snapshot whose donors all left
before the admission is a lost place (the join registers again), not the end of the node
(churn seed 116: a node evicted for its weights exited 1 when its one donor was SIGTERMed)."""

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from prime_mesh import Coordinator, CoordinatorLost, ElasticDeviceMesh, RunCompleted
from prime_train.diloco import Membership
from prime_train.diloco.fetch import JoinFailed
from prime_train.diloco.join import LOST, wait_admitted
from prime_train.diloco.listen import JoinedLate

TOKEN = "join-wait-test-token"


@contextmanager
def never_admitted() -> Iterator[tuple[Coordinator, SimpleNamespace]]:
    """A coordinator of min_nodes 2 and one node registered with it (never admitted), as
    `wait_admitted` reads a run: (the coordinator, the run)."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    mesh = None
    try:
        mesh = ElasticDeviceMesh(coord.address, token=TOKEN, wait=False, wait_until_ready=True,
                                 heartbeat_interval=0.2, heartbeat_timeout=1.0)  # fmt: skip
        yield (
            coord,
            SimpleNamespace(
                primary=True,
                placement=SimpleNamespace(  # a node of one rank: rank 0 decides alone
                    membership=SimpleNamespace(mesh=mesh), from_rank0=lambda decide: decide()
                ),
            ),
        )
    finally:
        coord.close()
        if mesh is not None:
            mesh.close()


@pytest.mark.timeout(60)
def test_a_joiner_whose_connection_ends_while_it_waits_for_admission_stops_waiting():
    with never_admitted() as (coord, run):
        coord.close()  # its connection ends, as a stall past the heartbeat timeout ends it
        with pytest.raises(CoordinatorLost):
            wait_admitted(run, SimpleNamespace(snapshot=None))  # (a real run: a Run, a Joining)


@pytest.mark.timeout(60)
def test_a_joiner_whose_run_completes_before_admitting_it_stops_waiting():
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    meshes = []
    try:
        meta = {"config_hash": "h1"}
        member = ElasticDeviceMesh(coord.address, token=TOKEN, metadata=meta,
                                   heartbeat_interval=0.2, heartbeat_timeout=1.0)  # fmt: skip
        meshes.append(member)
        joiner = ElasticDeviceMesh(coord.address, token=TOKEN, metadata=meta, wait=False,
                                   wait_until_ready="auto", heartbeat_interval=0.2,
                                   heartbeat_timeout=1.0)  # fmt: skip
        meshes.append(joiner)
        joiner.ready()  # said at once; admitted at the member's next sync point, which never
        member.close(completed=True)  # comes: the member finished the run and left
        run = SimpleNamespace(
            primary=True,
            placement=SimpleNamespace(  # a node of one rank: rank 0 decides alone
                membership=Membership(joiner, None, joining=True),
                from_rank0=lambda decide: decide(),
            ),
        )
        with pytest.raises(RunCompleted, match="completed while this node waited to join"):
            wait_admitted(run, SimpleNamespace(snapshot=None))  # (its snapshot came, say)
    finally:
        coord.close()
        for mesh in meshes:
            mesh.close()


@pytest.mark.timeout(60)
def test_a_joiner_whose_snapshot_lost_every_donor_before_admission_joins_again():
    with never_admitted() as (_, run):
        gone = JoinFailed("['node1']: no donor of step 90 is left")
        with pytest.raises(JoinedLate, match="fetching the snapshot failed: .*no donor") as e:
            wait_admitted(run, SimpleNamespace(snapshot=SimpleNamespace(failed=gone)))
        assert isinstance(e.value, LOST)  # join_running_job registers again
