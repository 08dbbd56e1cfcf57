"""Consolidated weights for use outside Prime: safetensors or a plain torch state dict.

Shards of every rank are assembled into full tensors (the same resharding path as loading
onto one rank), so a checkpoint saved by FSDP2 on W ranks exports as ordinary tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from prime_ckpt.reader import Source, apply_plan, plan_load

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def consolidate(step_dir: Path) -> tuple[int, dict]:
    """The full state of a committed step folder, every tensor whole, on CPU."""
    src = Source.open("disk", step_dir)
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
    """The safetensors layout: u64 header length, JSON header, then the raw bytes in order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    blobs = []
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(
                f"{name}: dtype {t.dtype} has no safetensors code; export with --format torch"
            )
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + len(data)],
        }
        pos += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
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
