"""The training loop of one node: inner steps, the outer step, evaluation, checkpoints, stops.

Start reading here. `train()` sets up in one direction - config -> placement (device, node
group, mesh membership, the node's identity) -> run (model, data, checkpoints) -> outer step
(DiLoCo, for a multi-node run) - and `train_loop(run, outer)` is the loop. What happens at an
outer boundary (the outer step, a lost membership) is `outer_boundary.OuterBoundary`; how a
node joins a running job is `diloco/join.py`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from prime_train import faults
from prime_train.config import Config
from prime_train.diloco import make_outer_step
from prime_train.diloco.join import join_running_job
from prime_train.diloco.membership import replay_dir
from prime_train.diloco.replay_log import ReplayLog
from prime_train.diloco.resume_agreement import LacksNewestStep, NothingToFormFrom
from prime_train.metrics import Log, LogLines
from prime_train.optim import lr_at
from prime_train.outer_boundary import OuterBoundary
from prime_train.placement import Placement, init_placement
from prime_train.reporting import attach_reporting
from prime_train.run import Run
from prime_train.seam import ElasticOuterStep, OuterStep
from prime_train.slots import too_many_readers
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

    def add(self, loss: torch.Tensor | None) -> None:
        if loss is None:  # no data this step: nothing trained
            return
        self.loss += loss  # no host sync until the next report
        self.steps += 1
        self.session_tokens += self.run.tokens_per_step

    def report(self, step: int) -> None:
        run = self.run
        mean = self.loss.double() / max(self.steps * run.placement.world_size, 1)
        run.all_reduce_sum(mean)
        secs = time.perf_counter() - self.window_t
        tps = self.steps * run.tokens_per_step / secs
        if self.steps:  # (a node without data this window trained nothing: no loss)
            self.last_loss = float(mean)
        lr = lr_at(step, run.cfg.optim, run.cfg.train.steps)
        run.metrics.write(
            {
                "step": step,
                "loss": self.last_loss if self.steps else None,
                "lr": lr,
                "tokens": run.progress["tokens"],
                "tokens_per_s": tps,
                "ckpt_errors": run.ckpt.errors,  # checkpoint saves and uploads failed so far
                # so far: the seconds the loop waited for checkpoints, and how many it saved
                "ckpt_blocked_s": round(run.ckpt.blocked_s, 3),
                "ckpt_saves": run.ckpt.saves,
                # the newest step on this node's disk: the mesh keeps the run's newest, which
                # nodes forming the run anew must hold (`diloco/resume_agreement.py`)
                "ckpt_step": run.ckpt.newest_on_disk(),
            }
        )
        loss = f"{self.last_loss:.4f}" if self.steps else "- (no data slot yet)"
        self.log.info(
            f"step {step}/{run.cfg.train.steps} | loss {loss} | lr {lr:.2e} | {tps:,.0f} tok/s"
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
    another `outer` step is given (it must then implement `prime_train.seam.ElasticOuterStep`),
    takes a DiLoCo outer step every `diloco.inner_steps` steps."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    with StopSignal(at_once=True):  # a stop during start-up: nothing of its own to save yet
        placement = placement or init_placement(cfg)
    log = log or Log(placement.prefix, primary=placement.rank == 0)
    membership = placement.membership
    if membership is not None and outer is not None and not isinstance(outer, ElasticOuterStep):
        raise TypeError(
            f"outer={type(outer).__name__} in a multi-node run must implement "
            "prime_train.seam.ElasticOuterStep (see its docstring)"
        )
    if membership is not None and membership.joining:
        log.info(
            f"registered with the running job as {membership.mesh.node_id} "
            f"({membership.members_seen} member(s)): waiting, fetching their state"
        )
    elif membership is not None:
        mesh = membership.mesh
        log.info(
            f"joined the mesh as {mesh.node_id}: epoch {mesh.epoch}, "
            f"rank {mesh.global_rank} of {mesh.global_world_size} nodes"
        )
    run: Run | None = None
    lines = LogLines.attach(log)  # a checkpoint that failed in the background: one line
    try:
        with StopSignal(at_once=True):
            run = Run(cfg, placement, log)
        if outer is None and membership is not None:
            outer = make_outer_step(
                cfg.diloco,
                membership.mesh,
                run.params,
                metrics=run.metrics,
                log=log,
                node_group=placement.group,
                data=run.loader,
                names=[name for name, _ in run.model.named_parameters()],
                replay_log=replay_log(run),
            )
        attach_reporting(cfg, run)
        return train_loop(run, outer)
    finally:
        try:
            if outer is not None:  # an overlapped outer step may still have a round in flight
                outer.close()
            if run is not None:
                run.close()  # waits for the last upload
        finally:
            lines.detach()
        placement.close()


def replay_log(run: Run) -> ReplayLog | None:
    """This node's update log (`diloco/replay_log.py`; None with `diloco.replay_rounds` 0),
    whose entries a joiner holds through the checkpoint server of whichever registration is
    live."""
    keep = run.cfg.diloco.replay_rounds
    if keep <= 0:
        return None
    placement = run.placement

    def held_from() -> str | None:
        m = placement.membership
        return m.server.held_from() if m is not None and m.server is not None else None

    return ReplayLog(replay_dir(run.ckpt_dir), placement.rank, keep, run.log_key,
                     held_from if run.primary else None)  # fmt: skip


def begin(run: Run, outer: OuterStep | None) -> tuple[int, float | None]:
    """Where the loop starts: the newest checkpoint any founding node holds (`Run.resume`), or,
    for a node joining a running job (or a founder that lacks that step), the members' state
    and its first round with them (see `diloco/join.py`). Returns the inner step the loop
    continues from, and the held-out loss of a fresh run's step 0."""
    cfg = run.cfg
    membership = run.placement.membership
    if membership is not None and membership.joining and isinstance(outer, ElasticOuterStep):
        if membership.members_seen + 1 > cfg.data.slots:  # no data slot would be left for it
            raise too_many_readers(membership.members_seen + 1, cfg.data.slots)
        start = _join(run, outer)
    else:
        try:
            start = run.resume(outer)
        except (LacksNewestStep, NothingToFormFrom) as e:  # join the holders, or wait for them
            assert isinstance(outer, ElasticOuterStep)  # (only a mesh node's step raises them)
            run.log.info(f"{e}; leaving the founders to join" if isinstance(e, LacksNewestStep)
                         else f"{e}; leaving the founders to wait")  # fmt: skip
            start = _join(run, outer, lost=e)
    eval_loss = None
    if start == 0:
        eval_loss = run.evaluate_and_record(0)
        if cfg.model.init_from is not None:  # the starting weights, exportable as step 0
            run.checkpoint(0, outer)
    return start, eval_loss


