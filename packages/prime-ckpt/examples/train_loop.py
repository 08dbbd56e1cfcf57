"""A plain PyTorch training loop with prime-ckpt added (the lines marked `# ckpt`).

    python train_loop.py --ckpt-dir /tmp/run --steps 100 --every 10

Kill it at any moment and start it again: it resumes from the newest good checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

from prime_ckpt import CheckpointManager  # ckpt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 20, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(steps: int, ckpt_dir: str | None, every: int = 5, kill_at: int = -1) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    progress = {"step": 0}
    loss = None

    ckpt = CheckpointManager(ckpt_dir) if ckpt_dir else None  # ckpt
    if ckpt:
        # AdamW creates its state at the first step: create it now so a load has tensors to fill
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "progress": progress}
        if (step := ckpt.load_latest(state)) is not None:  # ckpt
            opt.load_state_dict(state["optim"])  # ckpt: restores lr and other hyperparameters
            print(f"resumed from step {step}")

    while progress["step"] < steps:
        x, y = batch(progress["step"])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        progress["step"] += 1
        if ckpt and progress["step"] % every == 0:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "progress": progress}
            ckpt.save(progress["step"], state)  # ckpt: returns once staged in RAM
        if progress["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, for the test
    if ckpt:
        ckpt.close()  # ckpt: waits until the last checkpoint is durable
    print(f"step {progress['step']}" + (f" loss {loss.item():.6f}" if loss is not None else ""))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL this process after that step")
    a = p.parse_args()
    model = train(a.steps, a.ckpt_dir, a.every, a.kill_at)
    digest = sum(float(t.double().sum()) for t in model.state_dict().values())
    print(f"weights digest {digest:.10f}")


if __name__ == "__main__":
    main()
