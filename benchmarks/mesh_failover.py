"""How fast do the survivors of a 4-node prime-mesh run hold a working new group?

Runs an in-process coordinator and N node processes on 127.0.0.1 with real gloo groups, then
measures, from the parent's clock:
  reform   no failure: every node marks its group suspect and calls maybe_reinit_global_pg(),
           until all hold a new epoch's group and finished an all-reduce on it
  sync     a sync point with nothing to change (the barrier alone)
  sigkill  SIGKILL one node while the others are inside an all-reduce, until every survivor
           finished an all-reduce on the new group
  sigstop  the same with SIGSTOP (a straggler: only the heartbeat timeout reveals it)
  stuck    one node heartbeats but never reaches the sync point (its main thread idle): from
           the others' sync point until every one of them finished an all-reduce on the
           group without it (only the sync timeout reveals it)
Each figure is printed against the configured heartbeat timeout (the targets: SIGKILL
within 2 s, SIGSTOP within timeout + one interval), the stuck node against the sync timeout
(the target: within it plus one second).

    uv run python benchmarks/mesh_failover.py [--nodes 4] [--rounds 3]
        [--heartbeat-timeout 3] [--heartbeat-interval 0.5] [--sync-timeout 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
from datetime import timedelta

TOKEN = "benchmark-token"


def node(name: int, address: str, hb: tuple[float, float], sync_s: float, cmds, out) -> None:
    import torch
    import torch.distributed as dist

    from prime_mesh import ElasticDeviceMesh

    torch.set_num_threads(1)
    mesh = ElasticDeviceMesh(
        address,
        host="127.0.0.1",
        token=TOKEN,
        heartbeat_interval=hb[0],
        heartbeat_timeout=hb[1],
        sync_timeout=sync_s,
    )
    out.put((name, "joined", time.time()))
    while True:
        cmd = cmds.get()
        if cmd == "exit":
            mesh.close()
            return
        if cmd in ("reform", "sync"):
            if cmd == "reform":
                mesh.record_collective(0.0, ok=False)
            changed = mesh.maybe_reinit_global_pg()
            t = torch.ones(1024)
            dist.all_reduce(t, group=mesh.global_pg)
            out.put((name, f"{cmd}:{changed}", time.time()))
        elif cmd == "allreduce":  # until it fails or is aborted, then re-form and reduce again
            t = torch.ones(1 << 16)
            work = dist.all_reduce(t, group=mesh.global_pg, async_op=True)
            while True:
                try:
                    work.wait(timedelta(seconds=0.05))
                    break
                except RuntimeError as e:
                    if "timed out" not in str(e).lower():
                        mesh.record_collective(0.0, ok=False)
                        break
                if mesh.should_abort():
                    break
            mesh.maybe_reinit_global_pg()
            t = torch.ones(1 << 16)
            dist.all_reduce(t, group=mesh.global_pg)
            out.put((name, f"reformed:{mesh.global_world_size}", time.time()))


def collect(out, names, timeout: float = 120.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < len(names):
        try:
            name, kind, t = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"no report from {sorted(set(names) - set(got))} in {timeout:.0f}s"
            ) from None
        got[name] = (kind, t)
    return got


def fail_one(procs, cmds, out, alive, sig) -> tuple[float, int]:
    victim, survivors = alive[-1], alive[:-1]
    for n in survivors:
        cmds[n].put("allreduce")
    time.sleep(0.5)  # the survivors are now inside the all-reduce, waiting for the victim
    t0 = time.time()
    os.kill(procs[victim].pid, sig)
    got = collect(out, survivors)
    worlds = {kind for kind, _ in got.values()}
    assert worlds == {f"reformed:{len(survivors)}"}, got
    if sig == signal.SIGSTOP:
        os.kill(procs[victim].pid, signal.SIGKILL)
        os.kill(procs[victim].pid, signal.SIGCONT)
    procs[victim].join(10)
    alive.remove(victim)
    return max(t for _, t in got.values()) - t0, victim


def fail_stuck(procs, cmds, out, alive) -> tuple[float, int]:
    """The last node stays away from the sync point the others reach (it heartbeats on)."""
    victim, survivors = alive[-1], alive[:-1]
    t0 = time.time()
    for n in survivors:
        cmds[n].put("sync")
    got = collect(out, survivors)
    assert {kind for kind, _ in got.values()} == {"sync:True"}, got
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].join(10)
    alive.remove(victim)
    return max(t for _, t in got.values()) - t0, victim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="no-failure re-forms and syncs to time")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--sync-timeout", type=float, default=3.0)
    args = ap.parse_args()
    if args.nodes < 4:
        ap.error("--nodes must be at least 4 (three nodes fail, one must survive)")

    from prime_mesh import Coordinator

    hb = (args.heartbeat_interval, args.heartbeat_timeout)
    ctx = mp.get_context("spawn")
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=args.nodes).start()
    out = ctx.Queue()
    cmds = {i: ctx.Queue() for i in range(args.nodes)}
    procs = {
        i: ctx.Process(
            target=node, args=(i, coord.address, hb, args.sync_timeout, cmds[i], out), daemon=True
        )
        for i in cmds
    }
    alive = list(procs)
    try:
        print(
            f"starting {args.nodes} nodes (heartbeat {hb[0]:g}s / timeout {hb[1]:g}s) ...",
            flush=True,
        )
        for p in procs.values():
            p.start()
        collect(out, alive)
        figures: dict[str, list[float]] = {"sync": [], "reform": []}
        for r in range(args.rounds):
            for cmd in ("sync", "reform"):
                t0 = time.time()
                for n in alive:
                    cmds[n].put(cmd)
                got = collect(out, alive)
                assert {k for k, _ in got.values()} == {f"{cmd}:{cmd == 'reform'}"}, got
                figures[cmd].append(max(t for _, t in got.values()) - t0)
            print(
                f"  round {r + 1}/{args.rounds}: sync {figures['sync'][-1]:.3f}s, re-form {figures['reform'][-1]:.3f}s",
                flush=True,
            )
        stuck_s, v = fail_stuck(procs, cmds, out, alive)
        print(f"  stuck node process {v}: the others re-formed in {stuck_s:.2f}s", flush=True)
        kill_s, v = fail_one(procs, cmds, out, alive, signal.SIGKILL)
        print(f"  SIGKILL node process {v}: survivors re-formed in {kill_s:.2f}s", flush=True)
        stop_s, v = fail_one(procs, cmds, out, alive, signal.SIGSTOP)
        print(f"  SIGSTOP node process {v}: survivors re-formed in {stop_s:.2f}s", flush=True)
    finally:
        for n in alive:
            cmds[n].put("exit")
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        coord.close()

    t, i = args.heartbeat_timeout, args.heartbeat_interval
    med = {k: statistics.median(v) for k, v in figures.items()}
    print()
    print(
        f"summary ({args.nodes} nodes, heartbeat timeout {t:g}s, interval {i:g}s; ratios vs the timeout)"
    )
    print(
        f"  sync point, no change   {med['sync']:7.3f}s  {med['sync'] / t:5.2f}x timeout  (median of {args.rounds})"
    )
    print(
        f"  re-form, no failure     {med['reform']:7.3f}s  {med['reform'] / t:5.2f}x timeout  (median of {args.rounds})"
    )
    print(
        f"  SIGKILL -> new group    {kill_s:7.3f}s  {kill_s / t:5.2f}x timeout  goal < 2s: {'met' if kill_s < 2 else 'MISSED'}"
    )
    print(
        f"  SIGSTOP -> new group    {stop_s:7.3f}s  {stop_s / t:5.2f}x timeout  "
        f"goal < timeout + interval = {t + i:g}s: {'met' if stop_s < t + i else 'MISSED'}"
    )
    st = args.sync_timeout
    print(
        f"  stuck -> new group      {stuck_s:7.3f}s  {stuck_s / st:5.2f}x sync timeout  "
        f"goal < sync timeout + 1s = {st + 1:g}s: {'met' if stuck_s < st + 1 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
