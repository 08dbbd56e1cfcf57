"""The coordinator's membership state machine: nodes, epochs, sync barriers and commit votes.

Pure logic, no sockets: every method runs under the coordinator's lock and talks to clients
only through `Conn.send` (which queues). Liveness is judged by this process's monotonic clock
from the heartbeats it receives, never by comparing clocks across machines.

A node is one member however many local ranks it has: each local rank registers over its own
connection with the node's shared key, and losing any of them evicts the whole node, so every
inter-node group (one per local rank) drops it in the same epoch.

A node's states (`status()` shows them):
    registering: some of its local ranks have not registered yet;
    waiting:     all registered and heartbeating, but not every local rank has said it is
                 ready (a joiner still fetching a checkpoint): never admitted, never waited for;
    joining:     ready; admitted at the members' next sync point, in the order nodes became
                 ready (or forms the first epoch once `min_nodes` nodes are joining);
    member:      in the current epoch.
Nodes told to register again (a founder then, or a joiner): one registered to join a run
(`ready: "auto"`) whose every member left, or whose members all arrived at a sync point
listening (its last contributor left: nobody holds its state); one told to found the run at
a restarted coordinator that the run's members then re-form.
A local rank is ready at registration unless it registered with `ready: False`; it says so
later with a `ready` message. A node that dies before it is a member changes no epoch.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from prime_mesh.departures import ORPHANED, REFORMED, STATELESS, Departures, log_departure
from prime_mesh.membership_views import MembershipViews
from prime_mesh.node import Conn, Node, fresh_id, name_held
from prime_mesh.progress import History
from prime_mesh.reform import Completed, NameTaken, Refused, Rejoin, Resume, plan_reform, resume_of
from prime_mesh.registration import check_fits_run, parse_registration
from prime_mesh.round_requests import Ballot, RoundRequests, Slot, outer_of, reply

log = logging.getLogger("prime_mesh.coordinator")
_HELD: Slot = ("", -1)  # a slot no node sends: a vote waits while departures are batched


class Membership(MembershipViews):
    """The state machine (see the module doc); its read-only views are in its base class
    `prime_mesh.membership_views.MembershipViews`."""

    def __init__(
        self,
        min_nodes: int = 1,
        clock: Callable[[], float] = time.monotonic,
        reform_wait: float = 30.0,
        depart_batch_s: float = 0.0,
    ) -> None:
        self.min_nodes = max(1, min_nodes)
        self.reform_wait = reform_wait
        self._reform_since: float | None = None  # first reconnected node of a re-formation
        self._reform_departed: set[str] = set()  # reconnected node ids evicted before it
        self.clock = clock
        self.epoch = 0
        self.prefix = ""
        self.joined: list[str] = []  # node ids admitted at the sync point that made this epoch
        self.members: list[str] = []  # node keys, in rank order
        self.nodes: dict[str, Node] = {}
        self.joiners: list[str] = []  # complete, ready nodes, admitted at the next sync point
        self.gone: set[str] = set()
        self._seq = 0
        self.pending = RoundRequests()  # sync point arrivals and votes in flight
        self.waits = self.pending.waits  # how long late members are waited for (see barrier)
        self.history = History()
        self.completed: str | None = None  # config hash of a run whose members finished it
        self._required_slots: set[Slot] | None = None  # the members' slots (this epoch's)
        # members leaving, batched into one epoch (the coordinator's window; 0: at once)
        self._departing = Departures(clock, depart_batch_s)

    # ---- messages from nodes -------------------------------------------------------------
    def register(self, conn: Conn, msg: dict) -> Node:
        reg = parse_registration(msg)
        key, lr, lws, metadata, name = (
            reg.key, reg.local_rank, reg.local_world_size, reg.metadata, reg.name
        )  # fmt: skip
        if key in self.gone:
            if msg.get("resume") is not None:  # cut off or stalled while this coordinator ran
                raise Rejoin("this node was evicted; rejoin through live recovery")
            raise Refused("this node was evicted; create a new ElasticDeviceMesh to rejoin")
        if name is not None:  # first: a name taken is the clearest reason to refuse
            holder = next(
                (n for k, n in self.nodes.items() if k != key and n.node_id == name), None
            )
            if holder is not None and msg.get("resume") is None:
                raise NameTaken(name_held(holder, self.state_of(holder), self.clock()))
        check_fits_run(reg, self.run_node(exclude=key))
        if (
            self.completed is not None
            and not self.members
            and metadata.get("config_hash") == self.completed
            and msg.get("resume") is None
        ):
            raise Completed("the run is complete: its members finished every step and left")
        others = {n.node_id: n for k, n in self.nodes.items() if k != key}
        resume = resume_of(msg.get("resume"), epoch=self.epoch, other_ids=set(others))
        if resume is not None:
            self._seq = max(self._seq, resume.highest_number)
        node = self.nodes.get(key)
        if node is None:
            node_id = resume.node_id if resume is not None else name  # (a reconnected: its id)
            if node_id is None:
                self._seq, node_id = fresh_id(self._seq, set(others))
            node = Node(key, node_id, lws, metadata, reg.heartbeat_timeout,
                        sync_timeout=reg.sync_timeout)  # fmt: skip
            node.resume = resume
            # "auto": decided here, once per node, atomically with the registration: a node
            # arriving while the run has members (or is being re-formed) joins it, waiting
            # until it fetched their state; otherwise it is one of the nodes forming the run
            node.joining = msg.get("ready") == "auto" and self.running()
            node.founding = msg.get("ready") == "auto" and not node.joining
            self.nodes[key] = node
        elif node.local_world_size != lws or lr in node.conns:
            raise Refused(
                f"local rank {lr} of {node.node_id} registered twice or with another size"
            )
        if lr == 0:
            node.metadata = metadata
            node.address = conn.peer.rpartition(":")[0]
        node.conns[lr] = conn
        node.last_seen[lr] = self.clock()
        ready = msg.get("ready", True)  # absent: a client from before the waiting state
        if ready is not False and not (ready == "auto" and node.joining):
            node.ready_ranks.add(lr)
        log.info("%s local rank %d/%d registered from %s", node.node_id, lr, lws, conn.peer)
        if node.complete and not node.ready:
            log.info("%s is waiting until it is ready (metadata %s)", node.node_id, node.metadata)
        self._maybe_queue(node)
        return node

    def leave(self, node: Node, completed: bool) -> None:
        """`node` leaves gracefully; `completed`: it finished the run (a later registration
        with the same config is told the run is complete)."""
        if completed and node.member:
            self.completed = node.metadata.get("config_hash")
        self.evict(node, "left gracefully")

    def ready(self, node: Node, lr: int) -> None:
        """Local rank `lr` of `node` is ready to be admitted (a no-op once it is a member)."""
        node.ready_ranks.add(lr)
        self._maybe_queue(node)

    def _maybe_queue(self, node: Node) -> None:
        if node.complete and node.ready and not node.member and node.key not in self.joiners:
            self.joiners.append(node.key)
            log.info("%s is ready to join (metadata %s)", node.node_id, node.metadata)
            self._maybe_bootstrap()

    def heartbeat(self, node: Node, lr: int, progress: Any = None) -> None:
        node.last_seen[lr] = self.clock()
        if progress is not None:
            self.history.report(node.node_id, progress, run=node.metadata.get("config_hash"))

    def sync(self, node: Node, lr: int, conn: Conn, req: int, msg: dict) -> None:
        """A member reached a sync point; answer when every member has (or at once if stale)."""
        if not node.member or msg.get("epoch") != self.epoch:
            conn.send(reply(req, epoch=self.epoch_info()))
            return
        self.pending.arrive((node.key, lr), conn, req, msg, self.clock())
        self._check_barrier()

    def vote(self, node: Node, lr: int, conn: Conn, req: int, msg: dict) -> None:
        """A ballot (`msg`: epoch, seq, ok, outer). A ballot of a vote already decided gets
        its result, even once a later epoch began; a member whose outer state differs from
        the majority's is evicted, told why (see `prime_mesh.round_requests`)."""
        epoch, seq = msg.get("epoch"), int(msg.get("seq", 0))
        decided = self.pending.decided.get((epoch, seq)) if isinstance(epoch, int) else None
        if decided is not None:
            conn.send(reply(req, **decided))
            return
        if not node.member or epoch != self.epoch:
            conn.send(reply(req, result=False, reason="the epoch changed"))
            return
        required = self._required() | {_HELD} if self._departing else self._required()
        ballot = Ballot(conn, req, bool(msg.get("ok")), outer_of(msg))
        odd = self.pending.vote(
            self.epoch, seq, (node.key, lr), ballot, required, self.members, self.clock()
        )
        for key in dict.fromkeys(o.slot[0] for o in odd):  # (once per node)
            self.evict(self.nodes[key], next(o for o in odd if o.slot[0] == key).reason())

    def evict(self, node: Node, reason: str) -> None:
        """Evict `node`: a joiner at once, a member with the batch of departures (see
        `prime_mesh.departures`)."""
        if self.nodes.get(node.key) is not node:
            return
        if node.member:
            self._departing.add(node, reason)
            log_departure(node, reason)  # now, not when the batch takes effect
            if not self._departing.window:
                self._evict(self._departing.take(), logged=True)
        else:
            self.evict_all([node], reason)

    def evict_all(self, nodes: list[Node], reason: str) -> None:
        """Evict `nodes` (those still here) for `reason` at once; the members that stay get
        one new epoch (late members left out together), with the departures batched so far."""
        for node in nodes:
            if self.nodes.get(node.key) is node:
                log_departure(node, reason)
        self._evict([(n, reason) for n in nodes] + self._departing.take(due_only=False), True)

    def _evict(self, batch: list[tuple[Node, str]], logged: bool = False) -> None:
        """Evict each node of `batch` (those still here) for its reason; one new epoch.
        `logged`: the batch's departures were logged as they came."""
        here = {n.key: (n, r) for n, r in reversed(batch) if self.nodes.get(n.key) is n}
        batch = list(reversed(here.values()))  # once each, with its first reason
        if not batch:
            return
        leaving = {n.key for n, _ in batch}  # (the joiners' events name the members that stay)
        staying = [self.nodes[k].node_id for k in self.members if k not in leaving]
        for node, reason in batch:
            kind = "left" if reason == "left gracefully" else "evicted"
            del self.nodes[node.key]
            self.gone.add(node.key)
            if node.key in self.joiners:
                self.joiners.remove(node.key)
            if node.resume is not None and not self.members:  # not waited for by a re-formation
                self._reform_departed.add(node.node_id)
            if not logged:
                log_departure(node, reason)
            self.history.departed_node(node.node_id, node.address, kind, reason)
            if not node.member:  # a joiner: no new epoch, but the page says what happened
                self.history.event(kind, self.epoch, node.node_id, reason, staying)
            for c in node.conns.values():
                c.send({"type": "evicted", "reason": reason, "node_id": node.node_id})
                c.close_after_flush()
        members = [(n, r) for n, r in batch if n.member]
        if members:
            ids = ", ".join(n.node_id for n, _ in members)
            reasons = list(dict.fromkeys(r for _, r in members))
            reason = reasons[0] if len(reasons) == 1 else "; ".join(reasons[:3])
            kind = "left" if reasons == ["left gracefully"] else "evicted"
            gone = {n.key for n, _ in members}
            self._new_epoch(
                [k for k in self.members if k not in gone],
                f"{ids} left: {reason}",
                (kind, ids, reason),
            )
        self._maybe_bootstrap()

    def tick(self) -> None:
        now = self.clock()
        if self._reform_since is not None and not self.members:
            self._maybe_bootstrap()  # the re-formation's wait may have run out
        silent = []  # evicted at once (the heartbeat timeout is their wait), with the batch
        for node in list(self.nodes.values()):
            for lr, seen in node.last_seen.items():
                if (age := now - seen) > node.heartbeat_timeout:
                    why = (f"no heartbeat from local rank {lr} for {age:.1f}s "
                           f"(timeout {node.heartbeat_timeout:g}s): stalled or cut off")  # fmt: skip
                    silent.append((node, why))
                    log_departure(node, why)
                    break
        self._evict(silent + self._departing.take(due_only=not silent), logged=True)
        self._leave_out_late(now)

    def _leave_out_late(self, now: float) -> None:
        """Evict the members that did not follow the first one to a sync point or vote
        within the limit (see `prime_mesh.barrier`): stuck while heartbeating, or too late."""
        if not self.members:
            return
        limit = self.waits.limit(self.nodes[k].sync_timeout for k in self.members)
        over = self.pending.overdue(now, limit)
        if over is None:
            return
        what, waited, here = over
        late = [
            self.nodes[k]
            for k in self.members
            if any((k, lr) not in here for lr in range(self.nodes[k].local_world_size))
        ]
        if not late:  # cannot happen (the wait would have completed): stop the clock
            self.waits.reset()
            return
        self.evict_all(
            late,
            f"did not reach the {what} within {limit:.1f}s of the first member "
            f"(waited {waited:.1f}s; sync timeout): stuck or too slow, left out of the round",
        )

    # ---- epochs --------------------------------------------------------------------------
    def _new_epoch(
        self,
        members: list[str],
        why: str,
        event: tuple[str, str | None, str] | None = None,
        joined: list[str] | None = None,
    ) -> None:
        self.epoch += 1
        self.prefix = secrets.token_hex(16)  # 128 bits, sent over the authenticated channel only
        # Nodes admitted at the members' sync point: that sync point counts as theirs, so their
        # first one must not wait for the members' next (nodes that formed the run meet at
        # their first sync point, as no sync point admitted them).
        self.joined = [self.nodes[k].node_id for k in joined or []]
        for key in self.members:
            if key in self.nodes and key not in members:
                self.nodes[key].member = False
        self.members = members
        self._required_slots = None
        for key in members:
            self.nodes[key].member = True
            if key in self.joiners:
                self.joiners.remove(key)
        info = self.epoch_info()
        kind, node_id, reason = event or ("rebuilt", None, why)
        self.history.event(kind, self.epoch, node_id, reason, info["members"])
        log.info(
            "epoch %d: %d members %s (%s)",
            self.epoch,
            len(members),
            [self.nodes[k].node_id for k in members],
            why,
        )
        # Everyone waiting at the old barrier or in an old vote is answered now.
        self.pending.new_epoch(info, self._required())
        for key in members:
            for conn in self.nodes[key].conns.values():
                conn.send({"type": "epoch", "epoch": info})

    def _check_barrier(self) -> None:
        if not self.members or self._departing:  # the departures' epoch answers them
            return
        passed = self.pending.sync_passed(self._required(), self.clock())
        if passed is None:
            return
        if self.pending.listening >= self._required():  # (then its joiners are orphans)
            self.evict_all([self.nodes[k] for k in self.members], STATELESS)
            return
        all_admit, failed = passed
        admit = all_admit and self.joiners
        if admit or failed:
            joiners = list(self.joiners) if admit else []
            ids = ", ".join(self.nodes[k].node_id for k in joiners)
            if joiners:
                self._new_epoch(
                    self.members + joiners,
                    f"admitted {ids}",
                    ("joined", ids, "admitted at a sync point"),
                    joined=joiners,
                )
            else:
                self._new_epoch(self.members, "rebuilt after a failed collective")
        else:
            self.pending.release(self.epoch_info())

    def _maybe_bootstrap(self) -> None:
        if self.members:
            return
        resumes = [r for k in self.joiners if (r := self.nodes[k].resume) is not None]
        if resumes:
            self._reform(resumes)
            return
        self._reform_since = None  # the reconnected nodes are gone again
        if self.completed is not None and any(
            n.metadata.get("config_hash") == self.completed for n in self.nodes.values()
        ):
            return  # nodes of the completed run: nothing left to train (they are told so)
        # joining a run with no members: nobody can hand them its state; they register again
        # as founders, and the run forms anew from the newest state any of them holds
        orphans = [n for n in self.nodes.values() if n.joining]
        if orphans:
            self.evict_all(orphans, ORPHANED)
            return
        founders = [k for k in self.joiners if not self.nodes[k].joining]
        if founders and len(self.joiners) >= self.min_nodes:
            ids = ", ".join(self.nodes[k].node_id for k in founders)
            self._new_epoch(founders, "formed", ("formed", ids, f"{self.min_nodes} node(s) needed"))

    def _reform(self, resumes: list[Resume]) -> None:
        """Apply the re-formation `plan_reform` makes of the reconnected nodes, if it is time."""
        if self._reform_since is None:
            self._reform_since = self.clock()
        waited = self.clock() - self._reform_since
        plan = plan_reform(resumes, waited, self.reform_wait, self._reform_departed)
        if plan is None:
            return
        by_id = {n.node_id: n for n in self.nodes.values()}
        self._reform_since, self._reform_departed = None, set()
        self.epoch = plan.above_epoch  # _new_epoch numbers above it
        self._new_epoch([by_id[i].key for i in plan.adopted], plan.why, plan.event)
        for node_id, why in plan.away:  # not members: no new epoch; the node is told why
            self.evict(by_id[node_id], why)
        # told to found the run before its members came back to this coordinator: it joins
        if unfounded := [n for n in self.nodes.values() if n.founding and not n.member]:
            self.evict_all(unfounded, REFORMED)

    def _required(self) -> set[Slot]:
        """The slots of this epoch's members (kept: rebuilt per epoch, not per message)."""
        if self._required_slots is None:
            sizes = [(k, self.nodes[k].local_world_size) for k in self.members]
            self._required_slots = {(k, lr) for k, n in sizes for lr in range(n)}
        return self._required_slots
