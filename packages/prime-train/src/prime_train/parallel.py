"""FSDP2 sharding of the model over the node's device mesh (see `placement` for the mesh).

A node of one rank has nothing to shard: there the model stays a plain module (plain tensor
parameters, no all-gather or reduce-scatter per block), computing in bf16 under autocast where
FSDP2 would apply its mixed-precision policy. Only `train.cpu_offload`, which is FSDP2's
offload policy, keeps FSDP2 on one rank. Checkpoints load either way: prime-ckpt reads a plain
tensor's rows into a DTensor shard and a DTensor's shards into a plain tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from prime_train.config import TrainConfig
from prime_train.model import Transformer


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


def uses_fsdp(mesh: DeviceMesh, cfg: TrainConfig) -> bool:
    """FSDP2 when the node has several ranks to shard over (or CPU offload is asked for)."""
    return mesh.size() > 1 or cfg.cpu_offload


def build_model(
    model: Transformer, mesh: DeviceMesh, device: torch.device, cfg: TrainConfig, seed: int
) -> bool:
    """Shard a meta-device model (FSDP2; a node of one rank keeps it whole), materialise its
    local shards and initialise them; returns whether it computes in bf16."""
    bf16 = use_bf16(cfg, device)
    if uses_fsdp(mesh, cfg):
        shard_model(model, mesh, cfg, bf16, pin_memory=device.type == "cuda")
    else:
        for block in model.layers:
            block.activation_checkpointing = cfg.activation_checkpointing
            if cfg.compile:
                block.compile()
        model.autocast_dtype = torch.bfloat16 if bf16 else None
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
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