def _join(run: Run, outer: ElasticOuterStep, lost: BaseException | None = None) -> int:
    """Join the running job (`diloco/join.py`); `lost`: why this node left the founders."""
    # (a joiner keeps every row of an earlier life: all precede where the members are)
    run.metrics.open(run.cfg.train.steps)
    return join_running_job(run, outer, lost=lost)


def reached(every: int, inner: int, step: int) -> bool:
    """Whether a multiple of `every` (0: never) lies in [inner, step]: the inner step just run,
    up to where the loop continues (a time-budgeted round that ended early jumps to its
    nominal end; the multiples it skipped come due there)."""
    return every > 0 and step // every > (inner - 1) // every


def train_loop(run: Run, outer: OuterStep | None) -> Summary:
    """The loop: inner steps, the outer step at every outer boundary, progress lines,
    evaluation, checkpoints, and a clean stop on SIGINT/SIGTERM."""
    cfg, log, total = run.cfg, run.log, run.cfg.train.steps
    with StopSignal(at_once=True):  # (a joiner's wait and listening: nothing of its own yet)
        start, eval_loss = begin(run, outer)
    step = start
    meter = Meter(run)  # loss and tokens/s over the steps since the last progress line
    with StopSignal() as stop:
        boundary = OuterBoundary(run, outer, start, stop) if outer is not None else None
        while step < total:
            step += 1
            faults.stall_training(step, log)  # a test's stuck node (off unless set)
            t = time.perf_counter()
            meter.add(run.inner_step(step))
            faults.slow_inner_step(time.perf_counter() - t)  # a test's slow node (off unless set)
            inner = step  # (a time-budgeted round's end moves `step` to its nominal end)
            # with an outer step, checkpoints and stops wait for a boundary (synced weights)
            if boundary is not None:  # (a checkpoint's copy the step waited for: not compute)
                boundary.add_compute_time(time.perf_counter() - t - run.take_staging_wait())
            at_boundary = boundary is None or boundary.due(step)
            if boundary is not None and at_boundary:
                step = boundary.sync(step)
                if not boundary.timed:  # (a rejoin's jump: the step it lands on counts)
                    inner = step
            if reached(cfg.run.log_every, inner, step) or step == total:
                meter.report(step)
            stop_asked = stop.agreed(run.placement)
            if stop_asked and boundary and not at_boundary and boundary.should_leave_now(step):
                step = boundary.leave_now()  # mid-round, the round's end too far away
                log.info(f"{stop.signal} received: left the mesh and checkpointed step {step} "
                         "(the last outer step); rerun the same command to rejoin")  # fmt: skip
                break
            stopping = stop_asked and at_boundary
            checkpoint_due = at_boundary and (
                run.ckpt.due(step) or (boundary is not None and boundary.joiners_waiting())
            )  # a node waiting to join fetches the state of the round that starts now
            with meter.paused():  # evaluation and checkpoints are not training time
                if reached(cfg.eval.every, inner, step) or step == total:
                    eval_loss = run.evaluate_and_record(step)
                if stopping or step == total or checkpoint_due:
                    if boundary is not None:  # (a rejoin instead moves the step on)
                        step = boundary.checkpoint(step)
                    else:
                        run.checkpoint(step, None)
            if stopping:
                log.info(
                    f"{stop.signal} received: stopped after step {step} and checkpointed; "
                    "rerun the same command to resume"
                )
                break
    run.ckpt.wait()
    if stop.received_at is not None:  # the way out keeps to train.stop_within_s + 10 s
        run.ckpt.leave_by(stop.received_at + cfg.train.stop_within_s + 10.0)
    if step >= total and run.placement.membership is not None:
        run.placement.membership.completed = True  # said when it leaves: later nodes are told
    run.ckpt.close()  # the final upload (bounded) before the summary, which counts its failure
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
