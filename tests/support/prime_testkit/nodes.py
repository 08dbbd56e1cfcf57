"""Named node processes driven from a test through queues, for tests that kill or stall
their processes (which a shared RankPool must not have done to it).

    nodes = Nodes(children, node_main, coordinator, token)
    nodes.start("a", host="127.0.0.1")       # node_main("a", coordinator, token, cmds, out, kw)
    nodes.send("a", "allreduce", value=1.0)  # node_main reads ("allreduce", {...}) from cmds
    kw = nodes.expect("a", "ok")             # node_main put ("a", "ok", {...}) on out

`target` is a module-level function (a test helper file's): it runs in a spawned child of
`children`, so it is killed and reaped with the test.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from typing import Any

from prime_testkit.children import Children


class Nodes:
    """N node processes of one `target`, each with its own command and report queues.

    A report queue per node, not one shared: a queue's writers share a lock, and a node
    SIGKILLed while its queue thread held it would silence every other node."""

    def __init__(self, children: Children, target: Callable[..., Any], *args: Any) -> None:
        self.children, self.target, self.args = children, target, args
        self.cmds: dict[str, Any] = {}
        self.reports: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}

    def start(self, name: str, **kwargs: Any) -> None:
        """Start node `name`: target(name, *args, cmds, out, kwargs) in a spawned child."""
        self.cmds[name] = self.children.queue()
        self.reports[name] = self.children.queue()
        self.procs[name] = self.children.process(
            self.target, name, *self.args, self.cmds[name], self.reports[name], kwargs
        )

    def send(self, names: str | list[str], cmd: str, **arg: Any) -> None:
        """Put (cmd, arg) on the command queue of one node or of each of several."""
        for n in [names] if isinstance(names, str) else names:
            self.cmds[n].put((cmd, arg))

    def get(self, name: str, timeout: float = 60.0) -> tuple[str, dict]:
        """Next report (kind, fields) from `name`."""
        try:
            _, kind, kw = self.reports[name].get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no report from {name} within {timeout:.0f}s") from None
        return kind, kw

    def expect(self, name: str, kind: str, timeout: float = 60.0) -> dict:
        """The next report from `name`, which must be of `kind`."""
        got, kw = self.get(name, timeout)
        assert got == kind, f"{name}: expected {kind}, got {got} {kw}"
        return kw

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs[name].pid, sig)
