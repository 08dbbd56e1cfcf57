"""prime-train's single-rank tokens/s against a plain PyTorch loop and a bare FSDP2 loop.

All three train the same model with the same AdamW on batches of the same shape:
- plain: the model as a plain module (no FSDP2), `F.cross_entropy` over its full logits,
  pre-made random batches, nothing else: what one would write by hand. The target is
  prime-train >= 0.95x this.
- bare FSDP2: the same loop with the model wrapped by prime-train's FSDP2 call (what a node
  of one rank ran before it kept the model whole; FSDP2 still wraps nodes of several ranks).
- prime-train: its own loop (`train()`): data loader, schedule, chunked loss, logging,
  metrics and stop checks.
Each round runs the three in a rotated order so machine noise hits all alike; the figures are
the medians over rounds and the median of per-round ratios.

    uv run python benchmarks/train_overhead.py            # CPU, about 3 minutes
    uv run python benchmarks/train_overhead.py --vocab 128256 --batch-size 4   # loss in 2 chunks
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
from prime_train.parallel import shard_model, use_bf16
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
            *(["--model.vocab_size", str(a.vocab)] if a.vocab else []),
        ],
        env={},
    )


def bare_loop(cfg, warmup: int, steps: int, fsdp: bool) -> float:
    """A reference: the same model (FSDP2-wrapped, or a plain module) and AdamW, pre-made
    batches, the full logits' cross-entropy, nothing else."""
    placement = init_placement(cfg)
    try:
        args = model_args(
            cfg.model.preset,
            dim=cfg.model.dim,
            n_layers=cfg.model.n_layers,
            vocab_size=cfg.model.vocab_size,
            max_seq_len=cfg.data.seq_len,
        )
        if fsdp:
            with torch.device("meta"):
                model = Transformer(args)
            bf16 = use_bf16(cfg.train, placement.device)
            shard_model(model, placement.device_mesh, cfg.train, bf16)
            model.to_empty(device=placement.device)
            with torch.no_grad():
                model.init_weights(seed=0)
        else:  # plain PyTorch: the module on the device, bf16 by autocast on CUDA
            model = Transformer(args).to(placement.device)
            model.init_weights(seed=0)
            if use_bf16(cfg.train, placement.device):
                model.autocast_dtype = torch.bfloat16
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
    p.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="override the vocabulary (0: the preset's); from "
        "2**24 / (batch x seq) tokens up, prime-train's loss runs in chunks",
    )
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
    runs_of: dict[str, list[float]] = {"plain": [], "fsdp2": [], "prime": []}
    with tempfile.TemporaryDirectory() as runs:
        for i in range(a.rounds):
            cfg = make_config(a, runs, f"round{i}")
            loops = {
                "plain": lambda cfg=cfg: bare_loop(cfg, a.warmup, a.steps, fsdp=False),
                "fsdp2": lambda cfg=cfg: bare_loop(cfg, a.warmup, a.steps, fsdp=True),
                "prime": lambda cfg=cfg: prime_loop(cfg, a.warmup),
            }
            order = list(loops)[i % 3 :] + list(loops)[: i % 3]  # rotate who goes first
            for name in order:
                runs_of[name].append(loops[name]())
            plain, fsdp2, prime = (runs_of[k][-1] for k in ("plain", "fsdp2", "prime"))
            print(
                f"round {i + 1}/{a.rounds}: plain {plain:,.0f} tok/s | bare FSDP2 {fsdp2:,.0f} "
                f"tok/s | prime-train {prime:,.0f} tok/s | prime/plain {prime / plain:.3f}, "
                f"prime/FSDP2 {prime / fsdp2:.3f}",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in runs_of.items()}

    def paired(k: str) -> float:
        return statistics.median(x / y for x, y in zip(runs_of["prime"], runs_of[k], strict=True))

    print(
        f"\nmedian over {a.rounds} rounds ({a.steps} steps each, {a.device}, "
        f"{a.threads} thread(s)): plain {med['plain']:,.0f} tok/s, bare FSDP2 "
        f"{med['fsdp2']:,.0f} tok/s, prime-train {med['prime']:,.0f} tok/s\n"
        f"prime-train / plain PyTorch: ratio of medians {med['prime'] / med['plain']:.3f}, "
        f"median of per-round ratios {paired('plain'):.3f} (target >= 0.95)\n"
        f"prime-train / bare FSDP2: ratio of medians {med['prime'] / med['fsdp2']:.3f}, "
        f"median of per-round ratios {paired('fsdp2'):.3f}"
    )


if __name__ == "__main__":
    main()
