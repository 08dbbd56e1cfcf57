"""This node's membership in the run's elastic mesh, and the server sharing its checkpoints.

Joining happens once, while the placement is built (after the intra-node process group, before
the model): the node's index among the nodes comes from it. During the run every call into
the mesh goes through `prime_train.diloco.outer_step.Diloco`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from prime_train.config import Config
from prime_train.errors import ConfigError

if TYPE_CHECKING:
    from prime_mesh import ElasticDeviceMesh


def uses_mesh(cfg: Config) -> bool:
    """Whether this process is one node of a multi-node run."""
    return cfg.mesh.coordinator is not None


class Membership:
    """An `ElasticDeviceMesh` joined with this node's metadata, plus its checkpoint server.

    `joining` is True for a node that found live members when it started (a node joining a
    running job, or one restarted after it died): it registers *waiting*, says `mesh.ready()`
    at once and listens while the members' state comes (`prime_train.diloco.join`).
    `members_seen` is how many members it saw then."""

    def __init__(
        self,
        mesh: ElasticDeviceMesh,
        server: Any | None,
        joining: bool = False,
        members_seen: int = 0,
        token: str | None = None,
    ):
        self.mesh, self.server = mesh, server
        self.joining, self.members_seen, self.token = joining, members_seen, token
        self.completed = False  # set when this node finished the run: said when it leaves

    @classmethod
    def join(
        cls,
        cfg: Config,
        ckpt_dir: Path,
        serve: bool,
        warn,
        *,
        name: str,
        launcher_index: int | None = None,
    ) -> Membership:
        """Serve `ckpt_dir` to joining peers (if `serve`: local rank 0), then join the mesh
        under `name`, advertising the config hash and the server's URL. Both bind the same
        address (`node_address`). The coordinator decides founder or joiner, atomically at
        registration (`wait_until_ready="auto"`): a joiner registers waiting, and nobody
        waits for it while it fetches the members' state."""
        from prime_mesh import ElasticDeviceMesh

        token = cfg.mesh.token.get_secret_value() if cfg.mesh.token else None
        host = node_address(cfg)
        port = serve_port(cfg, launcher_index)
        rate = cfg.mesh.serve_mbit * 1e6 / 8 or None  # bytes/s; 0: no cap
        server = _serve_checkpoints(ckpt_dir, host, port, token, warn, rate) if serve else None

        def register() -> ElasticDeviceMesh:
            return ElasticDeviceMesh(
                cfg.mesh.coordinator,
                host=host,
                name=name,
                metadata={
                    "config_hash": cfg.fingerprint_hash(),
                    "settings": settings_summary(cfg),  # names what differs if refused
                    "serve_url": server.url if server else None,
                },
                token=token,
                heartbeat_interval=cfg.mesh.heartbeat_interval_s,
                heartbeat_timeout=cfg.mesh.heartbeat_timeout_s,
                coordinator_grace_s=cfg.mesh.coordinator_grace_s,
                join_timeout=cfg.mesh.join_timeout_s,
                sync_timeout=cfg.diloco.sync_timeout_s or None,  # 0: the coordinator's auto
                wait_until_ready="auto",
            )

        try:
            mesh = _registered(register, warn)
        except BaseException:
            if server is not None:
                server.close()
            raise
        joining = mesh.joining
        seen = _members_now(mesh) if joining else 0
        return cls(mesh, server, joining=joining, members_seen=seen, token=token)

    def donors(self) -> list[tuple[str, str]]:
        """(node_id, serve_url) of every other member that serves its checkpoints, in rank
        order: not this node, nor a member still listening (it holds no state of the run's
        yet, only, at most, an older snapshot, which the update logs may not bridge)."""
        me = self.mesh.node_id
        return [
            (str(m["node_id"]), str(m["metadata"]["serve_url"]))
            for m in self.mesh.members()
            if m.get("state") == "member"
            and not m.get("listening")
            and (m.get("metadata") or {}).get("serve_url")
            and m.get("node_id") != me
        ]

    def run_completed(self) -> bool:
        """Whether the coordinator says the run was completed by its members (False when it
        cannot say)."""
        try:
            return bool(self.mesh.status().get("completed"))
        except Exception:
            return False

    def close(self) -> None:
        """Leave the mesh gracefully (saying whether this node completed the run) and stop
        serving checkpoints (again: a no-op)."""
        self.mesh.close(completed=self.completed)
        if self.server is not None:
            self.server.close()
            self.server = None


