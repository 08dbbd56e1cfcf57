"""One membership epoch as a node sees it, and the rendezvous and building of its gloo group."""

from __future__ import annotations

import atexit
import datetime
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from prime_mesh.errors import CoordinatorLost


@dataclass(frozen=True)
class Epoch:
    """An epoch pushed by the coordinator: its number, group prefix, members in rank order,
    the members admitted at the sync point that made it (those skip their first one), and
    the newest checkpoint a node of the run reported (see `ElasticDeviceMesh.
    newest_checkpoint`)."""

    number: int
    prefix: str
    members: tuple[str, ...]
    joined: tuple[str, ...] = ()
    checkpoint: tuple[int, str] | None = None

    @classmethod
    def parse(cls, info: dict) -> Epoch:
        newest = info.get("checkpoint")
        return cls(
            int(info["epoch"]),
            str(info["prefix"]),
            tuple(info["members"]),
            tuple(info.get("joined", ())),
            (int(newest[0]), str(newest[1])) if newest else None,
        )


def _refs(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


_ONLY_LISTED = _refs([object()], 0)  # the count of an object only a list holds


class RetiredGroups:
    """Replaced groups, released once nothing else holds them, off the caller's thread.

    A gloo group holds a store clone, a device (sockets, an epoll file, its own thread) and
    worker threads: kept for good, a member gained about 12 open files and 6 threads per node
    that joined and died. Its destructor waits for the collective in flight, if any, to end
    (one stuck on a stalled peer ends at the group's timeout); torch releases the GIL
    meanwhile, but the main thread must not wait on it. So a watcher thread sweeps the
    retired groups every `interval` seconds while there are any: a group that only this list
    holds (the caller dropped its `global_pg`, and with it any use of the group) is dropped
    in a short-lived thread of its own, where any wait stays.

    At exit, sweeping stops and releases under way are given `exit_wait` seconds to end: a
    thread that finished a release while the interpreter shuts down would abort the process
    (it cannot take the GIL back inside the group's destructor). Groups still retired then
    go with the interpreter's own clean-up, as they did when groups were never released.
    """

    def __init__(self, interval: float = 0.5, exit_wait: float = 10.0) -> None:
        self.interval, self.exit_wait = interval, exit_wait
        self._groups: list[Any] = []
        self._lock = threading.Lock()
        self._watching = False
        self._closing = False
        self._releasing: list[threading.Thread] = []
        atexit.register(self._at_exit)

    def add(self, pg: Any) -> None:
        with self._lock:
            self._groups.append(pg)
            if not self._watching:
                self._watching = True
                threading.Thread(
                    target=self._watch, name="mesh-retired-groups", daemon=True
                ).start()

    def held(self) -> int:
        """Retired groups not released yet."""
        with self._lock:
            return len(self._groups)

    def sweep(self) -> int:
        """Release every group nothing else holds (in a new thread); returns how many."""
        with self._lock:
            if self._closing:
                return 0
            groups = self._groups
            unused = [i for i in range(len(groups)) if _refs(groups, i) <= _ONLY_LISTED]
            done = [groups.pop(i) for i in reversed(unused)]
            if done:
                release = threading.Thread(
                    target=done.clear, name="mesh-release-groups", daemon=True
                )
                self._releasing = [t for t in self._releasing if t.is_alive()] + [release]
                release.start()
        return len(unused)

    def _at_exit(self) -> None:
        with self._lock:
            self._closing = True
            releasing = list(self._releasing)
        deadline = time.monotonic() + self.exit_wait
        for t in releasing:
            t.join(max(0.0, deadline - time.monotonic()))

    def _watch(self) -> None:
        while True:
            time.sleep(self.interval)
            self.sweep()
            with self._lock:
                if not self._groups:
                    self._watching = False
                    return


RETIRED = RetiredGroups()


def retire(pg: Any) -> None:
    """Hand over a replaced group: released once nothing else holds it (see RetiredGroups)."""
    RETIRED.add(pg)


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


# torch's store client looks up the name of its own address while it connects (even with
# logging off); where the resolver is slow that lookup alone takes 5 s, twice (measured in
# a sandbox whose DNS drops concurrent queries: 256 clients at once needed 10 s). A client
# that gave up at 10 s was evicted and came back, over and over.
STORE_CONNECT_MIN_S = 30.0


def connect_store(host: str, port: int, connect_timeout: float, pg_timeout: float) -> Any:
    """A client of the coordinator's TCPStore, through which every epoch's group rendezvous."""
    try:
        store = dist.TCPStore(
            host,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=max(connect_timeout, STORE_CONNECT_MIN_S)),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise CoordinatorLost(
            f"cannot reach the coordinator's rendezvous store at {host}:{port} ({e}); "
            "open that port too, or start the coordinator with --advertise-host"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=pg_timeout))
    return store
