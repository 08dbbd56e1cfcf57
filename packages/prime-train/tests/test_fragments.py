"""Streaming outer steps (`[diloco] fragments = F`): the strided assignment, the schedule that
follows the committed count, the config's refusals, the F = 1 hash, and the outer math of two
fragments against hand-computed values over a real 2-process gloo group (fixed updates, no
compression), with and without overlap (`overlap = "delayed"`: each fragment's all-reduce
starts at its sync point and is applied at the next one, H / F inner steps later, one fragment
in flight; the synced fragment's replica is rebased on the new outer weights keeping the
progress made while it was in flight; a run resumed from a checkpoint taken with a fragment in
flight ends exactly as the uninterrupted one)."""

import copy

import pytest
import torch
import torch.distributed as dist

from prime_mesh import MeshError
from prime_testkit import WorldMesh, gloo_world
from prime_train.config import Config, DilocoConfig
from prime_train.config_load import check_combined
from prime_train.diloco import DelayedDiloco, Diloco, OuterOptimizer
from prime_train.diloco.fragments import fragment_of, order
from prime_train.errors import ConfigError
from prime_train.metrics import Metrics, read_metrics
from prime_train.model import Transformer, model_args


def test_strided_assignment_of_a_six_layer_model():
    model = Transformer(model_args("debug", n_layers=6))
    names = [n for n, _ in model.named_parameters()]
    got = {n: fragment_of(n, 3) for n in names}
    assert got["tok_embeddings.weight"] == 0
    assert got["norm.weight"] == 2 and got["output.weight"] == 2
    for i in range(6):
        assert all(f == i % 3 for n, f in got.items() if n.startswith(f"layers.{i}."))
    idx = order(names, 3)
    assert [fragment_of(names[i], 3) for i in idx] == sorted(got.values())
    assert order(names, 1) == list(range(len(names)))  # F = 1: today's layout


def test_config_refusals_and_hash():
    assert "fragments" not in Config().fingerprint()["diloco"]  # F = 1: earlier runs' hash
    on = Config(diloco=DilocoConfig(inner_steps=6, fragments=3))
    assert on.fingerprint()["diloco"]["fragments"] == 3
    assert on.fingerprint_hash() != Config(diloco=DilocoConfig(inner_steps=6)).fingerprint_hash()
    with pytest.raises(ValueError, match="fragments = 4 must divide inner_steps = 6"):
        DilocoConfig(inner_steps=6, fragments=4)
    DilocoConfig(inner_steps=6, fragments=2, overlap="delayed")  # streaming with overlap
    with pytest.raises(ValueError, match="needs round_seconds = 0"):
        DilocoConfig(inner_steps=6, fragments=2, round_seconds=5.0)
    cfg = Config.model_validate(
        {"model": {"n_layers": 2}, "diloco": {"inner_steps": 6, "fragments": 3}}
    )
    with pytest.raises(ConfigError, match="more than the model's 2 layers"):
        check_combined(cfg, env={})


