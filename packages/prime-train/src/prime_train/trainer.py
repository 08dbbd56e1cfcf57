"""The training loop of one node: inner steps, the outer step, evaluation, checkpoints, stops.

Start reading here. `train()` sets up in one direction - config -> placement (device, node
group, mesh membership, the node's identity) -> run (model, data, checkpoints) -> outer step
(DiLoCo, for a multi-node run) - and `train_loop(run, outer)` is the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from prime_train.config import Config
from prime_train.diloco import make_outer_step
from prime_train.diloco.committed import LastCommitted
from prime_train.diloco.rejoin import (
    can_rejoin,
    membership_lost,
    rejoin_running_job,
    rejoins_after,
)
from prime_train.metrics import Log
from prime_train.optim import lr_at
from prime_train.placement import Placement, init_placement
from prime_train.reporting import attach_reporting
from prime_train.run import Run
from prime_train.seam import OuterStep
from prime_train.stop import StopSignal
from prime_train.summary import LoopEnd, Summary, finish


class Meter:
    """Mean loss and tokens/s over the steps since the last progress line."""

    def __init__(self, run: Run):
        self.run, self.log = run, run.log
        self.loss = torch.zeros((), device=run.device)
        self.steps, self.session_tokens = 0, 0
        self.last_loss: float | None = None
        self.t0 = self.window_t = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss  # no host sync until the next report
        self.steps += 1
        self.session_tokens += self.run.tokens_per_step

    def report(self, step: int) -> None:
        run = self.run
        mean = self.loss.double() / (self.steps * run.placement.world_size)
        run.all_reduce_sum(mean)
        secs = time.perf_counter() - self.window_t
        tps = self.steps * run.tokens_per_step / secs
        self.last_loss = float(mean)
        lr = lr_at(step, run.cfg.optim, run.cfg.train.steps)
        run.metrics.write(
            {
                "step": step,
                "loss": self.last_loss,
                "lr": lr,
                "tokens": run.progress["tokens"],
                "tokens_per_s": tps,
            }
        )
        self.log.info(
            f"step {step}/{run.cfg.train.steps} | loss {self.last_loss:.4f} | "
            f"lr {lr:.2e} | {tps:,.0f} tok/s"
        )
        self.loss.zero_()
        self.steps = 0
        self.window_t = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.window_t += time.perf_counter() - t


def train(
    cfg: Config,
    placement: Placement | None = None,
    outer: OuterStep | None = None,
    log: Log | None = None,
) -> Summary:
    """Train one node to `train.steps`, resuming from its newest checkpoint if any.

    `placement` defaults to this process alone (or torchrun's group). With `mesh.coordinator`
    set (the local launcher sets it for each node), the node joins the run's mesh and, unless
    another `outer` step is given, takes a DiLoCo outer step every `diloco.inner_steps` steps."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    placement = placement or init_placement(cfg)
    log = log or Log(placement.prefix, primary=placement.rank == 0)
    if placement.membership is not None and placement.membership.joining:
        log.info(
            f"registered with the running job as {placement.membership.mesh.node_id} "
            f"({placement.membership.members_seen} member(s)): waiting, fetching their state"
        )
    elif placement.membership is not None:
        mesh = placement.membership.mesh
        log.info(
            f"joined the mesh as {mesh.node_id}: epoch {mesh.epoch}, "
            f"rank {mesh.global_rank} of {mesh.global_world_size} nodes"
        )
    run: Run | None = None
    try:
        run = Run(cfg, placement, log)
        mesh = placement.membership.mesh if placement.membership is not None else None
        if outer is None and mesh is not None:
            outer = make_outer_step(
                cfg.diloco,
                mesh,
                run.params,
                metrics=run.metrics,
                log=log,
                node_group=placement.group,
            )
        attach_reporting(cfg, run)
        return train_loop(run, outer)
    finally:
        close = getattr(outer, "close", None)
        if close is not None:  # an overlapped outer step may still have a round in flight
            close()
        if run is not None:
            run.close()
        placement.close()


def enter_running_job(run: Run, outer: OuterStep, loaded: int) -> int:
    """A joiner's entry outer step, right after it loaded the members' checkpoint of step
    `loaded` and said ready: admitted at the members' sync point that ends the round they
    started from that checkpoint, it contributes a zero pseudo-gradient (its model is the
    outer weights) and applies the same averaged update. Returns the step it continues from."""
    step = min(loaded + run.cfg.diloco.inner_steps, run.cfg.train.steps)
    outer.contributing = False  # type: ignore[attr-defined]
    try:
        outer.start(step)
        report = outer.finish()
    finally:
        outer.contributing = True  # type: ignore[attr-defined]
    info = run.joined or {}
    run.log.info(
        ("re" if "rejoined" in info else "")
        + f"entered the running job at outer step {getattr(report, 'outer_step', '?')} "
        f"(step {step}), donor {info.get('donor')}: {info.get('bytes', 0) / 1e6:.2f} MB "
        f"fetched in {info.get('seconds', 0.0):.2f} s"
    )
    run.metrics.write(
        {
            "step": step,
            "joined": True,
            "donor": info.get("donor"),
            "fetched_step": loaded,
            "fetch_bytes": info.get("bytes"),
            "fetch_seconds": info.get("seconds"),
            "load_seconds": info.get("load_seconds"),
            **({"rejoined": info["rejoined"]} if "rejoined" in info else {}),
        }
    )
    run.progress["step"] = step
    return step


@contextlib.contextmanager
def checkpoint_if_coordinator_gone(
    run: Run, outer: OuterStep | None, committed: LastCommitted | None
) -> Iterator[None]:
    """Around the outer step and the checkpoint (a delayed outer step's round ends in either):
    when the coordinator did not come back within the grace period, checkpoint the last
    committed outer step and say how to resume (CoordinatorGone)."""
    from prime_mesh import CoordinatorGone

    try:
        yield
    except CoordinatorGone as e:
        if committed is None:
            raise
        committed.checkpoint(run, outer)  # type: ignore[arg-type]
        mesh = run.cfg.mesh
        raise CoordinatorGone(
            f"the coordinator at {mesh.coordinator} did not come back within "
            f"mesh.coordinator_grace_s={mesh.coordinator_grace_s:g}s; checkpointed step "
            f"{committed.step} (the last committed outer step; the inner steps since are "
            "dropped). To resume from it, start the coordinator again and rerun the same "
            "command on every node"
        ) from e


def train_loop(run: Run, outer: OuterStep | None) -> Summary:
    """The loop: inner steps, the outer step every H steps, progress lines, evaluation,
    checkpoints, and a clean stop on SIGINT/SIGTERM."""
    cfg, log = run.cfg, run.log
    total = cfg.train.steps
    start = run.resume(outer)
    if start:
        log.info(f"resumed from the step-{start} checkpoint in {run.ckpt_dir}")
    if start >= total:
        log.info(f"the run is already complete ({start}/{total} steps); nothing to do")
    run.metrics.open(start)
    # (a joiner that fetched the final checkpoint has nothing to enter: the members finished,
    # and their next sync point, where it would be admitted, never comes)
    if run.joined is not None and outer is not None and start < total:
        start = enter_running_job(run, outer, start)
    eval_loss: float | None = None
    if start == 0:
        eval_loss = run.evaluate_and_record(0)
        if cfg.model.init_from is not None:  # the starting weights, exportable as step 0
            run.checkpoint(0, outer)

    meter = Meter(run)  # loss and tokens/s over the steps since the last progress line
    # an overlapped outer step returns from start() with its all-reduce in flight
    overlapped = bool(getattr(outer, "overlapped", False))
    # what to checkpoint should the coordinator not come back
    committed = LastCommitted(run, start) if outer is not None else None
    step, rejoins = start, 0
    rejoinable = can_rejoin(run, outer)
    lost = membership_lost()
    with StopSignal() as stop:
        while step < total:
            step += 1
            t = time.perf_counter()
            meter.add(run.inner_step(step))
            if outer is not None:
                outer.add_compute_time(time.perf_counter() - t)

            # DiLoCo: every H inner steps, one outer step syncs the node replicas
            at_outer_boundary = step % cfg.diloco.inner_steps == 0 or step == total
            if outer is not None and at_outer_boundary:
                try:
                    with checkpoint_if_coordinator_gone(run, outer, committed):
                        outer.start(step)
                        if not overlapped or step == total:  # the final model: outer weights
                            outer.finish()
                except lost as e:  # evicted (cut link, stall): rejoin the others by itself
                    if not rejoinable or not rejoins_after(e):
                        raise
                    rejoins += 1
                    step = rejoin_running_job(run, outer, e, rejoins)  # type: ignore[arg-type]
                if committed is not None:
                    committed.take(run, step)

            if step % cfg.run.log_every == 0 or step == total:
                meter.report(step)
            # with DiLoCo a stop waits for the next outer step, so checkpoints hold synced weights
            stopping = stop.agreed(run.placement) and (outer is None or at_outer_boundary)
            checkpoint_due = run.ckpt.due(step) and (outer is None or at_outer_boundary)
            if outer is not None and at_outer_boundary and not checkpoint_due:
                # a node waiting to join fetches the state of the round that starts now
                checkpoint_due = bool(getattr(outer, "joiners_waiting", lambda: False)())
            with meter.paused():  # evaluation and checkpoints are not training time
                if (cfg.eval.every and step % cfg.eval.every == 0) or step == total:
                    eval_loss = run.evaluate_and_record(step)
                if stopping or step == total or checkpoint_due:
                    with checkpoint_if_coordinator_gone(run, outer, committed):
                        run.checkpoint(step, outer)
            if stopping:
                log.info(
                    f"{stop.signal} received: stopped after step {step} and checkpointed; "
                    "rerun the same command to resume"
                )
                break
    run.ckpt.wait()
    end = LoopEnd(
        step=step,
        start=start,
        last_loss=meter.last_loss,
        eval_loss=eval_loss,
        stopped_by=stop.signal,
        seconds=time.perf_counter() - meter.t0,
        session_tokens=meter.session_tokens,
    )
    return finish(run, outer, end)
