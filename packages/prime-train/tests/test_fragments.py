"""Streaming outer steps (`[diloco] fragments = F`): the strided assignment, the schedule that
follows the committed count, the config's refusals, the F = 1 hash, and the outer math of two
fragments against hand-computed values over a real 2-process gloo group (fixed updates, no
compression)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from prime_testkit import WorldMesh, free_port, gloo_world
from prime_train.config import Config, DilocoConfig
from prime_train.config_load import check_combined
from prime_train.diloco import Diloco, OuterOptimizer
from prime_train.diloco.fragments import fragment_of, order
from prime_train.errors import ConfigError
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
    with pytest.raises(ValueError, match="needs overlap = 'none' and round_seconds = 0"):
        DilocoConfig(inner_steps=6, fragments=2, overlap="delayed")
    with pytest.raises(ValueError, match="needs overlap = 'none' and round_seconds = 0"):
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
    world, port = 2, free_port()
    q = children.queue()
    for r in range(world):
        children.process(_frag_worker, r, world, port, q)
    results = dict(q.get(timeout=100) for _ in range(world))
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


def test_one_fragment_is_todays_layout():
    model = Transformer(model_args("debug", n_layers=2))
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    one = Diloco(DilocoConfig(), SimpleNamespace(state="joining"), params, names=names)
    assert one.optimizer.digest() == OuterOptimizer(params).digest()
    assert one.period == DilocoConfig().inner_steps
