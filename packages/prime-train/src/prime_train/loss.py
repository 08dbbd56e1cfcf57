"""The training loss without the full logits: output projection and cross-entropy in chunks.

A batch's logits are tokens x vocabulary: at 2,048 tokens and Llama 3's 128,256-token vocabulary
that is 263M floats (1 GB in float32), and autograd keeps them, their log-softmax and their
gradient alive at once. `linear_cross_entropy` computes the projection and the loss a chunk of
tokens at a time. With gradients wanted, each chunk's gradients (for the hidden states and the
projection weight) are computed in the forward pass, right after its loss, so no chunk's logits
outlive it and backward has nothing to recompute: it scales the stored gradients by the loss's
incoming gradient. The floating-point work is the same as autograd's (one projection, the
softmax, two gradient matmuls); only the summation order over chunks differs.

A batch whose logits fit in one chunk (at most `CHUNK_ELEMENTS`) takes the plain path,
`F.cross_entropy` on the whole logits, so small runs compute exactly what they always did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# logits per chunk: 2**26 floats (256 MB in float32), e.g. 523 tokens of a 128,256-token
# vocabulary. Smaller chunks save little more and cost speed: on CPU the loss of 2,048 tokens x
# 128,256 (forward and backward) took ~1.5-2x the unchunked time in chunks of 130 tokens, about
# the same in chunks of 522 (the projection's matrix products get too thin)
CHUNK_ELEMENTS = 2**26


def chunk_tokens(vocab_size: int, budget: int | None = None) -> int:
    """Tokens per chunk so that one chunk's logits hold at most `budget` elements (default
    `CHUNK_ELEMENTS`)."""
    return max(1, (budget or CHUNK_ELEMENTS) // vocab_size)


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` against `targets`, computed `chunk`
    tokens at a time (default: `chunk_tokens(vocab)`). `h` is (..., dim), `targets` (...),
    `weight` (vocab, dim). Logits are upcast to float32 for the softmax, as the plain path does.

    Under autocast the projection runs in the autocast dtype, as `F.linear` would."""
    h2 = h.reshape(-1, h.shape[-1])
    t = targets.reshape(-1)
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h2, weight = h2.to(dtype), weight.to(dtype)
    elif h2.dtype != weight.dtype:
        h2 = h2.to(weight.dtype)
    n, vocab = h2.shape[0], weight.shape[0]
    chunk = chunk or chunk_tokens(vocab)
    with torch.autocast(h.device.type, enabled=False):
        if n <= chunk:  # the logits fit in one chunk: exactly the unchunked computation
            return F.cross_entropy(F.linear(h2, weight).float(), t)
        if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(h2, weight, t, chunk)
        return _chunked_loss(h2, weight, t, chunk)


def _chunked_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], chunk):
        logits = F.linear(h[i : i + chunk], w).float()
        total += F.cross_entropy(logits, t[i : i + chunk], reduction="sum")
    return total / h.shape[0]


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients chunk by chunk in forward; backward only scales them."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk):  # type: ignore[override]
        n = h.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        # the weight's gradient accumulates over the chunks in float32
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for i in range(0, n, chunk):
            hc, tc = h[i : i + chunk], targets[i : i + chunk]
            logits = F.linear(hc, weight).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            # d(mean loss)/d(logits) = (softmax - one_hot) / n, in place over the logits
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(g.shape[0], device=g.device), tc] -= 1.0
            g = g.div_(n).to(h.dtype)
            if want_h:
                torch.matmul(g, weight, out=grad_h[i : i + chunk])
            if want_w and hc.dtype == torch.float32:
                grad_w.addmm_(g.t(), hc)
            elif want_w:  # bf16/fp16 products, summed in float32
                grad_w.add_(g.t() @ hc)
            del logits, g
        # kept on ctx, not saved for backward: backward scales them in place and hands them
        # over, so no second weight-sized buffer exists (a second backward is not supported)
        ctx.grads = (grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.grads
        if grad_h is None and grad_w is None:
            raise RuntimeError("linear_cross_entropy: backward through the same loss twice")
        ctx.grads = (None, None)
        dh = grad_h.mul_(grad_out.to(grad_h.dtype)) if grad_h is not None else None
        dw = grad_w.mul_(grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, dw, None, None
