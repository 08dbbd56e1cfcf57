"""The update log: lossless packing, entries, pruning with holds, and a bit-identical replay."""

import pytest
import torch

import prime_comm
from prime_train.diloco import update_codec
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.diloco.replay_log import BadEntry, Entry, ReplayLog, entry_key, entry_name

KEY = entry_key("replay-log-test-token")


def quantized(n: int, seed: int) -> torch.Tensor:
    """What an all-reduce hands back: the decode of uint8 codebooks, then scaled."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    return prime_comm.dequantize(prime_comm.quantize(x)).mul_(3 / 2)


def test_packing_is_bit_exact_and_small_after_a_uint8_all_reduce():
    for n in (0, 1, 5, update_codec.ROW, update_codec.ROW + 1, 200_003):
        x = quantized(n, n)
        if n:
            x[0] = -0.0  # kept apart from 0.0
        packed = update_codec.pack(x)
        back = update_codec.unpack(packed)
        assert torch.equal(back.view(torch.int32), x.view(torch.int32)), n
    big = quantized(300_000, 1)
    size = sum(len(v) for v in update_codec.pack(big).values() if isinstance(v, bytes))
    assert size < 1.3 * big.numel()
    raw = torch.randn(50_000)  # not quantized: stored as is
    assert update_codec.pack(raw)["kind"] == "raw"
    assert torch.equal(update_codec.unpack(update_codec.pack(raw)), raw)


def test_an_entry_round_trips_and_a_corrupt_or_forged_one_is_refused():
    e = Entry(3, 30, 0, "a" * 64, "b" * 64, quantized(1000, 3), {"slot": [1, 2]})
    data = e.encode(KEY)
    back = Entry.decode(data, KEY)
    assert (back.outer_step, back.step, back.shared) == (3, 30, {"slot": [1, 2]})
    assert torch.equal(back.update, e.update)
    bad = bytearray(data)
    bad[-5] ^= 1
    try:
        Entry.decode(bytes(bad), KEY)
    except BadEntry:
        pass
    else:
        raise AssertionError("a corrupt entry was accepted")
    with pytest.raises(BadEntry, match="another token"):  # forged: rebuilt without the token
        Entry.decode(e.encode(entry_key("not-the-runs-token")), KEY)
    with pytest.raises(BadEntry, match="another token"):
        Entry.decode(e.encode(entry_key(None)), KEY)


def test_replaying_logged_updates_reproduces_the_outer_weights_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 70)), torch.nn.Parameter(torch.randn(11))]
    member = OuterOptimizer(params, lr=0.7, momentum=0.9)
    joiner_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    joiner = OuterOptimizer(joiner_params, lr=0.7, momentum=0.9)
    log = ReplayLog(tmp_path, rank=0, keep=3, key=KEY)
    for k in range(1, 6):
        member.pseudo_gradient.copy_(quantized(member.weights.numel(), k))
        member.apply()
        log.append(Entry(k, 10 * k, 0, member.digest(), member.digest(),
                         member.pseudo_gradient, {}))  # fmt: skip
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".entry"))
    assert names == [entry_name(k, 0) for k in (3, 4, 5)]  # the last K = 3
    for k in (1, 2):  # the joiner starts from the state after outer step 2
        joiner.pseudo_gradient.copy_(quantized(member.weights.numel(), k))
        joiner.apply()
    for name in names:
        e = Entry.decode((tmp_path / name).read_bytes(), KEY)
        joiner.pseudo_gradient.copy_(e.update)
        joiner.apply()
        assert joiner.digest() == e.shard_sha256
    assert torch.equal(joiner.momentum_buffer, member.momentum_buffer)


def test_entries_a_joiner_holds_are_not_pruned(tmp_path):
    held = [entry_name(2, 0)]
    log = ReplayLog(tmp_path, rank=0, keep=1, key=KEY, held_from=lambda: held[0])
    for k in range(1, 5):
        log.append(Entry(k, k, 0, "h", "h", torch.zeros(4), {}))
    log.wait()
    have = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".entry"))
    assert have == [entry_name(k, 0) for k in (2, 3, 4)]
    held[0] = None
    log.append(Entry(5, 5, 0, "h", "h", torch.zeros(4), {}))
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".entry")) == [
        entry_name(5, 0)
    ]
    ReplayLog(tmp_path, rank=0, keep=1, key=KEY).close()  # a new process: not its history
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".entry")]
