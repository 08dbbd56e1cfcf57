"""The process group, the intra-node device mesh and FSDP2 sharding of the model.

One process alone gets a gloo world of 1 (no rendezvous needed); under torchrun the usual
RANK/WORLD_SIZE/MASTER_ADDR variables are used. Part 2 (DiLoCo) hands in its own mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from prime_train.config import TrainConfig
from prime_train.config_load import ConfigError
from prime_train.model import Transformer


@dataclass
class Placement:
    """Where this process sits: node (DiLoCo replica) and rank inside the node."""

    device: torch.device
    mesh: DeviceMesh
    node: int = 0
    num_nodes: int = 1
    owns_process_group: bool = False

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def prefix(self) -> str:
        return f"[node {self.node} rank {self.rank}]"

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device = 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'"
        )
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_placement(cfg: TrainConfig, node: int = 0, num_nodes: int = 1) -> Placement:
    """Join (or create) the intra-node process group and build its 1-D device mesh."""
    device = pick_device(cfg.device)
    owns = False
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    return Placement(
        device=device, mesh=mesh, node=node, num_nodes=num_nodes, owns_process_group=owns
    )


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    if cfg.precision == "auto":
        return device.type == "cuda"
    return cfg.precision == "bf16"


def shard_model(
    model: Transformer, mesh: DeviceMesh, cfg: TrainConfig, bf16: bool, pin_memory: bool = True
) -> None:
    """FSDP2: each block is its own unit (gathered just in time), then the root."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else (MixedPrecisionPolicy())
    )
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if cfg.cpu_offload else OffloadPolicy()
    n = len(model.layers)
    for i, block in enumerate(model.layers):
        block.activation_checkpointing = cfg.activation_checkpointing
        if cfg.compile:
            block.compile()
        # the last block is needed again at once by backward: keep it gathered
        fully_shard(
            block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < n - 1
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def build_model(model: Transformer, placement: Placement, cfg: TrainConfig, seed: int) -> bool:
    """Shard a meta-device model, materialise its local shards and initialise them."""
    bf16 = use_bf16(cfg, placement.device)
    shard_model(model, placement.mesh, cfg, bf16, pin_memory=placement.device.type == "cuda")
    model.to_empty(device="cpu" if cfg.cpu_offload else placement.device)
    with torch.no_grad():
        model.init_weights(seed=seed)
    return bf16


def reshard(model: torch.nn.Module) -> None:
    """Free gathered parameters after a forward without backward (evaluation).

    FSDP2 keeps the root and the last block gathered after forward, expecting a backward;
    without this, `model.parameters()` would then return the gathered tensors instead of the
    sharded ones the optimizer and checkpoints hold.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
