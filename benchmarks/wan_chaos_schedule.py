"""The fault schedule of benchmarks/wan_chaos.py: parsing and the default schedules.

A schedule is a list of `WHEN:EVENT[:NODE[:SECONDS]]`, separated by spaces or commas, applied
in order (each waits for its trigger after the previous one fired):

    WHEN   oN   once the job has committed outer step N
           +S   S seconds after the previous event
           Ss   S seconds after the job's first outer step
           back once every running node is a member again and contributed to an outer step
                committed after the previous event (the job has settled)
    EVENT  kill:K                SIGKILL node K's process
           restart:K             run node K's command again (it rejoins by live recovery)
           stall:K:S             SIGSTOP node K for S seconds, then SIGCONT (a straggler)
           cut:K / restore:K     take node K's link down / up (`ip link set eth0 down`)
           add                   start the next spare node (same command, new machine)
           kill-coordinator      SIGKILL the `prime-mesh coordinator` process
           restart-coordinator   run it again on the same address
           stop                  SIGTERM every running node (the end of a run that would
                                 otherwise go on: benchmarks/churn.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NODE_EVENTS = ("kill", "term", "restart", "stall", "cut", "restore")
PLAIN_EVENTS = ("add", "kill-coordinator", "restart-coordinator", "stop")

# every kind of fault, spaced so that the job settles between them
DEFAULT = (
    "o3:kill:1 +5:restart:1 back:stall:2:2 back:cut:0 +10:restore:0 back:add "
    "back:kill-coordinator +6:restart-coordinator"
)
# the --quick test's schedule: the faults that need neither a cut nor a coordinator restart
QUICK = "o2:kill:1 +3:restart:1 back:stall:0:2 back:add"


@dataclass(frozen=True)
class Event:
    when: str  # "o", "+" or "s"
    at: float
    kind: str
    node: int | None = None
    seconds: float = 0.0

    def label(self) -> str:
        who = "" if self.node is None else f" node{self.node}"
        return f"{self.kind}{who}" + (f" {self.seconds:g}s" if self.kind == "stall" else "")


def parse(text: str, nodes: int) -> list[Event]:
    """Events of a schedule string; ValueError naming the bad item and the expected form."""
    events: list[Event] = []
    for item in filter(None, re.split(r"[\s,]+", text.strip())):
        parts = item.split(":")
        try:
            events.append(_parse_one(parts))
        except (ValueError, IndexError) as e:
            raise ValueError(
                f"bad schedule item {item!r}: {e} (write WHEN:EVENT[:NODE[:SECONDS]], "
                "e.g. o3:kill:1, +5:restart:1, 40s:stall:2:2, o8:add)"
            ) from None
    _check(events, nodes)
    return events


def _parse_one(parts: list[str]) -> Event:
    when, kind = parts[0], parts[1]
    if when == "back":
        trigger, at = "b", 0.0
    elif when.startswith("o"):
        trigger, at = "o", int(when[1:])
    elif when.startswith("+"):
        trigger, at = "+", float(when[1:])
    elif when.endswith("s"):
        trigger, at = "s", float(when[:-1])
    else:
        raise ValueError(f"WHEN {when!r} is none of oN, +S, Ss, back")
    if kind in PLAIN_EVENTS:
        if len(parts) != 2:
            raise ValueError(f"{kind} takes no node")
        return Event(trigger, at, kind)
    if kind not in NODE_EVENTS:
        raise ValueError(f"unknown event {kind!r}; known: {', '.join(NODE_EVENTS + PLAIN_EVENTS)}")
    if kind == "stall":
        if len(parts) != 4:
            raise ValueError("stall takes a node and seconds")
        return Event(trigger, at, kind, int(parts[2]), float(parts[3]))
    if len(parts) != 3:
        raise ValueError(f"{kind} takes one node")
    return Event(trigger, at, kind, int(parts[2]))


def _check(events: list[Event], nodes: int) -> None:
    """Node indices exist, restarts follow kills or terms, restores follow cuts, the
    coordinator alternates, nothing follows a stop."""
    total = nodes + sum(e.kind == "add" for e in events)
    dead: set[int] = set()
    cut: set[int] = set()
    coordinator_up = True
    for e in events:
        if e.node is not None and not 0 <= e.node < total:
            raise ValueError(f"{e.label()}: there are nodes 0..{total - 1}")
        if e.kind in ("kill", "term"):
            dead.add(e.node)
        elif e.kind == "restart":
            if e.node not in dead:
                raise ValueError(f"{e.label()}: node {e.node} was not killed or stopped before")
            dead.discard(e.node)
        elif e.kind == "cut":
            cut.add(e.node)
        elif e.kind == "restore":
            if e.node not in cut:
                raise ValueError(f"{e.label()}: node {e.node} was not cut before")
            cut.discard(e.node)
        elif e.kind == "kill-coordinator":
            if not coordinator_up:
                raise ValueError("kill-coordinator: it is already down")
            coordinator_up = False
        elif e.kind == "restart-coordinator":
            if coordinator_up:
                raise ValueError("restart-coordinator: it was not killed before")
            coordinator_up = True
        elif e.kind == "stop" and e is not events[-1]:
            raise ValueError("stop ends the run: it must be the last event")
    if dead or cut or not coordinator_up:
        raise ValueError(
            "the schedule must end with every node restarted, every link restored and the "
            "coordinator up, or the run cannot finish"
        )
