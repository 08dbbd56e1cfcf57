"""prime-train's single-node tokens/s against a bare FSDP2 loop on the same model, same run.

Both sides build the same model, shard it with the same FSDP2 call and take AdamW steps on
batches of the same shape. The bare loop feeds pre-made random batches and does nothing else;
prime-train adds its data loader, schedule, logging, metrics and stop checks. Rounds alternate
which side goes first so machine noise hits both; the figure is the ratio of medians.

    uv run python benchmarks/train_overhead.py            # CPU, about 2 minutes
    uv run python benchmarks/train_overhead.py --device cuda --preset 150M --seq-len 1024
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from prime_train.config_load import load_config
from prime_train.metrics import read_metrics
from prime_train.model import Transformer, model_args
from prime_train.optim import lr_at, make_optimizer, set_lr
from prime_train.parallel import build_model
from prime_train.placement import init_placement
from prime_train.trainer import train


def make_config(a: argparse.Namespace, runs_dir: str, name: str):
    return load_config(
        None,
        [
            "--run.runs_dir",
            runs_dir,
            "--run.name",
            name,
            "--run.log_every",
            str(a.log_every),
            "--model.preset",
            a.preset,
            "--data.source",
            "synthetic",
            "--data.seq_len",
            str(a.seq_len),
            "--train.batch_size",
            str(a.batch_size),
            "--train.steps",
            str(a.warmup + a.steps),
            "--train.device",
            a.device,
            "--train.threads",
            str(a.threads),
            "--eval.every",
            "0",
            "--eval.batches",
            "1",
            "--ckpt.every",
            "0",
            "--optim.warmup_steps",
            "10",
            *(["--model.dim", str(a.dim), "--model.n_layers", str(a.layers)] if a.dim else []),
        ],
        env={},
    )


def bare_loop(cfg, warmup: int, steps: int) -> float:
    """The reference: the same FSDP2 model and AdamW, pre-made batches, nothing else."""
    placement = init_placement(cfg)
    try:
        args = model_args(
            cfg.model.preset,
            dim=cfg.model.dim,
            n_layers=cfg.model.n_layers,
            max_seq_len=cfg.data.seq_len,
        )
        with torch.device("meta"):
            model = Transformer(args)
        build_model(model, placement.device_mesh, placement.device, cfg.train, seed=0)
        opt = make_optimizer(model, cfg.optim)
        params = list(model.parameters())
        g = torch.Generator().manual_seed(0)
        shape = (cfg.train.batch_size, cfg.data.seq_len + 1)
        batches = [
            torch.randint(0, args.vocab_size, shape, generator=g).to(placement.device)
            for _ in range(8)
        ]
        t0 = 0.0
        for step in range(1, warmup + steps + 1):
            if step == warmup + 1:
                if placement.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            seq = batches[step % len(batches)]
            set_lr(opt, lr_at(step, cfg.optim, cfg.train.steps))
            loss = F.cross_entropy(model(seq[:, :-1]).flatten(0, 1).float(), seq[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss.item()
        secs = time.perf_counter() - t0
        return steps * cfg.train.batch_size * cfg.data.seq_len / secs
    finally:
        placement.close()


def prime_loop(cfg, warmup: int) -> float:
    """prime-train's own loop; tokens/s over its progress windows after the warm-up."""
    train(cfg)
    recs = [r for r in read_metrics(cfg.run_dir / "metrics.jsonl") if "loss" in r]
    tokens = secs = 0.0
    prev = 0
    for r in recs:
        steps, prev = r["step"] - prev, r["step"]
        if r["step"] - steps >= warmup:  # windows wholly after the warm-up
            tokens += steps * cfg.train.batch_size * cfg.data.seq_len
            secs += steps * cfg.train.batch_size * cfg.data.seq_len / r["tokens_per_s"]
    return tokens / secs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="debug")
    p.add_argument("--dim", type=int, default=256, help="override width (0: the preset's)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    bare, prime = [], []
    with tempfile.TemporaryDirectory() as runs:
        for i in range(a.rounds):
            cfg = make_config(a, runs, f"round{i}")
            # alternate which side goes first, so a load change hits both alike
            if i % 2:
                prime.append(prime_loop(cfg, a.warmup))
                bare.append(bare_loop(cfg, a.warmup, a.steps))
            else:
                bare.append(bare_loop(cfg, a.warmup, a.steps))
                prime.append(prime_loop(cfg, a.warmup))
            print(
                f"round {i + 1}/{a.rounds}: bare FSDP2 {bare[-1]:,.0f} tok/s | "
                f"prime-train {prime[-1]:,.0f} tok/s | ratio {prime[-1] / bare[-1]:.3f}",
                flush=True,
            )
    b, t = statistics.median(bare), statistics.median(prime)
    paired = statistics.median(x / y for x, y in zip(prime, bare, strict=True))
    print(
        f"\nmedian over {a.rounds} rounds ({a.steps} steps each, {a.device}, "
        f"{a.threads} thread(s)): bare {b:,.0f} tok/s, prime-train {t:,.0f} tok/s; "
        f"ratio of medians {t / b:.3f}, median of per-round ratios {paired:.3f} "
        "(target >= 0.95)"
    )


if __name__ == "__main__":
    main()
