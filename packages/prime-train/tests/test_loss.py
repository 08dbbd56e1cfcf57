"""The chunked loss: the output projection and cross-entropy a chunk of tokens at a time equal
the unchunked loss and its gradients, and backward keeps no chunk's logits."""

import pytest
import torch
import torch.nn.functional as F

from prime_train import loss as loss_mod
from prime_train.loss import chunk_tokens, linear_cross_entropy
from prime_train.model import ModelArgs, Transformer


def reference(h, w, t):
    return F.cross_entropy(F.linear(h, w).float().flatten(0, -2), t.flatten())


def leaves(n=300, dim=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, generator=g).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) * 0.2).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 7, 64, 299, 300, 1000])
def test_chunked_loss_and_gradients_equal_the_unchunked(chunk):
    h, w, t = leaves()
    want = reference(h, w, t)
    gh, gw = torch.autograd.grad(want, (h, w))
    got = linear_cross_entropy(h, w, t, chunk=chunk)
    # a scaled loss (a micro-batch's share) scales both gradients
    dh, dw = torch.autograd.grad(got * 0.25, (h, w))
    assert got.dtype == torch.float32 and got.shape == ()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got, want)
    assert torch.allclose(dh, 0.25 * gh, rtol=1e-5, atol=1e-9)
    assert torch.allclose(dw, 0.25 * gw, rtol=1e-5, atol=1e-9)
    with torch.no_grad():  # evaluation: the same loss, no gradients computed
        assert torch.allclose(linear_cross_entropy(h, w, t, chunk=chunk), want, atol=1e-6)


def test_only_the_inputs_that_need_gradients_get_them():
    h, w, t = leaves()
    w.requires_grad_(False)
    (dh,) = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk=50), (h,))
    assert torch.allclose(dh, torch.autograd.grad(reference(h, w, t), (h,))[0], atol=1e-9)


def test_backward_keeps_no_chunk_logits():
    """Between forward and backward the chunked loss holds its two gradients (hidden-state and
    weight sized), never a chunk's logits; autograd saves nothing for it. The unchunked loss
    does save tokens x vocabulary floats (the measure works)."""
    h, w, t = leaves(n=512, dim=16, vocab=4000)

    def saved(fn):
        sizes = []

        def pack(x):
            sizes.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = fn()
        return out, max(sizes, default=0)

    assert saved(lambda: reference(h, w, t))[1] >= 512 * 4000
    loss, largest = saved(lambda: linear_cross_entropy(h, w, t, chunk=64))
    assert largest == 0
    held = [x.numel() for x in loss.grad_fn.grads]
    assert sorted(held) == [h.numel(), w.numel()]  # 512 x 16 and 4000 x 16, no 512 x 4000
    loss.backward()
    assert loss.grad_fn.grads == (None, None)  # handed over to .grad, not kept
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        loss.backward()


def test_chunk_size_follows_the_vocabulary():
    assert chunk_tokens(128_256) == 523  # 2**26 logits per chunk: 256 MB in float32
    assert chunk_tokens(32_000) == 2097
    assert chunk_tokens(10**9) == 1


def tiny_model(vocab=600, seed=0):
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=64)
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model


def test_the_model_loss_equals_cross_entropy_of_its_logits(monkeypatch):
    """`model(tokens, targets)` in chunks (a small budget forces 10 chunks per batch) equals
    cross-entropy over `model(tokens)`, for the loss and every parameter's gradient."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 600 * 13)  # 13 tokens per chunk
    model = tiny_model()
    tokens = torch.randint(0, 600, (2, 65), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    want = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = model(x, y)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name


def test_the_model_under_autocast_matches_the_plain_bf16_loss(monkeypatch):
    """A node of one rank computes in bf16 under autocast (no FSDP2 mixed precision): the
    chunked loss uses the same bf16 projection as the plain path."""
    model = tiny_model()
    model.autocast_dtype = torch.bfloat16
    tokens = torch.randint(0, 600, (2, 65), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    whole = model(x, y)  # 128 tokens x 600 fit in one chunk: the plain path
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 600 * 13)
    chunked = model(x, y)
    chunked.backward()
    assert torch.allclose(chunked, whole, rtol=1e-3)
    assert model.output.weight.grad.dtype == torch.float32
    model.autocast_dtype = None
    assert torch.allclose(model(x, y), whole, rtol=2e-2)  # float32 vs bf16: close
