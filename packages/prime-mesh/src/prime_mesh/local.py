"""The node-local side: local rank from torchrun's environment, the shared node key, local_mesh."""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from prime_mesh.errors import MeshError


def local_env(local_rank: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(local_rank, local_world_size) from the arguments, else torchrun's env, else (0, 1)."""
    try:
        lr = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else int(local_rank)
        lws = (
            int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            if local_world_size is None
            else int(local_world_size)
        )
    except ValueError:
        raise MeshError(
            "LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (as torchrun sets them)"
        ) from None
    if not (lws >= 1 and 0 <= lr < lws):
        raise MeshError(f"local rank {lr} is not in [0, local_world_size={lws})")
    return lr, lws


def shared_node_key(local_world_size: int, node_key: str | None) -> str:
    """A key that every local rank of this node shares (and no other node has).

    With several local ranks, local rank 0 draws it and broadcasts it over the intra-node
    default process group, so they register as one node.
    """
    if node_key:
        return node_key
    if local_world_size == 1:
        return uuid.uuid4().hex
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == local_world_size:
        box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])
    raise MeshError(
        f"LOCAL_WORLD_SIZE is {local_world_size}, so the local ranks must agree on one node: "
        "initialise the intra-node default process group first (torchrun + "
        "init_process_group), or pass the same node_key= to every local rank of the node"
    )


def make_local_mesh(local_world_size: int):
    """The intra-node DeviceMesh for FSDP: over the default process group if it is initialised,
    else a world-size-1 CPU mesh (initialising a 1-rank gloo default group for it)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        backend = dist.get_backend()
        device = "cuda" if "nccl" in str(backend) and torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("local",))
    if local_world_size != 1:
        raise MeshError(
            f"local_mesh with local_world_size {local_world_size} needs the intra-node default "
            "process group: call torch.distributed.init_process_group first (torchrun sets it up)"
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("local",))
