"""The few foreground collectives prime-ckpt issues: all from the caller's thread.

Background threads never touch the process group (a collective from another thread
interleaves with the training loop's collectives and hangs); they coordinate through files.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch
import torch.distributed as dist


def group_info(group: Any) -> tuple[Any, int, int]:
    """(group, rank, world size). `group=None` means the default group when torch.distributed
    is initialized, else a single process."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_int(value: int, op: str, group: Any) -> int:
    """Min or max of an int over the group (identity without a group)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
    return int(t.item())


def agree_nonce(group: Any) -> str:
    """A random id shared by every rank of this run (names the temporary folders)."""
    value = secrets.randbits(62)
    if group is not None:
        t = torch.tensor([value], dtype=torch.int64, device=_device(group))
        dist.broadcast(t, group_src=0, group=group)
        value = int(t.item())
    return f"{value:016x}"
