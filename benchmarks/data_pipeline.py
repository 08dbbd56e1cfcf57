"""The data pipeline: tokenizing a parquet corpus with 1 and with all workers, peak memory,
and the training loop's time waiting for data.

A parquet corpus (rows of text, row groups of 500) is written to a temporary folder, then
tokenized into a fresh token cache by `build_corpus_tokens` in a child process per setting, so
each peak RSS (the builder plus its workers) is measured alone. The figure is tokens/s with
all workers as a ratio of tokens/s with one worker, measured in the same run. Then a short
single-node training run on that corpus times every `next_batch` call of the loader against
the whole step.

    uv run python benchmarks/data_pipeline.py                 # 256 MB of text, BPE tokenizer
    uv run python benchmarks/data_pipeline.py --mb 64 --tokenizer byte
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_corpus(folder: Path, mb: int) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = np.array(
        ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "models"]
        + ["train", "on", "data", "from", "many", "nodes", "across", "slow", "links"]
    )
    texts = [" ".join(words[rng.integers(0, len(words), 300)]) for _ in range(4000)]
    per_file = sum(len(t) for t in texts)
    n = max(2, -(-(mb * 2**20) // per_file))
    table = pa.table({"text": texts})
    for i in range(n):
        pq.write_table(table, folder / f"train-{i:05d}.parquet", row_group_size=500)
    return per_file * n


def train_bpe(corpus: Path, dest: Path) -> str:
    """A Hugging Face BPE tokenizer.json (4096 tokens, end-of-text token) from one shard."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = pq.read_table(next(iter(sorted(corpus.iterdir()))))["text"].to_pylist()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(texts, trainer)
    tok.save(str(dest))
    return str(dest)


def measure(corpus: str, cache: str, workers: int, tokenizer: str) -> None:
    """Child mode: build the token cache once, print tokens, seconds and peak RSS as JSON."""
    import numpy as np

    from prime_train.token_cache import CorpusSpec, build_corpus_tokens

    t = time.perf_counter()
    out = build_corpus_tokens(
        CorpusSpec(corpus, "parquet", tokenizer=tokenizer), Path(cache), workers=workers
    )
    secs = time.perf_counter() - t
    tokens = int(np.load(out.train, mmap_mode="r").size + np.load(out.heldout, mmap_mode="r").size)
    rss = {
        w: resource.getrusage(w).ru_maxrss * 1024
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    }
    print(
        json.dumps(
            {
                "tokens": tokens,
                "seconds": secs,
                "self": rss[resource.RUSAGE_SELF],
                "child": rss[resource.RUSAGE_CHILDREN],
            }
        )
    )


def tokenize_run(corpus: Path, root: Path, workers: int, tokenizer: str) -> dict:
    cache = tempfile.mkdtemp(dir=root, prefix=f"cache-{workers}-")
    r = subprocess.run(
        [sys.executable, __file__, "--measure", str(corpus), cache, str(workers), tokenizer],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if r.returncode != 0:
        sys.exit(f"tokenizing with {workers} worker(s) failed:\n{r.stderr[-3000:]}")
    m = json.loads(r.stdout.strip().splitlines()[-1])
    m["peak"] = m["self"] + workers * m["child"]  # each worker counted at the largest's peak
    return m


def data_wait(corpus: Path, root: Path, steps: int, tokenizer: str) -> tuple[float, float, float]:
    """(seconds in next_batch after the first step, seconds of those steps, first batch s)."""
    from prime_train import slot_loader
    from prime_train.config_load import load_config
    from prime_train.trainer import train

    waits: list[float] = []
    original = slot_loader.SlotLoader.next_batch

    def timed(self):
        t = time.perf_counter()
        try:
            return original(self)
        finally:
            waits.append(time.perf_counter() - t)

    slot_loader.SlotLoader.next_batch = timed
    cfg = load_config(
        None,
        [
            *("--run.runs_dir", str(root / "runs"), "--launch.local_nodes", "1"),
            *(
                "--data.source",
                "parquet",
                "--data.path",
                str(corpus),
                "--data.tokenizer",
                tokenizer,
            ),
            *("--data.seq_len", "256", "--train.batch_size", "8", "--train.threads", "1"),
            *("--train.device", "cpu", "--train.steps", str(steps), "--run.log_every", str(steps)),
            *("--eval.every", "0", "--eval.batches", "1", "--ckpt.every", "0"),
        ],
    )
    summary = train(cfg)
    slot_loader.SlotLoader.next_batch = original
    return sum(waits[1:]), summary.seconds, waits[0]


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        measure(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="megabytes of text in the corpus")
    p.add_argument(
        "--tokenizer",
        default="bpe",
        help="'bpe' (a 4096-token BPE tokenizer.json trained here on the corpus), 'byte', or a path",
    )
    p.add_argument("--steps", type=int, default=60, help="training steps for the data-wait figure")
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="prime-data-bench-") as tmp:
        root = Path(tmp)
        corpus = root / "corpus"
        corpus.mkdir()
        size = write_corpus(corpus, a.mb)
        if a.tokenizer == "bpe":
            a.tokenizer = train_bpe(corpus, root / "tokenizer.json")
        print(
            f"corpus: {size / 2**20:.0f} MB of text in {len(list(corpus.iterdir()))} parquet files; tokenizer {a.tokenizer}"
        )
        results = {}
        for workers in sorted({1, cores}):
            m = tokenize_run(corpus, root, workers, a.tokenizer)
            results[workers] = m
            print(
                f"{workers} worker(s): {m['tokens'] / m['seconds']:,.0f} tokens/s "
                f"({m['tokens']:,} tokens in {m['seconds']:.1f} s) | peak RSS {m['peak'] / 2**20:.0f} MB "
                f"(builder {m['self'] / 2**20:.0f} MB + {workers} x {m['child'] / 2**20:.0f} MB), "
                f"the corpus is {size / m['peak']:.1f}x that"
            )
        one, full = results[1], results[cores]
        ratio = (full["tokens"] / full["seconds"]) / (one["tokens"] / one["seconds"])
        waited, seconds, first = data_wait(corpus, root, a.steps, a.tokenizer)
        print(
            f"\nall {cores} workers vs 1: {ratio:.2f}x tokens/s | training loop waiting for data after "
            f"the first step: {waited * 1e3:.1f} ms of {seconds:.1f} s ({waited / seconds:.2%}); "
            f"first batch {first * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
