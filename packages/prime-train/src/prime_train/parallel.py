"""FSDP2 sharding of the model over the node's device mesh (see `placement` for the mesh)."""

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


def build_model(
    model: Transformer, mesh: DeviceMesh, device: torch.device, cfg: TrainConfig, seed: int
) -> bool:
    """Shard a meta-device model, materialise its local shards and initialise them; returns
    whether it computes in bf16."""
    bf16 = use_bf16(cfg, device)
    shard_model(model, mesh, cfg, bf16, pin_memory=device.type == "cuda")
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
