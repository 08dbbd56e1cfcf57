"""This node's membership in the run's elastic mesh, and the server sharing its checkpoints.

Joining happens once, while the placement is built (after the intra-node process group, before
the model): the node's index among the nodes comes from it. During the run every call into
the mesh goes through `prime_train.diloco.outer_step.Diloco`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_train.config import Config

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh


def uses_mesh(cfg: Config) -> bool:
    """Whether this process is one node of a multi-node run."""
    return cfg.mesh.coordinator is not None


class Membership:
    """An `ElasticDeviceMesh` joined with this node's metadata, plus its checkpoint server."""

    def __init__(self, mesh: ElasticDeviceMesh, server: Any | None):
        self.mesh, self.server = mesh, server

    @classmethod
    def join(cls, cfg: Config, ckpt_dir: Path, serve: bool, warn) -> Membership:
        """Serve `ckpt_dir` to joining peers (if `serve`: local rank 0), then join the mesh,
        advertising the config hash and the server's URL."""
        from prime_mesh import ElasticDeviceMesh

        token = cfg.mesh.token.get_secret_value() if cfg.mesh.token else None
        server = _serve_checkpoints(cfg, ckpt_dir, token, warn) if serve else None
        try:
            mesh = ElasticDeviceMesh(
                cfg.mesh.coordinator,
                host=cfg.mesh.host,
                metadata={
                    "config_hash": cfg.fingerprint_hash(),
                    "serve_url": server.url if server else None,
                },
                token=token,
                heartbeat_interval=cfg.mesh.heartbeat_interval_s,
                heartbeat_timeout=cfg.mesh.heartbeat_timeout_s,
            )
        except BaseException:
            if server is not None:
                server.close()
            raise
        return cls(mesh, server)

    def close(self) -> None:
        """Leave the mesh gracefully and stop serving checkpoints."""
        self.mesh.close()
        if self.server is not None:
            self.server.close()


def _serve_checkpoints(cfg: Config, ckpt_dir: Path, token: str | None, warn):
    from prime_ckpt import serve_directory

    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        return serve_directory(ckpt_dir, host=cfg.mesh.host or "127.0.0.1", token=token)
    except (OSError, ValueError) as e:  # training goes on; joiners use another peer
        warn(f"cannot serve checkpoints to joining peers: {e}")
        return None
