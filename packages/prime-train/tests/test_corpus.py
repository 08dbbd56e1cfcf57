"""Data in: parquet and JSON-lines corpora made here, tokenized by worker processes into the
whole-corpus token cache; bad input is one clear line; memory stays bounded by a few parts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prime_train.corpus import list_parts, resolve_files, split_heldout
from prime_train.token_cache import CorpusSpec, build_corpus_tokens
from prime_train.tokens import ByteTokenizer, DataError

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"


def docs_for(i: int, n: int) -> list[str]:
    return [f"doc {i}-{j}: " + "lorem ipsum dolor sit amet " * (3 + (j % 7)) for j in range(n)]


@pytest.fixture
def parquet_corpus(tmp_path):
    """3 files of 60 rows in row groups of 20 (9 parts), with an extra non-text column."""
    d = tmp_path / "pq"
    d.mkdir()
    for i in range(3):
        texts = docs_for(i, 60)
        table = pa.table({"id": list(range(60)), "text": texts})
        pq.write_table(table, d / f"train-{i:05d}.parquet", row_group_size=20)
    return d


def byte_tokens(texts: list[str]) -> np.ndarray:
    tok = ByteTokenizer()
    return np.concatenate([np.append(tok.encode_text(t), tok.eos_id) for t in texts])


def test_parquet_corpus_tokenized_whole_once_with_workers(parquet_corpus, tmp_path):
    spec = CorpusSpec(str(parquet_corpus), "parquet", heldout_fraction=0.1)
    files = resolve_files(spec.path, "parquet")
    parts = list_parts(files, "parquet", "text")
    assert len(parts) == 9 and all(p.rows == 20 for p in parts)
    train, held = split_heldout(parts, 0.1)
    tokens = build_corpus_tokens(spec, tmp_path / "cache", workers=2)
    assert tokens.parts == len(train)

    def expected(part_list):
        out = []
        for p in part_list:
            texts = pq.ParquetFile(p.file).read_row_group(p.index)["text"].to_pylist()
            out.append(byte_tokens(texts))
        return np.concatenate(out)

    got = np.load(tokens.train, mmap_mode="r")
    assert got.dtype == np.uint16 and np.array_equal(got, expected(train))
    assert np.array_equal(np.load(tokens.heldout), expected(held))
    # a re-run reuses the cache (nothing rewritten); a changed file makes a new one
    mtime = tokens.train.stat().st_mtime_ns
    again = build_corpus_tokens(spec, tmp_path / "cache", workers=2)
    assert again == tokens and again.train.stat().st_mtime_ns == mtime
    # keyed by content: the corpus copied to another folder (another machine's path), or a
    # file rewritten with the same bytes, finds the same cache
    copy = tmp_path / "copy"
    shutil.copytree(files[0].parent, copy)
    moved = CorpusSpec(str(copy), "parquet", "text", "byte", 0.1)
    assert build_corpus_tokens(moved, tmp_path / "cache", workers=0) == tokens
    os.utime(files[0], ns=(1, 1))
    assert build_corpus_tokens(spec, tmp_path / "cache", workers=0) == tokens
    pq.write_table(pa.table({"text": docs_for(9, 40)}), files[0], row_group_size=20)
    assert build_corpus_tokens(spec, tmp_path / "cache").train != tokens.train
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_jsonl_with_a_hugging_face_tokenizer_puts_end_of_text_between_documents(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    d = tmp_path / "jl"
    d.mkdir()
    all_docs = []
    for i in range(4):
        texts = docs_for(i, 10)
        all_docs += texts
        (d / f"{i}.jsonl").write_text(
            "".join(json.dumps({"text": t, "n": 1}) + "\n" for t in texts)
        )
    tk = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(
        all_docs, trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]", "</s>"])
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    spec = CorpusSpec(str(d), "jsonl", "text", str(tmp_path / "tokenizer.json"), 0.3)
    out = build_corpus_tokens(spec, tmp_path / "cache", workers=1)
    train, held = np.load(out.train), np.load(out.heldout)
    eos = tk.token_to_id("</s>")
    assert (train == eos).sum() + (held == eos).sum() == 40  # one after each document
    first = tk.decode(train[: int(np.argmax(train == eos))].tolist())
    assert first.startswith("doc ") and "lorem ipsum" in first


def test_bad_input_names_the_file(parquet_corpus, tmp_path):
    spec = CorpusSpec(str(parquet_corpus), "parquet")
    bad = parquet_corpus / "train-00009.parquet"
    bad.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"cannot read .*train-00009\.parquet"):
        build_corpus_tokens(spec, tmp_path / "cache")
    bad.unlink()
    with pytest.raises(DataError, match=r"train-00000\.parquet has no column 'body'"):
        build_corpus_tokens(CorpusSpec(str(parquet_corpus), "parquet", "body"), tmp_path / "cache")
    empty = tmp_path / "empty"
    empty.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / f"{i}.parquet")
    with pytest.raises(DataError, match=r"0\.parquet, \.\.\.\) hold no rows: the corpus is empty"):
        build_corpus_tokens(CorpusSpec(str(empty), "parquet"), tmp_path / "cache")
    jl = tmp_path / "jl"
    jl.mkdir()
    for i in range(2):
        (jl / f"{i}.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"[01]\.jsonl has no field 'text'"):
        build_corpus_tokens(CorpusSpec(str(jl), "jsonl"), tmp_path / "cache", workers=1)
    for i in range(2):
        (jl / f"{i}.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match=r"the corpus is empty"):
        build_corpus_tokens(CorpusSpec(str(jl), "jsonl"), tmp_path / "cache")


def test_cli_trains_on_parquet_and_reports_a_bad_shard_in_one_line(parquet_corpus, tmp_path):
    base = [
        "--config",
        str(DEBUG),
        "--run.runs_dir",
        str(tmp_path / "runs"),
        "--launch.local_nodes",
        "1",
    ]
    base += ["--data.source", "parquet", "--data.path", str(parquet_corpus), "--data.seq_len", "32"]
    base += ["--train.batch_size", "2", "--train.steps", "4", "--eval.batches", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *base, "--data.workers", "2"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "done: 4/4 steps" in r.stdout
    (parquet_corpus / "train-00001.parquet").write_bytes(b"PAR1 torn")
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *base, "--run.name", "other"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("prime-train: cannot read ") and "train-00001.parquet" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


MEASURE = """
import json, resource, sys
from pathlib import Path
from prime_train.token_cache import CorpusSpec, build_corpus_tokens
if __name__ == "__main__":
    out = build_corpus_tokens(CorpusSpec(sys.argv[1], "parquet"), Path(sys.argv[2]), workers=2)
    # this process's own high-water mark: ru_maxrss of RUSAGE_SELF would also count the pytest
    # process this one was forked from (Linux keeps the pre-exec mm's peak)
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"self": hwm, "child": child,
                      "tokens": int(__import__("numpy").load(out.train, mmap_mode="r").size)}))
