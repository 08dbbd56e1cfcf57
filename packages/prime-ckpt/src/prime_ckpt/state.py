"""Turning a nested state into raw tensor bytes plus a msgpack skeleton, without pickle.

The skeleton is the state itself with every tensor replaced by a msgpack ExtType holding its
index in the rank's tensor table. A DTensor contributes only its local shard, with the global
shape and the dim-0 row where the shard starts, so that another world size can reshard it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

TENSOR_EXT = 1
ALIGN = 64
_PLAIN = (bool, int, float, str, bytes, type(None))


def key_str(path: tuple) -> str:
    """Human form of a key path, as used in error messages: `optim/state/0/exp_avg`."""
    return "/".join(str(p) for p in path) or "<root>"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in checkpoint")
    return dt


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a torch DTensor (an FSDP2 parameter, say)."""
    # no import: a DTensor can only exist once its module is loaded (importing it costs seconds)
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def shard_rows(t: torch.Tensor) -> tuple[torch.Tensor, list[int], int, bool]:
    """(local tensor, global shape, dim-0 offset, owner) of a DTensor with Shard(0)/Replicate
    placements; `owner` is False on replicas that must not write a duplicate copy."""
    # torch has no public name for a DTensor's global offset (DCP uses the same helper)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = list(t.placements)
    for p in placements:
        if not (p.is_replicate() or (p.is_shard() and p.dim == 0)):
            raise ValueError(
                f"DTensor placement {p} is not supported; prime-ckpt reshards Shard(0) and "
                "Replicate placements (FSDP2's layout); redistribute to Shard(0) before saving"
            )
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return t.to_local(), list(t.shape), 0, False
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    owner = all(c == 0 for c, p in zip(coord, placements, strict=True) if p.is_replicate())
    row = int(offset[0]) if len(offset) else 0
    return t.to_local(), list(t.shape), row, owner


@dataclass
class TensorItem:
    """One tensor of this rank's shard, and where its bytes go in the rank's data file."""

    path: tuple
    tensor: torch.Tensor
    dtype: str
    shape: list[int]
    global_shape: list[int] | None  # set for DTensors
    row: int
    offset: int = 0
    nbytes: int = 0
    write: bool = True

    def record(self) -> list:
        return [
            list(self.path),
            self.dtype,
            self.shape,
            self.global_shape,
            self.row,
            self.offset,
            self.nbytes,
            self.write,
        ]


def _check_tensor(t: torch.Tensor, path: tuple) -> None:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise TypeError(
            f"cannot checkpoint {key_str(path)}: only dense tensors are supported "
            f"(got layout={t.layout}, device={t.device}, quantized={t.is_quantized}); "
            "convert it with .to_dense() / .dequantize() first"
        )


def _tensor_item(t: torch.Tensor, path: tuple) -> TensorItem:
    global_shape = None
    row = 0
    write = True
    if is_dtensor(t):
        try:
            local, global_shape, row, write = shard_rows(t)
        except ValueError as e:
            raise TypeError(f"cannot checkpoint {key_str(path)}: {e}") from None
    else:
        local = t
    _check_tensor(local, path)
    local = local.detach()
    nbytes = local.numel() * local.element_size() if write else 0
    return TensorItem(
        path, local, dtype_name(local.dtype), list(local.shape), global_shape, row, 0, nbytes, write
    )


def flatten(state: Any) -> tuple[Any, list[TensorItem]]:
    """Split `state` into a msgpack-ready skeleton and its tensors (in visiting order).

    Raises TypeError naming the key of anything that is not a tensor, dict, list, tuple or
    plain value (int, float, str, bool, None, bytes).
    """
    items: list[TensorItem] = []

    def enc(node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            items.append(_tensor_item(node, path))
            return msgpack.ExtType(TENSOR_EXT, (len(items) - 1).to_bytes(4, "little"))
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if not isinstance(k, (str, int)):
                    raise TypeError(
                        f"cannot checkpoint {key_str((*path, k))}: dict keys must be str or int, "
                        f"got {type(k).__name__}"
                    )
                out[k] = enc(v, (*path, k))
            return out
        if isinstance(node, (list, tuple)):
            return [enc(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, _PLAIN):
            if isinstance(node, int) and not -(2**63) <= node < 2**64:
                raise TypeError(f"cannot checkpoint {key_str(path)}: int {node} exceeds 64 bits")
            return node
        raise TypeError(
            f"cannot checkpoint {key_str(path)}: {type(node).__module__}.{type(node).__name__} "
            "is not supported (use tensors, dicts, lists, tuples and int, float, str, bool, "
            "None, bytes; no pickle); convert it first, e.g. to a tensor or a dict"
        )

    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    skeleton = enc(state, ())
    return skeleton, items


def assign_offsets(items: list[TensorItem]) -> int:
    """Lay the tensors out back to back, each aligned to 64 bytes; returns the total size."""
    pos = 0
    for it in items:
        it.offset = pos
        pos += -(-it.nbytes // ALIGN) * ALIGN
    return pos


def layout_key(items: list[TensorItem]) -> tuple:
    """Identifies a layout: equal keys can reuse the same staging buffer."""
    return tuple((it.dtype, tuple(it.shape), it.nbytes) for it in items)


def pack_meta(skeleton: Any, items: list[TensorItem], **info: Any) -> bytes:
    return msgpack.packb(
        {"skeleton": skeleton, "tensors": [it.record() for it in items], **info},
        use_bin_type=True,
    )


def unpack_meta(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def ext_index(node: Any) -> int | None:
    """The tensor index of a skeleton placeholder, or None for anything else."""
    if isinstance(node, msgpack.ExtType) and node.code == TENSOR_EXT:
        return int.from_bytes(node.data, "little")
    return None
