"""The Hugging Face Llama layout: parameter names, rotary row order and config.json.

prime-train's attention rotates interleaved pairs of each head's rows (0,1), (2,3), ...;
Hugging Face Llama rotates halves (i, i + head_dim/2). The two layouts give the same model
once the rows of wq and wk are permuted within each head: `to_hf_rows` and its inverse
`from_hf_rows`. Every other tensor is only renamed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from prime_train.errors import ConfigError
from prime_train.model import Llama3RopeScaling, ModelArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class HFFormatError(ConfigError):
    """A Hugging Face folder this model cannot represent (names the field)."""


def hf_name(name: str) -> str:
    """prime-train parameter name -> Hugging Face Llama name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads' rows to permute in this tensor (None: not a rotary projection)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved-pair rows of each head -> rotate-half rows: HF row j is ours 2j, HF row
    head_dim/2 + j is ours 2j + 1."""
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_hf_rows` (any number of whole heads)."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_config(args: ModelArgs, eos_id: int | None, dtype: str = "float32") -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with this shape (readable by transformers 4 and 5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        **rope_config(args),  # may raise max_position_embeddings
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFFormatError(f"{path} not found: give a Hugging Face model folder") from None
    except (OSError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{path} is unreadable: {e}") from None


@functools.lru_cache(maxsize=8)
def _digest(folder: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name, _, _ in stamp:
        h.update(name.encode() + b"\0")
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:32]


def weights_digest(folder: str | Path) -> str:
    """SHA-256 of config.json and the safetensors files: the run's identity for init_from
    (moving the folder keeps it, changing a weight changes it)."""
    folder = Path(folder)
    read_hf_config(folder)  # a clear error for a folder that is not a model
    names = ["config.json"] + sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    try:
        stamp = tuple(
            (n, (folder / n).stat().st_size, (folder / n).stat().st_mtime_ns) for n in names
        )
    except OSError as e:
        raise HFFormatError(
            f"model.init_from = {str(folder)!r}: {e.strerror}: {e.filename}"
        ) from None
    return _digest(str(folder.resolve()), stamp)


def _field(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if cfg.get(key) is None:
        raise HFFormatError(f"{path}: field {key!r} is missing")
    return cfg[key]


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling(cfg: dict[str, Any], path: Path) -> Llama3RopeScaling | None:
    """The rotary scaling of config.json: none, or Llama 3.1's (`rope_type` "llama3", written
    as `rope_scaling` by transformers 4 and as `rope_parameters` by transformers 5)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            continue
        if kind != "llama3":
            raise HFFormatError(
                f"{path}: field {key!r} has rope_type {kind!r}; prime-train supports plain "
                "rotary and rope_scaling of type 'llama3'"
            )
        if rope.get("original_max_position_embeddings") is None:  # as transformers falls back
            rope = {**rope, "original_max_position_embeddings": cfg.get("max_position_embeddings")}
        missing = [k for k in _LLAMA3_KEYS if rope.get(k) is None]
        if missing:
            raise HFFormatError(f"{path}: field {key!r} (llama3) lacks {', '.join(missing)}")
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
            context_len=int(cfg.get("max_position_embeddings") or 0) or None,
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise HFFormatError(
                f"{path}: field {key!r} (llama3) needs high_freq_factor > low_freq_factor"
            )
        return scaling
    return None


def rope_config(args: ModelArgs) -> dict[str, Any]:
    """The rotary settings of config.json, as `rope_parameters` (transformers 5) and
    `rope_scaling` (transformers 4)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is None:
        return {"rope_theta": args.rope_theta, "rope_parameters": params, "rope_scaling": None}
    s = args.rope_scaling
    scaling = {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_seq_len,
    }
    return {
        "rope_theta": args.rope_theta,
        "rope_parameters": {**scaling, "rope_theta": args.rope_theta},
        "rope_scaling": scaling,
        # the context the scaling was made for (Llama 3.1: 131072), not the training length
        "max_position_embeddings": max(args.max_seq_len, s.context_len or 0),
    }


def args_from_hf(folder: Path, max_seq_len: int) -> ModelArgs:
    """The ModelArgs of a Hugging Face Llama folder; what prime-train's model cannot represent
    is an HFFormatError naming the config.json field."""
    cfg = read_hf_config(folder)
    path = folder / "config.json"
    if cfg.get("model_type") not in ("llama", None):
        raise HFFormatError(f"{path}: model_type {cfg['model_type']!r} is not 'llama'")
    rope = cfg.get("rope_parameters") or {}
    scaling = _rope_scaling(cfg, path)
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if cfg.get(key, ok) != ok:
            raise HFFormatError(f"{path}: field {key!r} = {cfg[key]!r} is not supported")
    dim = int(_field(cfg, "hidden_size", path))
    heads = int(_field(cfg, "num_attention_heads", path))
    if cfg.get("head_dim") not in (None, dim // heads) or dim % heads:
        raise HFFormatError(
            f"{path}: field 'head_dim' = {cfg.get('head_dim')} is not hidden_size / "
            f"num_attention_heads = {dim}/{heads}; prime-train needs head_dim = dim / heads"
        )
    try:
        args = ModelArgs(
            dim=dim,
            n_layers=int(_field(cfg, "num_hidden_layers", path)),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(_field(cfg, "vocab_size", path)),
            hidden_dim=int(_field(cfg, "intermediate_size", path)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_seq_len=max_seq_len,
            rope_scaling=scaling,
        )
        args.validate()
    except ValueError as e:
        raise HFFormatError(f"{path}: {e}") from None
    return args
