"""The update log: packing as the all-reduce's bytes, entries, pruning with holds, and a bit-identical replay."""

import pytest
import torch

import prime_comm
from prime_train.diloco import update_codec
from prime_train.diloco.outer_optimizer import OuterOptimizer
from prime_train.diloco.replay_log import BadEntry, Entry, ReplayLog, entry_key, entry_name

KEY = entry_key("replay-log-test-token")


def quantized(n: int, seed: int, bits: int = 8) -> tuple[torch.Tensor, update_codec.Encoded]:
    """What an all-reduce hands back: the decode of its kept encoding (two pieces, as two
    owners' chunks), then scaled; and that encoding with the scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    pieces = tuple(p for p in (n // 2, n - n // 2) if p)
    data = torch.cat(
        [prime_comm.quantize(part, bits=bits).data for part in torch.split(x, list(pieces))]
    )
    encoded = update_codec.Encoded(prime_comm.EncodedResult(data, bits, pieces), 3 / 2)
    return encoded.encoding.decode().mul_(3 / 2), encoded


def test_packing_is_the_encoding_bit_exact_and_small():
    for n, bits in ((1, 8), (5, 8), (70_001, 8), (200_003, 8), (200_003, 4), (70_001, 2)):
        x, encoded = quantized(n, n, bits)
        packed = update_codec.pack(x, encoded)
        assert packed["kind"] == "codes"
        back = update_codec.unpack(packed)
        assert torch.equal(back.view(torch.int32), x.view(torch.int32)), (n, bits)
        assert len(packed["data"]) < (bits / 8 + 0.02) * n + 2 * 4 * 2**bits
    with pytest.raises(ValueError, match="an encoding of"):
        update_codec.pack(x[:-1], encoded)
    broken = dict(packed, pieces=[1, 2])
    with pytest.raises(ValueError, match="update packing"):
        update_codec.unpack(broken)
    raw = torch.randn(50_000)  # not quantized (compression "none", one node): stored as is
    assert update_codec.pack(raw)["kind"] == "raw"
    assert torch.equal(update_codec.unpack(update_codec.pack(raw)), raw)
    assert update_codec.unpack(update_codec.pack(torch.zeros(0))).numel() == 0


def test_an_entry_round_trips_and_a_corrupt_or_forged_one_is_refused():
    update, encoded = quantized(1000, 3)
    e = Entry(3, 30, 0, "a" * 64, "b" * 64, update, {"slot": [1, 2]}).pack(encoded)
    data = e.encode(KEY)
    back = Entry.decode(data, KEY)
    assert (back.outer_step, back.step, back.shared) == (3, 30, {"slot": [1, 2]})
    assert torch.equal(back.update, update)
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
        update, encoded = quantized(member.weights.numel(), k)
        member.pseudo_gradient.copy_(update)
        member.apply()
        log.append(Entry(k, 10 * k, 0, member.digest(), member.digest(),
                         member.pseudo_gradient, {}).pack(encoded))  # fmt: skip
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".entry"))
    assert names == [entry_name(k, 0) for k in (3, 4, 5)]  # the last K = 3
    for k in (1, 2):  # the joiner starts from the state after outer step 2
        joiner.pseudo_gradient.copy_(quantized(member.weights.numel(), k)[0])
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
