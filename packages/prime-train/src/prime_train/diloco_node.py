"""One node of a multi-node DiLoCo run: joins the mesh, agrees where to resume, and takes the
outer step every H inner steps through `OuterSync`.

The trainer sees only `DilocoNode.step(step)` (its outer-step seam) and the extra state to
checkpoint; everything about membership stays behind this class.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist

from prime_train.config import Config
from prime_train.diloco import OuterOptimizer
from prime_train.metrics import Log
from prime_train.outer_sync import OuterSync

NODE_ENV = "PRIME_LOCAL_NODE"  # set by the local launcher: this process is simulated node k
_MAX_SHARED_STEPS = 32


def local_node_index() -> int | None:
    """The node index the local launcher gave this process, if any."""
    value = os.environ.get(NODE_ENV)
    return int(value) if value is not None else None


def uses_mesh(cfg: Config) -> bool:
    """Whether this process is one node of a multi-node run."""
    return cfg.mesh.coordinator is not None


class DilocoNode:
    """Mesh membership plus the outer optimizer of this rank's parameter shards."""

    def __init__(self, cfg: Config, log: Log):
        from prime_mesh import ElasticDeviceMesh

        self.cfg, self.log = cfg, log
        token = cfg.mesh.token.get_secret_value() if cfg.mesh.token else None
        self.server = self._serve_checkpoints(token)
        try:
            self.mesh = ElasticDeviceMesh(
                cfg.mesh.coordinator,
                host=cfg.mesh.host,
                metadata={
                    "config_hash": cfg.fingerprint_hash(),
                    "serve_url": self.server.url if self.server else None,
                },
                token=token,
                heartbeat_interval=cfg.mesh.heartbeat_interval_s,
                heartbeat_timeout=cfg.mesh.heartbeat_timeout_s,
            )
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        hint = local_node_index()
        self.node = hint if hint is not None else self.mesh.global_rank
        self.num_nodes = max(cfg.launch.local_nodes, self.mesh.global_world_size)
        self.sync: OuterSync | None = None
        self.totals = {"outer_steps": 0, "comm_bytes": 0, "comm_seconds": 0.0}
        self.metrics = None
        self._last_epoch = self.mesh.epoch
        log.info(
            f"joined the mesh as {self.mesh.node_id}: epoch {self.mesh.epoch}, "
            f"rank {self.mesh.global_rank} of {self.mesh.global_world_size} nodes"
        )

    def _serve_checkpoints(self, token: str | None):
        """Share this node's newest checkpoint with joining peers (local rank 0 only)."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return None
        from prime_ckpt import serve_directory
        from prime_train.checkpointing import checkpoint_dir

        folder = checkpoint_dir(self.cfg, local_node_index())
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return serve_directory(folder, host=self.cfg.mesh.host or "127.0.0.1", token=token)
        except (OSError, ValueError) as e:  # training goes on; joiners use another peer
            self.log.warn(f"cannot serve checkpoints to joining peers: {e}")
            return None

    def attach(self, params: list[torch.Tensor], metrics=None) -> None:
        """Take the model's (sharded) parameters as the outer weights."""
        d = self.cfg.diloco
        outer = OuterOptimizer(params, lr=d.outer_lr, momentum=d.outer_momentum)
        self.sync = OuterSync(outer, self.mesh, compression=d.compression)
        self.metrics = metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint adds for DiLoCo: outer weights, momentum and comm totals."""
        assert self.sync is not None
        return {"outer": self.sync.outer.state_dict(), "totals": dict(self.totals)}

    def loaded(self, state: dict[str, Any]) -> None:
        """After a checkpoint was loaded in place: pick up the plain totals."""
        self.totals.update(state["totals"])

    def agree_resume_step(self, local_steps: list[int]) -> int | None:
        """The newest step every node of the run holds (None: start fresh), agreed in one
        all-gather over the inter-node group."""
        mine = sorted(local_steps)[-_MAX_SHARED_STEPS:]
        t = torch.full((_MAX_SHARED_STEPS,), -1, dtype=torch.int64)
        t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        world = self.mesh.global_world_size
        if world > 1:
            gathered = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(gathered, t, group=self.mesh.global_pg)
        else:
            gathered = [t]
        common = set.intersection(*({int(s) for s in g.tolist() if s >= 0} for g in gathered))
        if local_steps and not common:
            self.log.warn(
                "the nodes share no checkpoint step; starting from scratch "
                f"(this node holds {sorted(local_steps)})"
            )
        return max(common) if common else None

    def step(self, step: int) -> None:
        """The outer step: average pseudo-gradients over live nodes, Nesterov, copy back."""
        assert self.sync is not None, "attach() the model's parameters first"
        report = self.sync.step()
        t = self.totals
        t["outer_steps"] += 1
        t["comm_bytes"] += report.bytes_sent
        t["comm_seconds"] += report.comm_seconds
        digest = self.weights_digest()
        if report.epoch != self._last_epoch:
            self.log.info(
                f"mesh epoch {report.epoch}: {report.world_size} node(s) "
                f"{[m.get('node_id') for m in self.mesh.members()]}"
            )
            self._last_epoch = report.epoch
        self.log.info(
            f"outer step {t['outer_steps']} at step {step} | {report.seconds:.2f} s "
            f"(all-reduce {report.comm_seconds:.2f} s, {report.bytes_sent / 1e6:.2f} MB sent, "
            f"{self.cfg.diloco.compression}) | {report.world_size} node(s), epoch {report.epoch}"
            + (f" | {report.attempts} attempts" if report.attempts > 1 else "")
        )
        if self.metrics is not None:
            self.metrics.write(
                {
                    "step": step,
                    "outer_step": t["outer_steps"],
                    "outer_seconds": report.seconds,
                    "allreduce_seconds": report.comm_seconds,
                    "bytes_sent": report.bytes_sent,
                    "nodes": report.world_size,
                    "epoch": report.epoch,
                    "attempts": report.attempts,
                    "outer_sha256": digest,
                }
            )

    def weights_digest(self) -> str:
        """SHA-256 of this rank's outer weights: equal on every node after an outer step."""
        assert self.sync is not None
        return hashlib.sha256(self.sync.outer.outer.numpy().tobytes()).hexdigest()

    def close(self) -> None:
        self.mesh.close()
        if self.server is not None:
            self.server.close()