"""


@pytest.mark.slow
def test_tokenizes_a_corpus_several_times_larger_than_its_peak_memory(tmp_path):
    """Peak RSS of the builder plus its 2 workers (each counted at the largest worker's peak)
    stays a fraction of the corpus: tokens stream through part files to disk."""
    rng = np.random.default_rng(0)
    words = np.array(
        [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "models",
            "train",
        ]
    )
    texts = [" ".join(words[rng.integers(0, len(words), 500)]) for _ in range(2000)]
    d = tmp_path / "big"
    d.mkdir()
    table = pa.table({"text": texts})
    per_file = sum(len(t) for t in texts)
    n_files = -(-(2000 * 2**20) // per_file)  # 2 GB of text
    for i in range(n_files):
        pq.write_table(table, d / f"{i:04d}.parquet", row_group_size=500, compression="none")
    corpus_bytes = per_file * n_files
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    r = subprocess.run(
        [sys.executable, str(script), str(d), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    peak = m["self"] + 2 * m["child"]
    assert m["tokens"] > 0.9 * corpus_bytes  # byte tokens: (nearly) all of it, minus held-out
    print(f"corpus {corpus_bytes / 2**20:.0f} MB, peak RSS {peak / 2**20:.0f} MB ({m})")
    assert corpus_bytes > 4 * peak, (corpus_bytes, m)


def test_each_rank_starts_at_most_its_share_of_the_cores_in_workers(
    parquet_corpus, tmp_path, monkeypatch
):
    """Tokenizer workers per rank: cores / local ranks (torchrun's LOCAL_WORLD_SIZE, or every
    rank process the local launcher runs here), for the default and as a cap on data.workers."""
    from prime_train import datasets
    from prime_train.config_load import load_config

    monkeypatch.setattr(datasets, "cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(datasets.LOCAL_PROCESSES_ENV, raising=False)
    pick = datasets.tokenizer_workers
    assert (pick(None), pick(4), pick(0), pick(64)) == (16, 4, 0, 16)  # one rank: every core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun --nproc-per-node 8
    assert (pick(None), pick(1), pick(0), pick(64)) == (2, 1, 0, 2)
    monkeypatch.setenv(datasets.LOCAL_PROCESSES_ENV, "32")  # more ranks than cores: still 1
    assert (pick(None), pick(3)) == (1, 1)

    # what a rank of a node of 8 asks the token cache for
    monkeypatch.setenv(datasets.LOCAL_PROCESSES_ENV, "1")
    asked = []

    def build(spec, cache, workers):
        asked.append(workers)
        return build_corpus_tokens(spec, cache, 0)

    monkeypatch.setattr(datasets, "build_corpus_tokens", build)
    args = ["--data.source", "parquet", "--data.path", str(parquet_corpus)]
    cfg = load_config(DEBUG, [*args, "--data.cache_dir", str(tmp_path / "c")], env={})
    datasets.open_datasets(cfg, 257)
    assert asked == [2]


def test_the_local_launcher_tells_each_rank_how_many_share_the_machine(tmp_path, monkeypatch):
    import contextlib

    from prime_train import launch
    from prime_train.datasets import LOCAL_PROCESSES_ENV

    seen = []

    class Proc:
        pid, stdout = 0, None

        def __init__(self, argv, env, **kw):
            seen.append(env[LOCAL_PROCESSES_ENV])

    class Coord:
        address = "127.0.0.1:1"

    monkeypatch.setattr(launch.subprocess, "Popen", Proc)
    monkeypatch.setattr(launch, "_pump", lambda *a: None)
    monkeypatch.setattr(launch, "_wait_registered", lambda *a: None)
    monkeypatch.setattr(launch, "_wait_all", lambda ranks, *a, **k: {0: 0})
    monkeypatch.setattr(launch.os, "killpg", lambda *a: None)
    Proc.poll = lambda self: 0
    launch.launch_local_nodes([], 2, lambda n: contextlib.nullcontext(Coord()), ranks_per_node=3)
    assert seen == ["6"] * 6
