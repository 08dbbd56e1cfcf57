"""The Llama-style model: shapes, causality, presets' parameter counts, a tiny overfit."""

import pytest
import torch
import torch.nn.functional as F

from prime_train.model import PRESETS, Transformer, apply_rope, model_args, num_params, rope_tables


@pytest.fixture(autouse=True)
def one_thread():
    """Two torch threads on a shared 2-core machine crawl; one is faster and steadier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Published sizes: Llama-2 7B has exactly 6,738,415,616 parameters; INTELLECT-1 is "10.2B";
# the 150M and 1B of the family are named by their non-embedding and total sizes.
PUBLISHED = {
    "7B": (6_738_415_616, 0.0, False),
    "10B": (10.2e9, 0.005, False),
    "150M": (150e6, 0.05, True),
    "1B": (1e9, 0.06, False),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_on_meta(preset):
    with torch.device("meta"):
        model = Transformer(PRESETS[preset])
    assert all(p.is_meta for p in model.parameters())
    want, tol, non_embedding = PUBLISHED[preset]
    got = num_params(model, exclude_embeddings=non_embedding)
    assert abs(got - want) <= tol * want, (preset, got, want)


def test_intellect1_shape():
    a = PRESETS["10B"]
    assert (a.dim, a.n_layers, a.n_heads, a.kv_heads, a.vocab_size) == (4096, 42, 32, 8, 128256)
    assert a.ffn_hidden == 14336


def test_forward_shapes_and_gqa():
    torch.manual_seed(0)
    args = model_args("debug", dim=64, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=16)
    model = Transformer(args)
    model.init_weights(seed=0)
    assert model.layers[0].attention.wk.weight.shape == (2 * 16, 64)
    x = torch.randint(0, 50, (3, 16))
    assert model(x).shape == (3, 16, 50)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.randint(0, 50, (1, 17)))


def test_causal():
    torch.manual_seed(0)
    model = Transformer(model_args("debug", vocab_size=40, max_seq_len=12))
    model.init_weights(seed=1)
    x = torch.randint(0, 40, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 40
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_rope_rotates_without_changing_norm():
    cos, sin = rope_tables(8, 5, 10000.0)
    x = torch.randn(2, 3, 5, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated


def test_init_is_seeded():
    a = Transformer(model_args("debug"))
    b = Transformer(model_args("debug"))
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_shapes_are_clear():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        model_args("debug", dim=130, n_heads=4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        model_args("debug", n_heads=4, n_kv_heads=3)


def test_tiny_overfit():
    torch.manual_seed(0)
    model = Transformer(model_args("debug", dim=64, n_layers=2, vocab_size=32, max_seq_len=32))
    model.init_weights(seed=0)
    data = torch.randint(0, 32, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_activation_checkpointing_matches():
    torch.manual_seed(0)
    a = Transformer(model_args("debug", vocab_size=40, max_seq_len=8))
    a.init_weights(seed=0)
    x = torch.randint(0, 40, (2, 8))
    grads = []
    for ckpt in (False, True):
        a.zero_grad()
        for layer in a.layers:
            layer.activation_checkpointing = ckpt
        a(x).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in a.parameters()])
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2)
