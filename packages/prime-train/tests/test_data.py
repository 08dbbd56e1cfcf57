"""Data: the token cache, held-out split, determinism, slots shared by ranks, resume."""

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_train.corpus import resolve_files
from prime_train.data import SyntheticSequences, TokenSequences, eval_batches
from prime_train.slot_loader import SlotLoader
from prime_train.token_cache import CorpusSpec, build_corpus_tokens
from prime_train.tokens import ByteTokenizer, DataError, make_tokenizer


def build_token_cache(path, tokenizer, fraction, cache_dir):
    """The whole corpus, tokenized in this process."""
    spec = CorpusSpec(str(path), "text", "text", tokenizer, fraction)
    return build_corpus_tokens(spec, cache_dir, workers=0)


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i in range(30):
        (d / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(
            f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i)
        )
    return d


def test_byte_cache_round_trip_and_heldout_split(corpus, tmp_path):
    tok = ByteTokenizer()
    files = build_token_cache(str(corpus), "byte", 0.2, tmp_path / "cache")
    train = np.load(files.train, mmap_mode="r")
    held = np.load(files.heldout, mmap_mode="r")
    assert train.dtype == np.uint16
    docs = [
        tok.decode(list(map(int, chunk)))
        for chunk in np.split(np.asarray(held), np.flatnonzero(np.asarray(held) == tok.eos_id) + 1)
        if len(chunk)
    ]
    held_names = {d.split(":")[0] for d in docs}
    train_text = tok.decode(list(map(int, train)))
    assert held_names and all(f"{name}:" not in train_text for name in held_names)
    n_docs = int((np.asarray(train) == 256).sum() + (np.asarray(held) == 256).sum())
    assert n_docs == 30
    # cached: a second build returns the same files without rewriting them
    mtime = files.train.stat().st_mtime_ns
    again = build_token_cache(str(corpus), "byte", 0.2, tmp_path / "cache")
    assert again == files and files.train.stat().st_mtime_ns == mtime
    assert not [p for p in files.train.parent.iterdir() if p.name.endswith(".tmp")]
    # a changed file invalidates the cache key
    (corpus / "doc00.txt").write_text("changed")
    assert build_token_cache(str(corpus), "byte", 0.2, tmp_path / "cache").train != files.train


def test_glob_and_stdlib(corpus):
    assert len(resolve_files(str(corpus / "*.txt"))) == 15
    assert len(resolve_files(str(corpus / "**" / "*.txt"))) == 30
    std = resolve_files("{stdlib}/*.py")
    assert std and all(Path(sysconfig.get_paths()["stdlib"]) == p.parent for p in std)
    with pytest.raises(DataError, match="matches no files"):
        resolve_files(str(corpus / "*.nothing"))


def test_hf_tokenizer(corpus, tmp_path):
    import tokenizers  # a dev dependency of the workspace (prime-train[hf] for users)
    from tokenizers import models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"])
    tk.train([str(p) for p in resolve_files(str(corpus))], trainer)
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    tok = make_tokenizer(str(path))
    assert tok.eos_id == 1 and tok.vocab_size <= 120
    files = build_token_cache(str(corpus), str(path), 0.2, tmp_path / "cache")
    ids = np.load(files.train)
    assert ids.max() < tok.vocab_size and "quick brown fox" in tok.decode(list(map(int, ids[:40])))
    with pytest.raises(DataError, match="tokenizer file not found"):
        make_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer"):
        make_tokenizer(str(tmp_path / "bad.json"))


def make_seqs(tmp_path, n_tokens=10_001, seq_len=10):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(n_tokens, dtype=np.uint32) % 60000)
    return TokenSequences(path, seq_len)


def test_packing(tmp_path):
    seqs = make_seqs(tmp_path)
    assert len(seqs) == 1000
    assert seqs[0].tolist() == list(range(11))
    assert seqs[1][0] == 10  # sequences overlap by the one target token
    with pytest.raises(IndexError):
        seqs[1000]


def first_tokens(loader, batches):
    return [loader.next_batch()[0][:, 0].tolist() for _ in range(batches)]


def slot_loader(seqs, batch, seed=0, slots=4, rank=0, ranks=1):
    loader = SlotLoader(seqs, batch, slots, "a", rank, ranks, seed=seed)
    loader.reassign(["a"])
    return loader


def test_determinism_and_passes(tmp_path):
    seqs = make_seqs(tmp_path)  # 1000 sequences: 250 per slot
    a, b = slot_loader(seqs, 4, seed=1), slot_loader(seqs, 4, seed=1)
    assert first_tokens(a, 300) == first_tokens(b, 300)  # crosses into the second pass
    a.end_round()
    assert a.uncommitted() == [300] * 4  # positions count across passes
    c = slot_loader(seqs, 4, seed=2)
    assert first_tokens(c, 5) != first_tokens(slot_loader(seqs, 4, seed=1), 5)
    x, y = slot_loader(seqs, 4).next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (4, 10)


def test_a_nodes_ranks_read_disjoint_sequences_covering_each_slot_once_per_pass(tmp_path):
    seqs = make_seqs(tmp_path)
    ranks = [slot_loader(seqs, 5, rank=r, ranks=2) for r in range(2)]
    seen = [{t for batch in first_tokens(ld, 100) for t in batch} for ld in ranks]
    assert all(len(s) == 500 for s in seen) and not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 1000  # every sequence once per pass, no overlap


def test_resume_position_is_exact(tmp_path):
    seqs = make_seqs(tmp_path)
    expected = first_tokens(slot_loader(seqs, 3, seed=5), 400)
    part = slot_loader(seqs, 3, seed=5)
    got = first_tokens(part, 123)
    state = dict(part.state_dict())
    resumed = slot_loader(seqs, 3, seed=5)
    resumed.load_state_dict(state)
    got += first_tokens(resumed, 400 - 123)
    assert got == expected


def test_too_little_data_is_clear(tmp_path):
    seqs = make_seqs(tmp_path, n_tokens=41, seq_len=10)
    with pytest.raises(DataError, match="too little data.*data.slots = 8"):
        SlotLoader(seqs, 3, 8, "a")
    with pytest.raises(DataError, match="too little held-out data"):
        eval_batches(seqs, 3, 2, 0, 2)


def test_eval_batches_fixed_and_sharded(tmp_path):
    seqs = make_seqs(tmp_path)
    a = eval_batches(seqs, 4, 3, 0, 2)
    b = eval_batches(seqs, 4, 3, 1, 2)
    assert len(a) == 3 and torch.equal(a[0][0], eval_batches(seqs, 4, 3, 0, 2)[0][0])
    assert not set(a[0][0][:, 0].tolist()) & set(b[0][0][:, 0].tolist())


def test_synthetic_is_deterministic():
    a, b = SyntheticSequences(100, 16, seed=3), SyntheticSequences(100, 16, seed=3)
    assert torch.equal(a[12345], b[12345]) and not torch.equal(a[1], a[2])
    assert a[7].shape == (17,) and int(a[7].max()) < 100


def test_concurrent_builders_leave_one_complete_cache(corpus, tmp_path):
    """Several processes building the same cache at once all end with identical files."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=build_token_cache, args=(str(corpus), "byte", 0.2, tmp_path / "cache"))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    files = build_token_cache(str(corpus), "byte", 0.2, tmp_path / "cache")
    assert np.load(files.train).size > 0
    assert not [p for p in os.listdir(files.train.parent) if p.endswith(".tmp")]
