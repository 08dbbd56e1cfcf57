"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU and grouped-query attention.

Rotary frequencies are plain (`rope_theta`) or, for Llama 3.1+ checkpoints, scaled the Llama 3
way (`Llama3RopeScaling`). Called with targets, the model returns the mean cross-entropy,
computed in chunks of tokens so that a batch's full logits never exist (`prime_train.loss`).

Presets follow the INTELLECT-1 family (150M, 1B, 7B and the 10B of INTELLECT-1 itself) plus a
tiny debug model for CPU runs. Blocks live in `model.layers` so FSDP2 can shard each one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from prime_train.loss import linear_cross_entropy
from prime_train.tokens import BYTE_VOCAB_SIZE


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face `rope_type = "llama3"`): frequencies
    whose wavelength exceeds `original_max_seq_len / low_freq_factor` are divided by `factor`,
    those shorter than `original_max_seq_len / high_freq_factor` kept, those between blended."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    # the checkpoint's context length (its max_position_embeddings), written back on export
    context_len: int | None = None

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_wavelen = self.original_max_seq_len / self.low_freq_factor
        high_wavelen = self.original_max_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = BYTE_VOCAB_SIZE
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    hidden_dim: int | None = None  # the feed-forward width, when given outright (HF models)
    rope_scaling: Llama3RopeScaling | None = None  # Llama 3.1+ checkpoints (HF "llama3")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("the head size dim/n_heads must be even for rotary embeddings")


# 150M and 1B: the shapes of INTELLECT-1's small runs (Llama-2 tokenizer, 32000 tokens);
# 7B: Llama-2 7B; 10B: INTELLECT-1 (Llama-3 tokenizer, 128256 tokens, GQA with 8 KV heads).
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE_VOCAB_SIZE),
    "150M": ModelArgs(dim=1024, n_layers=12, n_heads=16, vocab_size=32000, multiple_of=256),
    "1B": ModelArgs(dim=2048, n_layers=18, n_heads=16, vocab_size=32000, multiple_of=256),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256),
    "10B": ModelArgs(
        dim=4096,
        n_layers=42,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
    ),
}


def model_args(preset: str, **overrides: int | None) -> ModelArgs:
    """A preset with the non-None `overrides` applied, validated."""
    args = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args


def rope_tables(
    head_dim: int, seq_len: int, theta: float, scaling: Llama3RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv = scaling.apply(inv)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd) of the head dimension
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.kv_heads, a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer_id: int):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        # depth-scaled init of the output projections keeps the residual stream's scale
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1):
            nn.init.trunc_normal_(lin.weight, std=0.02)
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, std=self.out_std)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        a.validate()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([Block(a, i) for i in range(a.n_layers)])
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        cos, sin = rope_tables(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, a.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # set (bf16) when the model is not FSDP2-wrapped: forward then runs under autocast, the
        # unwrapped stand-in for FSDP2's mixed-precision policy
        self.autocast_dtype: torch.dtype | None = None

    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter (also after building on the meta device)."""
        gen_state = torch.random.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed)
        a = self.args
        cos, sin = rope_tables(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, a.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        bound = 3 / math.sqrt(self.args.dim)
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5, a=-bound, b=bound)
        if seed is not None:
            torch.random.set_rng_state(gen_state)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (batch, seq, vocab), or with `targets` (batch, seq) the mean
        cross-entropy, computed chunk by chunk without the batch's full logits."""
        compute = (
            torch.autocast(tokens.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with compute:
            h = self.norm(self.hidden(tokens))
            if targets is None:
                return self.output(h)
            return linear_cross_entropy(h, self.output.weight, targets)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.args.max_seq_len:
            raise ValueError(f"sequence of {s} tokens exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and isinstance(model, Transformer):
        n -= model.tok_embeddings.weight.numel() + model.output.weight.numel()
    return n
