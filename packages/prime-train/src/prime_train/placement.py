"""Where this process sits: its device, its node's process group, and its node's identity.

Built first, in this order: the intra-node process group (torchrun's, or a world of one),
then, for a multi-node run, this local rank's membership in the run's elastic mesh, which
gives the node its index among the nodes. Everything later (file names, log prefix, the
name that owns data slots) reads the identity from here; it is computed once.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from prime_train.checkpointing import checkpoint_dir
from prime_train.config import Config
from prime_train.diloco.membership import Membership, register, uses_mesh
from prime_train.errors import ConfigError
from prime_train.metrics import Log

T = TypeVar("T")
NODE_ENV = "PRIME_LOCAL_NODE"  # set by the local launcher: this process is simulated node k


def launcher_index() -> int | None:
    """The node index the local launcher gave this process, if any."""
    value = os.environ.get(NODE_ENV)
    return int(value) if value is not None else None


@dataclass(frozen=True)
class NodeIdentity:
    """Which node this is: its index among `count` nodes (its log prefix), and,
    for nodes simulated on one machine by the launcher, the index that names its files."""

    index: int = 0
    count: int = 1
    launcher_index: int | None = None
    name: str = "node"  # stable across restarts: names the node's remote checkpoint prefix

    @property
    def suffix(self) -> str:
        """File-name suffix: '' for a node on its own machine or the launcher's node 0."""
        return f"-node{self.launcher_index}" if self.launcher_index else ""


@dataclass
class Placement:
    """The device, the intra-node device mesh (FSDP2), the node, its checkpoint folder and
    its mesh membership."""

    device: torch.device
    device_mesh: DeviceMesh
    node: NodeIdentity
    ckpt_dir: Path
    membership: Membership | None = None
    owns_process_group: bool = False

    @property
    def rank(self) -> int:
        return self.device_mesh.get_local_rank()

    @property
    def world_size(self) -> int:
        return self.device_mesh.size()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group()

    @property
    def prefix(self) -> str:
        return f"[node {self.node.index} rank {self.rank}]"

    def from_rank0(self, fn: Callable[[], T]) -> T:
        """`fn()` on this node's local rank 0, its result on every local rank (one decision
        for the whole node, where the ranks' views could differ)."""
        got: list[Any] = [fn() if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(got, src=0, group=self.group)
        return got[0]

    def close(self) -> None:
        """Leave the mesh, then release the process group if this placement created it.

        The node's ranks leave together (one rank leaving takes the whole node out of the
        mesh), so each waits, boundedly, for its siblings to be done first."""
        if self.membership is not None:
            if self.world_size > 1:
                try:
                    work = dist.barrier(group=self.group, async_op=True)
                    work.wait(timeout=timedelta(seconds=60))
                except RuntimeError:  # a sibling died: the mesh has dropped the node anyway
                    pass
            self.membership.close()
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


def init_process_group(device: torch.device) -> bool:
    """Join torchrun's group (RANK/WORLD_SIZE set) or make a world of one; True if created."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def default_node_name(ckpt_dir: Path, local: int | None) -> str:
    """A node's name when `mesh.node_name` is not given: the host name, plus '-K' for the
    local launcher's node K, else plus a short hash of the node's checkpoint folder, so that
    nodes started by hand on one machine (each with its own folder) never share a name, and
    a node restarted on its folder keeps its own."""
    host = socket.gethostname() or "node"
    if local is not None:
        return f"{host}-{local}"
    digest = hashlib.sha256(str(ckpt_dir.resolve()).encode()).hexdigest()[:6]
    return f"{host}-{digest}"


def init_placement(cfg: Config) -> Placement:
    """The intra-node group and device mesh, then (multi-node) the mesh membership."""
    device = pick_device(cfg.train.device)
    owns = init_process_group(device)
    try:
        device_mesh = init_device_mesh(
            device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",)
        )
        local = launcher_index()
        ckpt_dir = checkpoint_dir(cfg, local)
        name = cfg.mesh.node_name or default_node_name(ckpt_dir, local)
        node = NodeIdentity(index=local or 0, launcher_index=local, name=name)
        membership = None
        if uses_mesh(cfg):
            early = Log(f"[node {local if local is not None else '?'}]", primary=True)
            membership = register(
                cfg,
                ckpt_dir,
                device_mesh.get_group() if dist.get_world_size() > 1 else None,
                primary=device_mesh.get_local_rank() == 0,
                warn=early.warn,
                name=name,
                launcher_index=local,
            )
            mesh = membership.mesh
            if membership.joining:  # not admitted yet: its rank comes later
                index = local if local is not None else membership.members_seen
                count = max(cfg.launch.local_nodes, index + 1, membership.members_seen + 1)
            else:
                index = local if local is not None else mesh.global_rank
                count = max(cfg.launch.local_nodes, mesh.global_world_size)
            node = NodeIdentity(index=index, count=count, launcher_index=local, name=name)
    except BaseException:
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    return Placement(device, device_mesh, node, ckpt_dir, membership, owns_process_group=owns)