class Tiny(torch.nn.Module):
    """Two one-weight 'layers' (fragments 0 and 1), an embedding (0) and a head (1)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        self.layers = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor([10.0])),
                                              torch.nn.Parameter(torch.tensor([20.0]))])  # fmt: skip
        self.head = torch.nn.Parameter(torch.tensor([5.0]))


def _frag_worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        model = Tiny()
        names = [n for n, _ in model.named_parameters()]  # embed, head, layers.0, layers.1
        cfg = DilocoConfig(inner_steps=4, fragments=2, compression="none",
                           outer_lr=0.5, outer_momentum=0.5)  # fmt: skip
        outer = Diloco(cfg, WorldMesh(), list(model.parameters()), names=names)
        out: dict = {"boundaries": [s for s in range(1, 9) if outer.is_boundary(s)],
                     "fragments": [], "hashes": [], "outer": [], "model": [], "momentum": []}  # fmt: skip
        for sync in range(3):  # syncs after inner steps 2, 4, 6: fragments 0, 1, 0
            with torch.no_grad():  # a round's inner steps: +1 on rank 0, +3 on rank 1
                for p in model.parameters():
                    p.add_(1.0 + 2.0 * rank)
            frag = outer.fragments.index(outer.outer_steps)
            outer.start(2 * (sync + 1))
            report = outer.finish()
            out["fragments"].append(frag)
            out["hashes"].append(report.outer_sha256)
            out["outer"].append(outer.optimizer.weights.tolist())
            out["momentum"].append(outer.optimizer.momentum_buffer.tolist())
            local = torch.empty_like(outer.optimizer.weights)
            outer.optimizer.copy_model_into(local)  # the model's weights in the outer layout
            out["model"].append(local.tolist())
        out["count"] = outer.outer_steps
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def _step(w, g, m, lr=0.5, mu=0.5):
    """Nesterov as the outer optimizer takes it: m = mu m + g; w -= lr (g + mu m)."""
    m = mu * m + g
    return w - lr * (g + mu * m), m


@pytest.mark.timeout(120)
def test_two_fragments_outer_math_by_hand(children):
    results = children.ranks(_frag_worker, 2)
    a, b = results[0], results[1]
    assert a["boundaries"] == [2, 4, 6, 8]  # a sync every H / F = 2 inner steps
    assert a["fragments"] == b["fragments"] == [0, 1, 0]  # from the committed count
    assert a["hashes"] == b["hashes"] and len(set(a["hashes"])) == 3
    assert a["count"] == 3  # outer_step counts syncs
    # layout (fragment by fragment): embed[0], embed[1], layers.0 | head, layers.1
    # each round moves every weight by +1 (rank 0) / +3 (rank 1): the average move is +2, so
    # a synced fragment's pseudo-gradient is -2 per round it was left to train
    w0, m0 = _step(1.0, -2.0, 0.0)  # sync 1, fragment 0: g = -2
    assert w0 == pytest.approx(1.0 + 0.5 * (2.0 + 1.0))
    want_outer_1 = [w0, w0 + 1.0, w0 + 9.0, 5.0, 20.0]
    assert a["outer"][0] == pytest.approx(want_outer_1)
    assert a["momentum"][0] == pytest.approx([m0, m0, m0, 0.0, 0.0])  # fragment 1 untouched
    # the synced fragment's local weights reset to the new outer weights; the other keeps its
    # local progress (+1 on rank 0, +3 on rank 1)
    assert a["model"][0] == pytest.approx([w0, w0 + 1.0, w0 + 9.0, 6.0, 21.0])
    assert b["model"][0] == pytest.approx([w0, w0 + 1.0, w0 + 9.0, 8.0, 23.0])
    # sync 2, fragment 1: trained two rounds since its last sync, g = -4 (its first step)
    w1h, m1 = _step(5.0, -4.0, 0.0)
    w1, _ = _step(20.0, -4.0, 0.0)
    assert a["outer"][1] == pytest.approx([w0, w0 + 1.0, w0 + 9.0, w1h, w1])
    assert a["momentum"][1] == pytest.approx([m0, m0, m0, m1, m1])
    # sync 3, fragment 0 again: two rounds since its sync (H = 2 rounds), g = -4, m0 carried
    w2, m2 = _step(w0, -4.0, m0)
    assert a["outer"][2] == pytest.approx([w2, w2 + 1.0, w2 + 9.0, w1h, w1])
    assert a["momentum"][2] == pytest.approx([m2, m2, m2, m1, m1])
    assert a["model"][2][3:] == pytest.approx([w1h + 1.0, w1 + 1.0])  # one round on rank 0
    assert b["model"][2][3:] == pytest.approx([w1h + 3.0, w1 + 3.0])


def _listener_worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        model = Tiny()
        names = [n for n, _ in model.named_parameters()]
        cfg = DilocoConfig(inner_steps=4, fragments=2, compression="none",
                           outer_lr=0.5, outer_momentum=0.5)  # fmt: skip
        mesh = WorldMesh()
        mesh.regroup = True  # (a member then sends the header, as one with data slots does)
        outer = Diloco(cfg, mesh, list(model.parameters()), names=names)
        backlog = torch.full((3,), -2.0)  # fragment 0's sync, committed before rank 1 came
        out: dict = {}
        if rank == 0:  # the member: at count 1, it syncs fragment 1
            outer.apply_update(backlog)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            outer.start(4)
            report = outer.finish()
            out.update(contributors=report.contributors, nodes=report.nodes)
        else:  # the listener: its own count 0 (fragment 0), stating the members' count 1
            outer.optimizer.pseudo_gradient.fill_(7.0)
            outer.fragments.part(1).pseudo_gradient.zero_()
            got = outer.average(contributing=False, count=1)
            out.update(error=got.error, late=got.late, mismatch=got.mismatch,
                       behind=got.behind, buffer=outer.optimizer.pseudo_gradient.tolist())  # fmt: skip
            kept = outer.fragments.part(1).pseudo_gradient.clone()  # what it keeps
            outer.apply_update(backlog)  # catching up: the backlog, then the kept round
            outer.apply_update(kept)
        out.update(count=outer.outer_steps, digest=outer.optimizer.digest(),
                   outer=outer.optimizer.weights.tolist())  # fmt: skip
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_listeners_round_averages_the_members_fragment(children):
    """A listener (`diloco/listen.py`) states the members' count and sends zeros as long as
    their fragment, not its own stale count's: the header matches (no mismatch, not behind),
    the members' update lands in that fragment's buffer, and applying the backlog then the
    kept round, each to its own fragment, gives the member's outer weights bit for bit."""
    results = children.ranks(_listener_worker, 2)
    member, listener = results[0], results[1]
    assert member["contributors"] == 1 and member["nodes"] == 2, member
    assert listener["error"] is None and listener["late"] is None, listener
    assert not listener["mismatch"] and listener["behind"] == 0, listener
    # layout: embed[0], embed[1], layers.0 | head, layers.1; the member's fragment 1 moved +1,
    # so its pseudo-gradient is -1, the average over the one contributor; fragment 0 untouched
    assert listener["buffer"] == [7.0, 7.0, 7.0, -1.0, -1.0], listener
    assert listener["count"] == member["count"] == 2
    assert listener["digest"] == member["digest"], (listener["outer"], member["outer"])


