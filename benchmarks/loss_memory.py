"""Peak memory of one training step with the full logits against the chunked loss.

The 150M preset (configs/150M.toml's model) with Llama 3's 128,256-token vocabulary, one
sequence of 2,048 tokens, float32 on CPU, AdamW (state made up front, as prime-train does).
Each variant runs in a fresh subprocess: it builds the model, the optimizer and the batch,
resets the kernel's peak-RSS mark (/proc/self/clear_refs), takes one step (forward, loss,
backward, clip, AdamW) and reads the peak back (VmHWM in /proc/self/status). The figure is that
peak minus the resident memory just before the step: what the step itself needed.

    "full"    logits = model(x); F.cross_entropy(logits.float(), y)  (prime-train before)
    "chunked" model(x, y): output projection and cross-entropy in chunks (prime_train.loss)

    uv run python benchmarks/loss_memory.py                 # about 3-5 minutes on 2 cores
    uv run python benchmarks/loss_memory.py --vocab 32000   # the 150M preset's own vocabulary
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def one_step(variant: str, vocab: int, seq_len: int, batch: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from prime_train.config import OptimConfig
    from prime_train.loss import chunk_tokens
    from prime_train.model import Transformer, model_args, num_params
    from prime_train.optim import make_optimizer

    torch.set_num_threads(threads)
    args = model_args("150M", vocab_size=vocab, max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights(seed=0)
    opt = make_optimizer(model, OptimConfig())
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    before = status_kib("VmRSS")
    reset_peak()
    t = time.perf_counter()
    if variant == "full":
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    else:
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    secs = time.perf_counter() - t
    peak = status_kib("VmHWM")
    return {
        "variant": variant,
        "params": num_params(model),
        "loss": float(loss),
        "rss_before_mib": before / 1024,
        "peak_mib": peak / 1024,
        "step_mib": (peak - before) / 1024,
        "seconds": secs,
        "chunk_tokens": chunk_tokens(vocab),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_step(a.child, a.vocab, a.seq_len, a.batch_size, a.threads)))
        return
    rows = {}
    for variant in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--child", variant, "--vocab", str(a.vocab),
               "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
               "--threads", str(a.threads)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = rows[variant] = json.loads(out.strip().splitlines()[-1])
        print(
            f"{variant:8s} peak RSS {r['peak_mib']:,.0f} MiB, of which the step {r['step_mib']:,.0f}"
            f" MiB (before it {r['rss_before_mib']:,.0f} MiB: weights, AdamW state, batch) | "
            f"loss {r['loss']:.4f} | {r['seconds']:.1f} s",
            flush=True,
        )
    full, chunked = rows["full"], rows["chunked"]
    logits_mib = a.batch_size * a.seq_len * a.vocab * 4 / 2**20
    print(
        f"\n150M preset, {full['params'] / 1e6:.0f}M parameters, vocabulary {a.vocab:,}, "
        f"{a.batch_size} x {a.seq_len} tokens, float32 on CPU (one batch's logits: "
        f"{logits_mib:,.0f} MiB; chunks of {chunked['chunk_tokens']} tokens)\n"
        f"step memory chunked / full: {chunked['step_mib'] / full['step_mib']:.3f} "
        f"({full['step_mib'] - chunked['step_mib']:,.0f} MiB less); peak RSS chunked / full: "
        f"{chunked['peak_mib'] / full['peak_mib']:.3f}; "
        f"loss difference {abs(full['loss'] - chunked['loss']):.2e}"
    )


if __name__ == "__main__":
    main()
