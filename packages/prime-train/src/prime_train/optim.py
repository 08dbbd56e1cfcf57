"""AdamW and the learning-rate schedules (warmup + cosine, warmup-stable-decay, constant).

The learning rate is a pure function of the step, so resuming needs only the step number.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_train.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for the update that produces `step` (1-based)."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay = max(1, int(round(cfg.decay_fraction * total_steps)))
    start = total_steps - decay
    if step <= start:
        return cfg.lr
    return cfg.lr - (cfg.lr - floor) * min(1.0, (step - start) / decay)


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW without weight decay on norms (1-D weights), with its state created up front.

    Creating the state now (zeros, step 0 - what AdamW's first step would create) lets a
    checkpoint be loaded in place into it before any training step.
    """
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        # one kernel per parameter, no temporaries: on CPU the default (one tensor at a time)
        # took 8x as long (0.10 s against 0.0125 s a step for 16M parameters) and allocated
        # two copies of the largest parameter in each step
        fused=True,
    )
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return opt


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
