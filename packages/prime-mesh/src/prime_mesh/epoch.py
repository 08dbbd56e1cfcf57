"""One membership epoch as a node sees it, and the rendezvous and building of its gloo group."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from prime_mesh.errors import CoordinatorLost


@dataclass(frozen=True)
class Epoch:
    """An epoch pushed by the coordinator: its number, group prefix, members in rank order,
    and the members admitted at the sync point that made it (those skip their first one)."""

    number: int
    prefix: str
    members: tuple[str, ...]
    joined: tuple[str, ...] = ()

    @classmethod
    def parse(cls, info: dict) -> Epoch:
        return cls(
            int(info["epoch"]),
            str(info["prefix"]),
            tuple(info["members"]),
            tuple(info.get("joined", ())),
        )


# Replaced groups are kept, never destroyed: a gloo group whose collective is stuck on a lost
# peer blocks (holding the GIL) in its destructor until that peer's process exits.
_RETIRED: list[Any] = []


def retire(pg: Any) -> None:
    """Keep a replaced group alive for good (see _RETIRED)."""
    _RETIRED.append(pg)


def start_build(
    store: Any,
    epoch: Epoch,
    node_id: str,
    local_rank: int,
    host: str,
    timeout: float,
    done: Callable[[], None],
) -> dict:
    """Build the group in a helper thread, so a caller waiting on the coordinator can abandon
    it for a newer epoch; the returned dict gets "pg" or "err", then `done()` is called."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["pg"] = build_group(store, epoch, node_id, local_rank, host, timeout)
        except Exception as e:  # reported to the waiting thread
            box["err"] = e
        finally:
            done()

    threading.Thread(target=run, name=f"mesh-build-{epoch.number}", daemon=True).start()
    return box


def build_group(
    store: Any, epoch: Epoch, node_id: str, local_rank: int, host: str, timeout: float
) -> ProcessGroupGloo:
    """Local rank `local_rank`'s gloo group of `epoch`, rendezvousing under the epoch's prefix
    on a clone of `store` (so an abandoned build never blocks the node's own connection)."""
    prefixed = dist.PrefixStore(f"prime-mesh/{epoch.prefix}/{local_rank}", store.clone())
    # torch offers no public name for a gloo group's options (devices, timeout): these are
    # the private ones torch.distributed itself uses to build one.
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=timeout)
    return ProcessGroupGloo(prefixed, epoch.members.index(node_id), len(epoch.members), opts)


def connect_store(host: str, port: int, connect_timeout: float, pg_timeout: float) -> Any:
    """A client of the coordinator's TCPStore, through which every epoch's group rendezvous."""
    try:
        store = dist.TCPStore(
            host,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=connect_timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise CoordinatorLost(
            f"cannot reach the coordinator's rendezvous store at {host}:{port} ({e}); "
            "open that port too, or start the coordinator with --advertise-host"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=pg_timeout))
    return store
