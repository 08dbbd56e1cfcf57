"""What one node's run works on: model, optimizer, data, metrics and checkpoints.

`Run` is built from the config and the placement; the loop (`trainer.train_loop`) drives it.
The outer step, when there is one, is handed to `checkpoint` and `resume` so that its state
is saved beside the model's and it decides where the nodes resume.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from prime_train import checkpointing
from prime_train.config import Config
from prime_train.data import eval_batches
from prime_train.datasets import open_datasets
from prime_train.diloco.replay_log import entry_key
from prime_train.hf_import import load_hf_weights, run_model_args
from prime_train.metrics import Log, Metrics
from prime_train.model import Transformer, num_params
from prime_train.optim import lr_at, make_optimizer, set_lr
from prime_train.parallel import build_model, reshard, uses_fsdp
from prime_train.placement import Placement
from prime_train.rundir import claim_run_dir
from prime_train.seam import OuterStep
from prime_train.slot_loader import SlotLoader
from prime_train.spill import TensorSpill
from prime_train.tokens import make_tokenizer

warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


class Run:
    """The model, optimizer, data, metrics and checkpoints of one node's run."""

    def __init__(self, cfg: Config, placement: Placement, log: Log):
        self.cfg, self.placement, self.log = cfg, placement, log
        node = placement.node
        self.primary = placement.rank == 0
        # every node records the config in its run folder (its own machine's, or the folder
        # simulated nodes share: written aside and renamed, so identical writes are harmless)
        self.run_dir = claim_run_dir(cfg, write=self.primary)
        self.device = placement.device

        tokenizer = None if cfg.data.source == "synthetic" else make_tokenizer(cfg.data.tokenizer)
        args = run_model_args(cfg, tokenizer.vocab_size if tokenizer else None)
        group = placement.group if placement.world_size > 1 else None
        data = open_datasets(cfg, args.vocab_size, group)
        train_seqs, held_seqs = data.train, data.heldout
        with torch.device("meta"):
            self.model = Transformer(args)
        self.bf16 = build_model(
            self.model, placement.device_mesh, placement.device, cfg.train, seed=cfg.run.seed
        )
        if cfg.model.init_from is not None:  # a run's own checkpoint, if any, is loaded later
            load_hf_weights(self.model, args, cfg.model.init_from)
        self.opt = make_optimizer(self.model, cfg.optim)
        self.params = list(self.model.parameters())

        B = cfg.train.batch_size
        # synthetic sequences are already random: no permutation of their 2**30 indices
        self.loader = SlotLoader(
            train_seqs,
            B,
            cfg.data.slots,
            node.name,
            placement.rank,
            placement.world_size,
            seed=cfg.run.seed,
            shuffle=cfg.data.source != "synthetic",
            lag=1 if cfg.diloco.overlap == "delayed" and placement.membership else 0,
        )
        if placement.membership is None:  # a node alone reads every slot
            self.loader.reassign([node.name])
        self.eval_set = eval_batches(
            held_seqs, B, cfg.eval.batches, placement.rank, placement.world_size
        )
        self.tokens_per_step = B * cfg.data.seq_len * placement.world_size
        self.progress: dict[str, Any] = {"step": 0, "tokens": 0}

        self.metrics = Metrics(
            self.run_dir / f"metrics{node.suffix}.jsonl" if self.primary else None
        )
        self.ckpt_dir = placement.ckpt_dir
        self.ckpt = self._open_checkpoints()
        # the committed record's tensors (`diloco/committed.py`), in a scratch file: written
        # while the next inner step computes; the optimizer's step waits for the write
        self.spill = TensorSpill(self.ckpt_dir / f".committed-r{placement.rank}")
        self._staging_wait_s = 0.0
        self.opt.register_step_pre_hook(self._before_optimizer_step)
        self.log.info(
            f"model {cfg.model.preset}: {num_params(self.model) / 1e6:.2f}M parameters, "
            f"{'bf16' if self.bf16 else 'fp32'} on {self.device}, "
            + (
                f"FSDP2 over {placement.world_size} rank(s)"
                if uses_fsdp(placement.device_mesh, cfg.train)
                else "one rank, unsharded"
            )
            + f"; {len(train_seqs)} train / {len(held_seqs)} held-out "
            f"sequences of {cfg.data.seq_len} tokens"
        )

    @functools.cached_property
    def log_key(self) -> bytes:
        """The key of this run's update-log entries (`replay_log.entry_key` of its token)."""
        token = self.cfg.mesh.token
        return entry_key(token.get_secret_value() if token else None)

    def _open_checkpoints(self) -> checkpointing.Checkpointer:
        """This node's checkpoint tiers (its folder, RAM staging, the remote); warns when the
        remote holds only other nodes' checkpoints."""
        cfg, placement, node = self.cfg, self.placement, self.placement.node
        ckpt = checkpointing.Checkpointer(
            self.ckpt_dir,
            cfg.ckpt.every,
            cfg.ckpt.keep,
            cfg.ckpt.shm_dir,
            checkpointing.remote_prefix(cfg, node.name),
            placement.group if placement.world_size > 1 else None,
            remote_options=cfg.ckpt.remote_options,
            identity={"run": cfg.run.name, "config_hash": cfg.fingerprint_hash()},
            upload_timeout_s=cfg.ckpt.upload_timeout_s,
            ram=cfg.ckpt.ram,
            disk_timeout_s=cfg.ckpt.disk_timeout_s,
        )
        try:
            ckpt.check_owner()
        except BaseException:
            ckpt.close()
            raise
        if self.primary and (hint := checkpointing.remote_hint(cfg, node.name, ckpt)):
            self.log.warn(hint)
        return ckpt

    def inner_step(self, step: int) -> torch.Tensor | None:
        """One optimizer step on the next batch; returns the loss (not synchronised). None:
        the node holds no readable data slot this round (a joiner of a delayed run waiting
        for its slots), so it does not train."""
        batch = self.loader.next_batch()
        if batch is None:
            return None
        inputs, targets = batch
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        set_lr(self.opt, lr_at(step, self.cfg.optim, self.cfg.train.steps))
        micro = self.cfg.train.micro_batch_size or inputs.shape[0]
        if micro >= inputs.shape[0]:
            loss = self.model(inputs, targets)
            loss.backward()
        else:  # micro-batches: each one's mean loss weighted by its share, gradients summed
            share = micro / inputs.shape[0]
            loss = torch.zeros((), device=self.device)
            for x, y in zip(inputs.split(micro), targets.split(micro), strict=True):
                part = self.model(x, y) * share
                part.backward()
                loss += part.detach()
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
            loss = self.model(inputs.to(self.device), targets.to(self.device))
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

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """Sum over the node's ranks (a no-op for a node of one rank)."""
        if self.placement.world_size > 1:
            dist.all_reduce(t, group=self.placement.group)

    def state(self, outer: OuterStep | None) -> dict[str, Any]:
        """Everything a checkpoint holds, as live tensors to fill in place and plain values."""
        state = checkpointing.train_state(
            self.model, self.opt, self.loader.state_dict(), self.progress
        )
        if outer is not None:
            state["diloco"] = outer.state_dict()
        return state

    def checkpoint(self, step: int, outer: OuterStep | None) -> None:
        self.progress["step"] = step
        self.ckpt.save(step, self.state(outer))

    def resume(self, outer: OuterStep | None) -> int:
        """Load the newest checkpoint in place, share out the data slots among the members
        and open the metrics from there; returns its step (0 for a fresh run). With an outer
        step, the step is the one the founders agree on (the newest any node holds); a node
        that lacks it gets LacksNewestStep and, like a node joining a running job, loads the
        members' state instead (`diloco/join.py`)."""
        state = self.state(outer)
        if outer is None:
            step = self.ckpt.load_latest(state)
        else:
            step = outer.agree_resume_step(self.ckpt.committed_steps())
            if step is not None:
                self.ckpt.load(step, state)
                outer.load_state_dict(state["diloco"])
        self._restore(step, state)
        start = step or 0
        membership = self.placement.membership  # (a node alone reads every slot)
        self.loader.reassign(
            membership.mesh.global_members if membership else [self.placement.node.name]
        )
        if start:
            self.log.info(f"resumed from the step-{start} checkpoint in {self.ckpt_dir}")
        if start >= self.cfg.train.steps:
            self.log.info(f"the run is already complete ({start}/{self.cfg.train.steps} "
                          "steps); nothing to do")  # fmt: skip
        self.metrics.open(start)
        return start

    def load(self, step: int, outer: OuterStep) -> None:
        """Load this node's checkpoint of `step` in place (a joiner's, fetched from a member)
        and continue from there."""
        state = self.state(outer)
        self.ckpt.load(step, state)
        outer.load_state_dict(state["diloco"])
        self._restore(step, state)

    def _restore(self, step: int | None, state: dict[str, Any]) -> None:
        """Take the loop's position from a loaded `state` (None: a fresh start), dropping any
        newer checkpoints of this node."""
        stale = self.ckpt.discard_after(step or 0)
        if stale:
            self.log.info(
                f"removed this node's checkpoints of steps {stale}, newer than the step the "
                f"run resumes from ({step or 0}): it makes them again"
            )
        if step is None:
            return
        self.loader.load_state_dict(state["data"])
        self.progress.update(state["progress"])
        checkpointing.restore_rng(state)

    def _before_optimizer_step(self, *_: Any) -> None:
        self.spill.wait()
        # the step changes the model and its own state; the outer state a checkpoint copies
        # after them changes only at the next outer step, which waits for the whole copy
        self._staging_wait_s += self.ckpt.wait_staged(checkpointing.STEPPED)

    def take_staging_wait(self) -> float:
        """Seconds the optimizer steps since the last call waited for a checkpoint's copy into
        RAM (not compute: the loop counts them as the checkpoint's)."""
        waited, self._staging_wait_s = self._staging_wait_s, 0.0
        return waited

    def close(self) -> None:
        try:
            self.spill.close()
        finally:
            self.metrics.close()
            self.ckpt.close()