def register(
    cfg: Config,
    ckpt_dir: Path,
    group: dist.ProcessGroup | None,
    primary: bool,
    warn,
    *,
    name: str,
    launcher_index: int | None,
) -> Membership:
    """Register with the run's mesh under `name`, waiting if it has live members: the
    coordinator decides for the whole node at its first rank's registration. The node's local
    rank 0 serves checkpoints; `group` (its ranks) checks they were told alike."""
    membership = Membership.join(
        cfg, ckpt_dir, serve=primary, warn=warn, name=name, launcher_index=launcher_index
    )
    if group is not None:
        told = [None] * dist.get_world_size(group)
        dist.all_gather_object(told, membership.joining, group=group)
        assert len(set(told)) == 1, f"the node's ranks were told differently: {told}"
    return membership


REGISTER_TRIES = 3  # registrations evicted before their admission, in a row, before giving up


def _registered(register: Callable[[], ElasticDeviceMesh], warn) -> ElasticDeviceMesh:
    """`register()`, again when the coordinator evicts it before admitting it: a founder
    waiting for the run to form holds nothing of the run yet, and the coordinator says why
    (the run re-formed from its members after a coordinator restart, so it joins them; or it
    stalled past the heartbeat timeout while it waited)."""
    from prime_mesh import MeshEvicted

    for tries in range(1, REGISTER_TRIES + 1):
        try:
            return register()
        except MeshEvicted as e:
            if tries == REGISTER_TRIES:
                raise
            warn(f"evicted before it was admitted ({e}); registering again")
    raise AssertionError("unreachable")


def settings_summary(cfg: Config) -> dict[str, str]:
    """The settings in the config hash as `{"section.key": value}` (JSON, at most 80
    characters each; "unset" for None): the coordinator names those that differ when it
    refuses a node."""
    return {
        f"{section}.{key}": "unset"
        if value is None
        else json.dumps(value, sort_keys=True, default=str)[:80]
        for section, values in cfg.fingerprint().items()
        for key, value in values.items()
    }


def _members_now(mesh: ElasticDeviceMesh) -> int:
    """How many members the run has as the coordinator sees it (0: it cannot say)."""
    try:
        return sum(1 for m in mesh.members() if m.get("state") == "member")
    except Exception:
        return 0


def node_address(cfg: Config) -> str:
    """The address this node's peers reach it at, for its gloo groups and its checkpoint
    server alike: `mesh.host`, else the address of the interface that reaches the coordinator
    (never 127.0.0.1 for a coordinator on another machine)."""
    from prime_mesh import node_host

    assert cfg.mesh.coordinator is not None
    try:
        return node_host(cfg.mesh.coordinator, cfg.mesh.host)
    except ValueError as e:
        raise ConfigError(f"--mesh.host: {e}") from None


def serve_port(cfg: Config, launcher_index: int | None) -> int:
    """The checkpoint server's port: `mesh.serve_port` (+ K for the launcher's node K), 0: free."""
    if cfg.mesh.serve_port == 0:
        return 0
    port = cfg.mesh.serve_port + (launcher_index or 0)
    if port > 65535:
        raise ConfigError(
            f"--mesh.serve_port {cfg.mesh.serve_port} + node {launcher_index} > 65535"
        )
    return port


def replay_dir(ckpt_dir: Path) -> Path:
    """Where a node keeps the update log it serves (`diloco/replay_log.py`)."""
    return ckpt_dir / "replay"


def _serve_checkpoints(
    ckpt_dir: Path, host: str, port: int, token: str | None, warn, rate: float | None
):
    """The checkpoints and the update log, served to joiners at most at `rate` bytes/s."""
    from prime_ckpt import serve_directory

    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        return serve_directory(
            ckpt_dir,
            host=host,
            port=port,
            token=token,
            max_bytes_per_s=rate,
            files_dir=replay_dir(ckpt_dir),
        )
    except (OSError, ValueError) as e:  # training goes on; joiners use another peer
        warn(f"cannot serve checkpoints to joining peers: {e}")
        return None
