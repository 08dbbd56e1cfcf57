"""A run's model shape and starting weights: the preset, or a Hugging Face Llama folder.

With `[model] init_from = DIR` the shape comes from DIR/config.json and each rank reads only
the rows of its FSDP2 shard from the safetensors files (memory-mapped by `safetensors`), so a
model larger than one rank's memory loads. Weights are cast to the model's dtype (bf16/fp16
upcast), a tied lm_head is untied (copied from the embedding), and wq/wk rows go back from
Hugging Face's rotate-half order to prime-train's interleaved pairs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from prime_train.config import Config
from prime_train.errors import ConfigError
from prime_train.hf_layout import (
    HFFormatError,
    args_from_hf,
    from_hf_rows,
    hf_name,
    read_hf_config,
    rotary_heads,
)
from prime_train.model import ModelArgs, model_args

_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer some older exports carry


def run_model_args(cfg: Config, tokenizer_vocab: int | None, check: bool = True) -> ModelArgs:
    """The model shape of a run. `tokenizer_vocab` is None for synthetic data; `check=False`
    skips comparing init_from's shape with the preset (a saved config lists every field)."""
    m = cfg.model
    if m.init_from is not None:
        args = args_from_hf(Path(m.init_from), cfg.data.seq_len)
        if check:
            _check_agrees(cfg, args)
        if tokenizer_vocab is not None and tokenizer_vocab > args.vocab_size:
            raise HFFormatError(
                f"{m.init_from}/config.json: field 'vocab_size' = {args.vocab_size} is smaller "
                f"than the tokenizer's {tokenizer_vocab} tokens; use a matching data.tokenizer"
            )
        return args
    preset_vocab = model_args(m.preset).vocab_size
    if tokenizer_vocab is None:
        vocab = m.vocab_size or preset_vocab
    else:
        vocab = m.vocab_size or (tokenizer_vocab if m.preset == "debug" else preset_vocab)
        if tokenizer_vocab > vocab:
            raise ConfigError(
                f"the tokenizer has {tokenizer_vocab} tokens but the model only {vocab}; "
                f"set model.vocab_size >= {tokenizer_vocab}"
            )
    try:
        return model_args(
            m.preset,
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads,
            vocab_size=vocab,
            max_seq_len=cfg.data.seq_len,
        )
    except ValueError as e:
        raise ConfigError(f"[model] settings give an invalid shape: {e}") from None


def _check_agrees(cfg: Config, hf: ModelArgs) -> None:
    m = cfg.model
    theirs = {k: getattr(hf, k) for k in _SHAPE_FIELDS} | {"n_kv_heads": hf.kv_heads}
    for key in _SHAPE_FIELDS:
        ours = getattr(m, key)
        if ours is not None and ours != theirs[key]:
            raise ConfigError(
                f"model.{key} = {ours} disagrees with {m.init_from}/config.json ({theirs[key]}); "
                "with model.init_from the shape comes from config.json: drop the override"
            )
    if "preset" in m.model_fields_set:
        p = replace(model_args(m.preset), max_seq_len=hf.max_seq_len)
        ours = {k: getattr(p, k) for k in _SHAPE_FIELDS} | {"n_kv_heads": p.kv_heads}
        if m.preset == "debug":  # the debug preset takes the tokenizer's vocabulary
            ours["vocab_size"] = theirs["vocab_size"]
        diff = [k for k in _SHAPE_FIELDS if ours[k] != theirs[k]]
        if diff or p.ffn_hidden != hf.ffn_hidden:
            k = diff[0] if diff else "ffn_hidden"
            raise ConfigError(
                f"model.preset = {m.preset!r} disagrees with {m.init_from}/config.json "
                f"({k}: {ours.get(k, p.ffn_hidden)} vs {theirs.get(k, hf.ffn_hidden)}); "
                "with model.init_from leave model.preset unset"
            )


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise HFFormatError(f"{index} is unreadable: {e}") from None
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFFormatError(f"{folder} holds no *.safetensors weights")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({name: f for name in sf.keys()})  # noqa: SIM118 (not a dict)
    return out


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """(local tensor, whole shape, first dim-0 row) of a parameter, FSDP2-sharded or not."""
    from prime_ckpt import is_dtensor, shard_rows

    if is_dtensor(p):
        local, shape, row, _ = shard_rows(p)
        return local, shape, row
    return p, list(p.shape), 0


@torch.no_grad()
def load_hf_weights(model: nn.Module, args: ModelArgs, folder: str | Path) -> None:
    """Fill each parameter's local shard from the folder's safetensors, reading only its rows."""
    from safetensors import safe_open

    folder = Path(folder)
    files = weight_files(folder)
    tied = bool(read_hf_config(folder).get("tie_word_embeddings", False))
    wanted = set()
    handles: dict[Path, object] = {}
    try:
        for name, p in model.named_parameters():
            key = hf_name(name)
            if key == "lm_head.weight" and (tied or key not in files):
                if key not in files and not tied:
                    raise HFFormatError(
                        f"{folder}: no 'lm_head.weight' and config.json field "
                        "'tie_word_embeddings' is not true"
                    )
                key = "model.embed_tokens.weight"  # untied: the output starts as a copy
            if key not in files:
                raise HFFormatError(f"{folder}: tensor {key!r} is missing")
            wanted.add(key)
            f = files[key]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt").__enter__()
            sl = handles[f].get_slice(key)
            local, shape, lo = _local_rows(p)
            if list(sl.get_shape()) != shape:
                raise HFFormatError(
                    f"{f}: tensor {key!r} has shape {tuple(sl.get_shape())}, the model from "
                    f"config.json needs {tuple(shape)}"
                )
            hi = lo + (local.shape[0] if local.dim() else 0)
            heads = rotary_heads(name, args)
            if heads is None:
                rows = sl[lo:hi]
            else:  # whole heads around the shard, back to interleaved pairs, then the shard
                hd = shape[0] // heads
                h0, h1 = lo // hd, -(-hi // hd)
                rows = from_hf_rows(sl[h0 * hd : h1 * hd], h1 - h0)[lo - h0 * hd : hi - h0 * hd]
            local.copy_(rows.to(local.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    extra = [k for k in files if k not in wanted and not k.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise HFFormatError(
            f"{folder}: tensors the Llama model does not have: {', '.join(sorted(extra)[:4])}"
        )
