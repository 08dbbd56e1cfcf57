"""The training loop of one node: FSDP2 inner steps, evaluation, checkpoints, clean stops.

`train()` is the loop; `Run` holds what it works on (model, optimizer, data, metrics,
checkpoints), built from the config. DiLoCo (part 2) plugs in as one call, `outer.step`,
every `diloco.inner_steps` steps.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prime_train import checkpointing
from prime_train.checkpointing import committed_steps
from prime_train.config import Config
from prime_train.config_load import ConfigError
from prime_train.data import ShardedLoader, SyntheticSequences, TokenSequences, eval_batches
from prime_train.diloco_node import DilocoNode, local_node_index, uses_mesh
from prime_train.metrics import Log, Metrics
from prime_train.model import Transformer, model_args, num_params
from prime_train.optim import lr_at, make_optimizer, set_lr
from prime_train.parallel import Placement, build_model, init_placement, reshard
from prime_train.reporting import attach_reporting
from prime_train.rundir import claim_run_dir
from prime_train.stop import StopSignal
from prime_train.summary import Summary, finish
from prime_train.tokens import DataError, build_token_cache, make_tokenizer

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


class OuterStep(Protocol):
    """The DiLoCo outer step: sync the node replicas after H inner steps (see DilocoNode)."""

    def step(self, step: int) -> None: ...


class Run:
    """The model, optimizer, data, metrics and checkpoints of one node's run."""

    def __init__(self, cfg: Config, placement: Placement, log: Log):
        self.cfg, self.placement, self.log = cfg, placement, log
        self.primary = placement.rank == 0
        self.run_dir = claim_run_dir(cfg, write=self.primary and placement.node == 0)
        self.device = placement.device
        shards = placement.num_nodes * placement.world_size
        shard = placement.node * placement.world_size + placement.rank

        vocab, train_seqs, held_seqs = self._data()
        try:
            args = model_args(
                cfg.model.preset,
                dim=cfg.model.dim,
                n_layers=cfg.model.n_layers,
                n_heads=cfg.model.n_heads,
                n_kv_heads=cfg.model.n_kv_heads,
                vocab_size=vocab,
                max_seq_len=cfg.data.seq_len,
            )
        except ValueError as e:
            raise ConfigError(f"[model] settings give an invalid shape: {e}") from None
        with torch.device("meta"):
            self.model = Transformer(args)
        self.bf16 = build_model(self.model, placement, cfg.train, seed=cfg.run.seed)
        self.opt = make_optimizer(self.model, cfg.optim)
        self.params = list(self.model.parameters())

        B = cfg.train.batch_size
        # synthetic sequences are already random: no permutation of their 2**30 indices
        self.loader = ShardedLoader(
            train_seqs, B, shard, shards, seed=cfg.run.seed, shuffle=cfg.data.source != "synthetic"
        )
        self.eval_set = eval_batches(
            held_seqs, B, cfg.eval.batches, placement.rank, placement.world_size
        )
        self.tokens_per_step = B * cfg.data.seq_len * placement.world_size
        self.progress: dict[str, Any] = {"step": 0, "tokens": 0, "train_seconds": 0.0}

        node_suffix = "" if placement.node == 0 else f"-node{placement.node}"
        self.metrics = Metrics(
            self.run_dir / f"metrics{node_suffix}.jsonl" if self.primary else None
        )
        self.ckpt_dir = checkpointing.checkpoint_dir(cfg, local_node_index())
        group = placement.group if placement.world_size > 1 else None
        self.ckpt: checkpointing.Checkpointer | None = None
        self.diloco: DilocoNode | None = None  # set by train() for a multi-node run
        if checkpointing.available():
            self.ckpt = checkpointing.Checkpointer(
                self.ckpt_dir,
                cfg.ckpt.every,
                cfg.ckpt.keep,
                cfg.ckpt.shm_dir,
                cfg.ckpt.remote,
                group,
            )
        else:
            log.warn("prime_ckpt.CheckpointManager is not installed: no checkpoints, no resume")
        self.log.info(
            f"model {cfg.model.preset}: {num_params(self.model) / 1e6:.2f}M parameters, "
            f"{'bf16' if self.bf16 else 'fp32'} on {self.device}, FSDP2 over "
            f"{placement.world_size} rank(s); {len(train_seqs)} train / {len(held_seqs)} held-out "
            f"sequences of {cfg.data.seq_len} tokens"
        )

    def _data(self):
        cfg, p = self.cfg, self.placement
        if cfg.data.source == "synthetic":
            vocab = cfg.model.vocab_size or (257 if cfg.model.preset == "debug" else None)
            vocab = vocab or model_args(cfg.model.preset).vocab_size
            return (
                vocab,
                SyntheticSequences(vocab, cfg.data.seq_len, cfg.run.seed),
                SyntheticSequences(vocab, cfg.data.seq_len, cfg.run.seed + 10**6),
            )
        tok = make_tokenizer(cfg.data.tokenizer)
        cache = cfg.data.cache_dir or cfg.run.runs_dir / ".token-cache"
        # rank 0 tokenizes, the others then find the cache ready (or meet the same error)
        files, error = None, None
        if self.primary:
            try:
                files = build_token_cache(cfg.data.path, tok, cfg.data.heldout_fraction, cache)
            except DataError as e:
                error = e
        if p.world_size > 1:
            dist.barrier(group=p.group)
        if error is not None:
            raise error
        if files is None:
            files = build_token_cache(cfg.data.path, tok, cfg.data.heldout_fraction, cache)
        preset_vocab = model_args(cfg.model.preset).vocab_size
        vocab = cfg.model.vocab_size or (
            tok.vocab_size if cfg.model.preset == "debug" else preset_vocab
        )
        if tok.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer has {tok.vocab_size} tokens but the model only {vocab}; "
                f"set model.vocab_size >= {tok.vocab_size}"
            )
        seq = cfg.data.seq_len
        return vocab, TokenSequences(files.train, seq), TokenSequences(files.heldout, seq)

    def inner_step(self, step: int) -> torch.Tensor:
        """One optimizer step on the next batch; returns the loss (not synchronised)."""
        inputs, targets = self.loader.next_batch()
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        set_lr(self.opt, lr_at(step, self.cfg.optim, self.cfg.train.steps))
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.progress["tokens"] += self.tokens_per_step
        return loss.detach()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over this node's fixed evaluation batches."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in self.eval_set:
            logits = self.model(inputs.to(self.device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(self.device).flatten())
            total += torch.stack(
                [loss.double(), torch.ones((), dtype=torch.float64, device=self.device)]
            )
        self.all_reduce_sum(total)
        reshard(self.model)
        return float(total[0] / total[1])

    def evaluate_and_record(self, step: int) -> float:
        loss = self.evaluate()
        self.metrics.write({"step": step, "eval_loss": loss})
        self.log.info(f"step {step}/{self.cfg.train.steps} | held-out loss {loss:.4f}")
        return loss

    def checkpoint_due(self, step: int) -> bool:
        return self.ckpt is not None and self.ckpt.due(step)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        if self.placement.world_size > 1:
            dist.all_reduce(t, group=self.placement.group)

    def state(self) -> dict[str, Any]:
        state = checkpointing.train_state(
            self.model, self.opt, self.loader.state_dict(), self.progress
        )
        if self.diloco is not None:
            state["diloco"] = self.diloco.state_dict()
        return state

    def checkpoint(self, step: int) -> None:
        self.progress["step"] = step
        if self.ckpt is not None:
            self.ckpt.save(step, self.state())

    def resume(self) -> int:
        """Load the newest checkpoint in place; returns its step (0 for a fresh run)."""
        if self.ckpt is None:
            return 0
        state = self.state()
        if self.diloco is None:
            step = self.ckpt.load_latest(state)
        else:  # the newest step that every node holds, so all resume from the same weights
            step = self.diloco.agree_resume_step(committed_steps(self.ckpt_dir))
            if step is not None:
                self.ckpt.load(step, state)
                self.diloco.loaded(state["diloco"])
        if step is None:
            return 0
        self.loader.load_state_dict(state["data"])
        self.progress.update(state["progress"])
        checkpointing.restore_rng(state)
        return step

    def close(self) -> None:
        self.metrics.close()
        if self.ckpt is not None:
            self.ckpt.close()


class Meter:
    """Mean loss and tokens/s over the steps since the last progress line."""

    def __init__(self, run: Run, log: Log):
        self.run, self.log = run, log
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
        run.progress["train_seconds"] += secs
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
    set (the local launcher sets it for each node), this node joins the run's mesh and takes
    a DiLoCo outer step every `diloco.inner_steps` steps."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    node: DilocoNode | None = None
    if outer is None and uses_mesh(cfg):
        index = local_node_index()
        node = DilocoNode(cfg, Log(f"[node {index if index is not None else '?'}]", True))
        outer = node
        placement = placement or init_placement(cfg.train, node=node.node, num_nodes=node.num_nodes)
    placement = placement or init_placement(cfg.train)
    log = log or Log(placement.prefix, primary=placement.rank == 0)
    if node is not None:
        node.log = log
    run: Run | None = None
    try:
        run = Run(cfg, placement, log)
        if node is not None:
            node.attach(run.params, run.metrics)
            run.diloco = node
        attach_reporting(cfg, run, node.mesh if node is not None else None)
        return train_loop(cfg, run, placement, outer, log)
    finally:
        if run is not None:
            run.close()
        if node is not None:
            node.close()
        placement.close()


def train_loop(
    cfg: Config, run: Run, placement: Placement, outer: OuterStep | None, log: Log
) -> Summary:
    """The loop: inner steps, the outer-step seam, progress lines, evaluation, checkpoints."""
    total = cfg.train.steps
    start = run.resume()
    if start:
        log.info(f"resumed from the step-{start} checkpoint in {run.ckpt_dir}")
    if start >= total:
        log.info(f"the run is already complete ({start}/{total} steps); nothing to do")
    run.metrics.open(start)
    eval_loss: float | None = None
    if start == 0:
        eval_loss = run.evaluate_and_record(0)

    meter = Meter(run, log)  # loss and tokens/s over the steps since the last progress line
    step = start
    with StopSignal() as stop:
        for step in range(start + 1, total + 1):
            meter.add(run.inner_step(step))

            # DiLoCo: every H inner steps, one outer step syncs the node replicas
            at_outer_boundary = step % cfg.diloco.inner_steps == 0 or step == total
            if outer is not None and at_outer_boundary:
                outer.step(step)

            if step % cfg.run.log_every == 0 or step == total:
                meter.report(step)
            # with DiLoCo a stop waits for the next outer step, so checkpoints hold synced weights
            stopping = stop.agreed(placement) and (outer is None or at_outer_boundary)
            checkpoint_due = run.checkpoint_due(step) and (outer is None or at_outer_boundary)
            with meter.paused():  # evaluation and checkpoints are not training time
                if (cfg.eval.every and step % cfg.eval.every == 0) or step == total:
                    eval_loss = run.evaluate_and_record(step)
                if stopping or step == total or checkpoint_due:
                    run.checkpoint(step)
            if stopping:
                log.info(
                    f"{stop.signal} received: stopped after step {step} and checkpointed; "
                    "rerun the same command to resume"
                )
                break
    if run.ckpt is not None:
        run.ckpt.wait()
    return finish(
        cfg,
        run,
        placement,
        log,
        step,
        start,
        meter.last_loss,
        eval_loss,
        stop.signal,
        time.perf_counter() - meter.t0,
        meter.session_tokens,
    )