class NotAdmitted:
    """A joiner's mesh before its admission: it holds no group yet."""

    @property
    def installed_group(self) -> tuple[int, tuple[str, ...]]:
        raise MeshError("not admitted yet")


def test_one_fragment_is_todays_layout():
    model = Transformer(model_args("debug", n_layers=2))
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    one = Diloco(DilocoConfig(), NotAdmitted(), params, names=names)
    assert one.optimizer.digest() == OuterOptimizer(params).digest()
    assert one.period == DilocoConfig().inner_steps


CFG = {"inner_steps": 4, "fragments": 2, "compression": "none", "overlap": "delayed",
       "outer_lr": 0.5, "outer_momentum": 0.5}  # fmt: skip


def _round(model, rank):
    """A round's inner steps (H / F = 2): +1 on rank 0, +3 on rank 1, every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0 + 2.0 * rank)


def _outer(model, path):
    metrics = Metrics(path)
    metrics.open(0)
    names = [n for n, _ in model.named_parameters()]  # embed, head, layers.0, layers.1
    return DelayedDiloco(DilocoConfig(**CFG), WorldMesh(), list(model.parameters()),
                         metrics=metrics, names=names)  # fmt: skip


def _layout(outer):
    local = torch.empty_like(outer.optimizer.weights)
    outer.optimizer.copy_model_into(local)  # the model's weights in the outer layout
    return local.tolist()


def _delayed_worker(rank, world, port, folder, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        model = Tiny()
        outer = _outer(model, folder / f"a{rank}.jsonl")
        out: dict = {"outer": [], "model": [], "keys": []}
        saved = None
        for sync in range(3):  # sync points after inner steps 2, 4, 6
            _round(model, rank)
            outer.start(2 * (sync + 1))
            out["outer"].append(outer.optimizer.weights.tolist())
            out["model"].append(_layout(outer))
            state = outer.state_dict()  # (waits for the fragment in flight)
            out["keys"].append((sorted(state), sorted(state["round"])))
            if sync == 1:  # a checkpoint with fragment 1 in flight, and the replica
                saved = (copy.deepcopy(state), [p.detach().clone() for p in model.parameters()])
        outer.finish()
        out["final"] = outer.optimizer.weights.tolist()
        out["final_model"] = _layout(outer)
        out["rows"] = [r for r in read_metrics(folder / f"a{rank}.jsonl") if "outer_step" in r]
        # resume from the checkpoint of sync 2 in a fresh process state: the same end
        assert saved is not None
        model2 = Tiny()
        with torch.no_grad():
            for p, v in zip(model2.parameters(), saved[1], strict=True):
                p.copy_(v)
        outer2 = _outer(model2, folder / f"b{rank}.jsonl")
        outer2.load_state_dict(saved[0])
        _round(model2, rank)
        outer2.start(6)
        outer2.finish()
        out["resumed"] = outer2.optimizer.weights.tolist()
        out["resumed_rows"] = [r for r in read_metrics(folder / f"b{rank}.jsonl")
                               if "outer_step" in r]  # fmt: skip
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_fragments_with_overlap_by_hand(children, tmp_path):
    results = children.ranks(_delayed_worker, 2, tmp_path)
    a, b = results[0], results[1]
    rows = [[(r["outer_step"], r["step"], r["round_step"], r["fragment"]) for r in x["rows"]]
            for x in (a, b)]  # fmt: skip
    # sync points 2, 4, 6 start fragments 0, 1, 0 (the committed count's); each is applied at
    # the next sync point, the last one by `finish` at the last step
    assert rows[0] == rows[1] == [(1, 4, 2, 0), (2, 6, 4, 1), (3, 6, 6, 0)]
    assert [r["outer_sha256"] for r in a["rows"]] == [r["outer_sha256"] for r in b["rows"]]
    assert len({r["outer_sha256"] for r in a["rows"]}) == 3
    # each row counts the outer step's own passes: wall, and the CPU of the thread (<= wall)
    own = [(r["outer_own_s"], r["outer_own_cpu_s"]) for r in a["rows"] + b["rows"]]
    assert all(0 <= cpu <= wall + 1e-3 for wall, cpu in own), own
    # layout: embed[0], embed[1], layers.0 (fragment 0) | head, layers.1 (fragment 1); init
    # [1, 2, 10 | 5, 20]. d = +1 (rank 0) / +3 (rank 1) per round, +2 on average.
    init = [1.0, 2.0, 10.0, 5.0, 20.0]
    assert a["outer"][0] == init  # sync 1 (step 2): fragment 0 in flight, nothing applied
    assert a["model"][0] == [x + 1.0 for x in init] and b["model"][0] == [x + 3.0 for x in init]
    # sync 2 (step 4): fragment 0's average (g = -2, one round) applied
    w0, m0 = _step(0.0, -2.0, 0.0)  # the move of each weight of fragment 0: +1.5
    assert w0 == pytest.approx(1.5)
    assert a["outer"][1] == pytest.approx([1 + w0, 2 + w0, 10 + w0, 5.0, 20.0])
    # fragment 0's replica: the new outer weights plus the round it trained while in flight
    # (one d); fragment 1 is untouched (two rounds of d), now in flight
    for x, d in ((a, 1.0), (b, 3.0)):
        assert x["model"][1] == pytest.approx([1 + w0 + d, 2 + w0 + d, 10 + w0 + d,
                                               5 + 2 * d, 20 + 2 * d])  # fmt: skip
    # sync 3 (step 6): fragment 1's average, two rounds since the start: g = -4
    w1, _ = _step(0.0, -4.0, 0.0)  # +3
    assert a["outer"][2] == pytest.approx([1 + w0, 2 + w0, 10 + w0, 5 + w1, 20 + w1])
    for x, d in ((a, 1.0), (b, 3.0)):  # fragment 1 rebased (one round in flight: + d)
        assert x["model"][2] == pytest.approx([1 + w0 + 2 * d, 2 + w0 + 2 * d, 10 + w0 + 2 * d,
                                               5 + w1 + d, 20 + w1 + d])  # fmt: skip
    # finish: fragment 0's second sync (two rounds since it was last rebased: g = -4, with
    # its momentum m0 carried), then the model is the outer weights
    w2, _ = _step(w0, -4.0, m0)
    final = [1 + w2, 2 + w2, 10 + w2, 5 + w1, 20 + w1]
    assert a["final"] == pytest.approx(final) and b["final"] == pytest.approx(final)
    assert a["final_model"] == pytest.approx(final)
    # a checkpoint's keys are the same at every sync (a joiner loads any of them)
    assert len({repr(k) for k in a["keys"]}) == 1
    # resumed from sync 2's checkpoint (fragment 1 in flight): the same rows and weights
    assert a["resumed"] == a["final"] and b["resumed"] == b["final"]
    same = [(r["outer_step"], r["fragment"], r["outer_sha256"]) for r in a["rows"][1:]]
    assert [(r["outer_step"], r["fragment"], r["outer_sha256"]) for r in a["resumed_rows"]] == same
