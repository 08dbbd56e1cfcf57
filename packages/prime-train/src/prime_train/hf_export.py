"""`prime-train export`: a checkpoint's weights as a Hugging Face Llama folder.

The folder holds config.json, model.safetensors (or numbered shards plus
model.safetensors.index.json above `max_shard_bytes`) and, when the run used a Hugging Face
tokenizer, tokenizer.json with a tokenizer_config.json. Only the model's weights go out; a
DiLoCo checkpoint is taken at an outer step, where the model holds the outer weights.

Tensors are read one at a time from the checkpoint (every rank's shards assembled) and
written shard file by shard file, so memory stays bounded by one output file: the larger of
`max_shard_bytes` and the largest tensor, whatever the size of the model.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from prime_train.checkpointing import checkpoint_dir
from prime_train.config import Config
from prime_train.errors import ConfigError
from prime_train.hf_import import run_model_args
from prime_train.hf_layout import hf_config, hf_name, rotary_heads, to_hf_rows
from prime_train.tokens import HFTokenizer, make_tokenizer

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


class ExportError(ValueError):
    """A run folder or checkpoint that cannot be exported (the message says why)."""


@dataclass(frozen=True)
class Exported:
    step: int
    out: Path
    files: list[str]
    tensors: int


def read_run_config(run_dir: Path) -> Config:
    """The config a run folder was made with, placed at `run_dir` wherever it now lives."""
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ExportError(f"{run_dir} has no config.json; pass a run folder such as runs/debug")
    try:
        cfg = Config.model_validate(json.loads(saved.read_text()))
    except (OSError, ValueError) as e:
        raise ExportError(f"{saved} is unreadable: {e}") from None
    cfg.run.runs_dir, cfg.run.name = run_dir.parent, run_dir.name
    return cfg


def _open_step(ckpt: Path, step: int | None):
    from prime_ckpt import CheckpointError, CheckpointSource, committed_steps, step_dirname

    steps = committed_steps(ckpt)
    if not steps:
        raise ExportError(f"{ckpt} holds no committed checkpoint")
    if step is not None and step not in steps:
        raise ExportError(f"{ckpt} has no step {step}; committed steps: {steps}")
    for s in [step] if step is not None else reversed(steps):
        try:
            src = CheckpointSource.open("disk", ckpt / step_dirname(s))
            for name in src.manifest.files:
                src.verify(name)
            return src
        except CheckpointError as e:
            print(f"prime-train: step {s} skipped: {e}", file=sys.stderr)
    raise ExportError(f"{ckpt}: no committed step verifies")


def _plan_files(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive tensors grouped into files of at most `limit` bytes (or one tensor)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def export_hf(
    run_dir: Path,
    out: Path,
    step: int | None = None,
    node: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Exported:
    """Write the weights of `run_dir`'s checkpoint (newest that verifies, or `step`) of node
    `node` to the new folder `out` in the Hugging Face Llama layout."""
    from safetensors.torch import save_file

    from prime_ckpt import read_tensor, tensor_paths

    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new folder")
    cfg = read_run_config(run_dir)
    ckpt = checkpoint_dir(cfg, node)
    src = _open_step(ckpt, step)
    params = tensor_paths(src, ("model",))
    shapes = {p[1]: shape for p, shape, _ in params}
    if "tok_embeddings.weight" not in shapes:
        raise ExportError(f"{src.dir} holds no prime-train model weights")
    tokenizer = None if cfg.data.source == "synthetic" else make_tokenizer(cfg.data.tokenizer)
    try:
        args = run_model_args(cfg, shapes["tok_embeddings.weight"][0], check=False)
    except ConfigError as e:
        raise ExportError(f"cannot rebuild the run's model shape: {e}") from None
    names = [p[1] for p, _, _ in params]
    sizes = [math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, shape, dt in params]
    groups = _plan_files(sizes, max_shard_bytes)
    n = len(groups)
    file_names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map: dict[str, str] = {}
        for fname, group in zip(file_names, groups, strict=True):
            tensors = {}
            for i in group:
                t = read_tensor(src, ("model", names[i]))
                heads = rotary_heads(names[i], args)
                tensors[hf_name(names[i])] = t if heads is None else to_hf_rows(t, heads)
                weight_map[hf_name(names[i])] = fname
            save_file(tensors, tmp / fname, metadata={"format": "pt"})
            del tensors
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        eos = tokenizer.eos_id if tokenizer is not None else None
        dtype = str(params[0][2]).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf_config(args, eos, dtype), indent=2) + "\n")
        if isinstance(tokenizer, HFTokenizer):
            _write_tokenizer(tmp, tokenizer, cfg)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(src.manifest.step, out, sorted(p.name for p in out.iterdir()), len(names))


def _write_tokenizer(dest: Path, tokenizer: HFTokenizer, cfg: Config) -> None:
    shutil.copyfile(tokenizer.path, dest / "tokenizer.json")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.data.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.eos_token is not None:
        tok_cfg["eos_token"] = tokenizer.eos_token
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1048576' -> bytes (decimal units, as Hugging Face writes them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)
