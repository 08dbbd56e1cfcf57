"""Consolidated weights for use outside Prime: safetensors (via the `safetensors` package)
or a plain torch state dict.

Shards of every rank are assembled into full tensors (the same resharding path as loading
onto one rank), so a checkpoint saved by FSDP2 on W ranks exports as ordinary tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prime_ckpt.reader import CheckpointSource, apply_plan, plan_load


def consolidate(step_dir: Path) -> tuple[int, dict]:
    """The full state of a committed step folder, every tensor whole, on CPU."""
    src = CheckpointSource.open("disk", step_dir)
    state: dict = {}
    apply_plan(plan_load(state, src, rank=0, world=1, strict=False))
    return src.manifest.step, state


def flat_tensors(node: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """`{"model": {"0.weight": t}}` -> `{"model.0.weight": t}`; plain values are dropped."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(node, torch.Tensor):
        out[prefix] = node
    elif isinstance(node, dict):
        for k, v in node.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]
) -> None:
    """`tensors` as one safetensors file, written aside and renamed into place."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".part")
    try:
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, tmp, metadata)
    except (ValueError, TypeError) as e:  # e.g. a dtype safetensors has no code for
        raise TypeError(f"cannot write safetensors ({e}); export with --format torch") from None
    tmp.replace(path)


def export(step_dir: Path, out: Path, fmt: str | None = None) -> tuple[int, int]:
    """Write the consolidated step to `out`; returns (step, number of tensors)."""
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "torch")
    step, state = consolidate(step_dir)
    tensors = flat_tensors(state)
    if fmt == "safetensors":
        write_safetensors(tensors, out, {"format": "pt", "prime_ckpt_step": str(step)})
    elif fmt == "torch":
        tmp = out.with_name(out.name + ".part")
        torch.save(state, tmp)  # the user asked for a torch file: for use outside Prime
        tmp.replace(out)
    else:
        raise ValueError(f"unknown export format {fmt!r}; use safetensors or torch")
    return step, len(tensors)
