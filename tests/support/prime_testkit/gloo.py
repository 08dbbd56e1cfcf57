"""A gloo world on 127.0.0.1 for tests: the one place that does TCPStore + init_process_group.

Every wait is bounded by `timeout` (rendezvous and collectives), so a rank whose peers never
arrive fails with an error instead of hanging the test.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT = 60.0


def gloo_world(
    rank: int,
    world: int,
    port: int,
    host: str = "127.0.0.1",
    timeout: float = DEFAULT_TIMEOUT,
    host_store: bool | None = None,
) -> dist.TCPStore:
    """Join a `world`-rank gloo default process group as `rank` through the TCPStore at
    host:port, and return the store. Rank 0 hosts the store unless `host_store` says
    otherwise (False: the test process hosts it, see RankPool)."""
    is_master = rank == 0 if host_store is None else host_store
    td = timedelta(seconds=timeout)
    store = dist.TCPStore(
        host, port, world, is_master=is_master, timeout=td, wait_for_workers=False
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=world, timeout=td
    )
    return store


def gloo_group(
    store: dist.Store, name: str, rank: int, world: int, timeout: float = DEFAULT_TIMEOUT
) -> dist.ProcessGroupGloo:
    """A fresh gloo group of `world` ranks under its own store prefix `name` (not registered
    with torch.distributed: pass it as `group=` to the code under test)."""
    prefixed = dist.PrefixStore(name, store)
    return dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=timeout))


class WorldMesh:
    """What prime-train's outer step asks of an ElasticDeviceMesh, over the default gloo group
    (one fixed epoch of every rank): `votes` are the answers of `should_commit` in turn (the
    same on every rank, as a real vote's; when they run out, every vote commits), `regroup`
    what each sync point returns."""

    state, epoch = "member", 1
    norm_outlier: str | None = None  # (one fixed epoch: no norm is compared)
    agreed_outer: tuple[int, str] | None = None  # (nor any outer state)

    def __init__(self, votes: list[bool] | None = None):
        self.global_pg, self.global_world_size = dist.group.WORLD, dist.get_world_size()
        self.global_members = tuple(f"node-{i}" for i in range(self.global_world_size))
        self.node_id = f"node-{dist.get_rank()}"
        self.votes, self.regroup = list(votes or []), False

    @property
    def installed_group(self) -> tuple[int, tuple[str, ...]]:
        return self.epoch, self.global_members

    def maybe_reinit_global_pg(
        self, listening: bool = False, norm2: float | None = None, norm_bound: float = 0.0
    ) -> bool:
        return self.regroup

    def should_commit(self, ok: bool, contributed: bool = True) -> bool:
        return ok and (self.votes.pop(0) if self.votes else True)

    def round_bound(self) -> float:
        return DEFAULT_TIMEOUT

    def collective_timeout(self) -> float:
        return DEFAULT_TIMEOUT

    def should_abort(self) -> bool:
        return False

    def record_collective(self, seconds: float, ok: bool = True) -> None:
        pass

    def note_outer_step(self, outer_steps: int, digest: str) -> None:
        pass
