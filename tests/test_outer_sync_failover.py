"""DiLoCo's sync point across real nodes: prime-mesh + prime-comm + the outer optimizer.

Three node processes (each its own gloo world) take outer steps; one is SIGKILLed before a
sync. The survivors must re-form, average over the two of them only (no half step that still
counts the dead node), and keep bit-identical outer weights.
"""

import os
import signal

import pytest
import torch
import xxhash

from prime_mesh import Coordinator
from prime_train.diloco import OuterOptimizer

TOKEN = "outer-sync-test-token"
NODES, ROUNDS, KILLED, KILL_ROUND = 3, 4, 2, 2


def perturbation(shape, r, k):
    g = torch.Generator().manual_seed(1000 * r + k)
    return torch.randn(shape, generator=g) * 0.05


def _node(k, address, q):
    torch.set_num_threads(1)
    os.environ["PRIME_TOKEN"] = TOKEN
    from prime_mesh import ElasticDeviceMesh
    from prime_train.config import DilocoConfig
    from prime_train.diloco import Diloco

    mesh = ElasticDeviceMesh(
        address, host="127.0.0.1", heartbeat_interval=0.5, heartbeat_timeout=3.0
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    diloco = Diloco(DilocoConfig(compression="none"), mesh, list(model.parameters()))
    for r in range(ROUNDS):
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(perturbation(p.shape, r, 10 * k + i))
        if k == KILLED and r == KILL_ROUND:
            q.close()
            q.join_thread()  # what this node reported so far reaches the test first
            os.kill(os.getpid(), signal.SIGKILL)
        diloco.start(r)
        report = diloco.finish()
        weights = diloco.optimizer.weights.numpy()
        assert report.outer_sha256 == xxhash.xxh3_128_hexdigest(weights.tobytes())
        q.put((k, r, report.nodes, report.attempts, report.outer_sha256, weights.copy()))
    mesh.close()


def expected_outer():
    """The same rounds in one process: Nesterov on the average over the nodes alive."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    start = [p.detach().clone() for p in model.parameters()]
    outer = OuterOptimizer([torch.nn.Parameter(t.clone()) for t in start])
    trajectory = []
    for r in range(ROUNDS):
        alive = [k for k in range(NODES) if not (k == KILLED and r >= KILL_ROUND)]
        views = [outer.weights[:512].view(16, 32), outer.weights[512:]]  # weight, bias
        # every node's model equals the outer weights after a step, plus its own perturbation
        currents = [
            [v + perturbation(v.shape, r, 10 * k + i) for i, v in enumerate(views)] for k in alive
        ]
        outer.pseudo_gradient.copy_(
            torch.cat(
                [
                    torch.stack([v - c[i] for c in currents]).mean(0).flatten()
                    for i, v in enumerate(views)
                ]
            )
        )
        outer.apply()
        trajectory.append(outer.weights.clone())
    return trajectory


@pytest.mark.timeout(240)
def test_killed_node_is_dropped_and_survivors_average_over_themselves(children):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=NODES).start()
    try:
        q = children.queue()
        for k in range(NODES):
            children.process(_node, k, coord.address, q)
        got = [q.get(timeout=180) for _ in range(NODES * ROUNDS - (ROUNDS - KILL_ROUND))]
    finally:
        coord.close()
    want = expected_outer()
    for r in range(ROUNDS):
        rows = [g for g in got if g[1] == r]
        alive = NODES if r < KILL_ROUND else NODES - 1
        assert len(rows) == alive
        assert {row[2] for row in rows} == {alive}, f"round {r}: world sizes {rows}"
        assert len({row[4] for row in rows}) == 1, f"round {r}: outer weights differ across nodes"
        torch.testing.assert_close(torch.from_numpy(rows[0][5]), want[r], rtol=1e-5, atol=1e-6)


def _fresh_node(k, address, q):
    """A founder of a fresh run whose starting weights are node 2's own (another seed)."""
    torch.set_num_threads(1)
    os.environ["PRIME_TOKEN"] = TOKEN
    from prime_mesh import ElasticDeviceMesh, MeshEvicted
    from prime_train.config import DilocoConfig
    from prime_train.diloco import Diloco

    mesh = ElasticDeviceMesh(
        address, host="127.0.0.1", heartbeat_interval=0.5, heartbeat_timeout=3.0
    )
    torch.manual_seed(7 if k == 2 else 0)
    model = torch.nn.Linear(32, 16)
    diloco = Diloco(DilocoConfig(compression="none"), mesh, list(model.parameters()))
    try:
        assert diloco.agree_resume_step([]) is None  # no checkpoint anywhere: a fresh run
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(perturbation(p.shape, 0, 10 * k + i))
        diloco.start(0)
        report = diloco.finish()
        q.put((k, "committed", report.nodes, report.outer_sha256))
    except MeshEvicted as e:
        q.put((k, "evicted", 0, str(e)))
    finally:
        mesh.close()


@pytest.mark.timeout(240)
def test_a_founder_starting_from_other_weights_is_told_at_the_first_vote(children):
    """Before any outer step, the founders' starting weights are compared at the first vote
    as every later step's are: the odd one is evicted (to join with the members' state)."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=NODES).start()
    try:
        q = children.queue()
        for k in range(NODES):
            children.process(_fresh_node, k, coord.address, q)
        got = {g[0]: g[1:] for g in (q.get(timeout=180) for _ in range(NODES))}
    finally:
        coord.close()
    assert got[2][0] == "evicted", got
    assert [got[k][:2] for k in (0, 1)] == [("committed", 2)] * 2, got
    assert got[0][2] == got[1][2], got
