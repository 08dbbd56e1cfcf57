"""The committed record's scratch file: tensors written in the background, read back in place."""

from __future__ import annotations

import pytest
import torch

from prime_testkit import rss_anon_kib
from prime_train.spill import CHUNK, SpillError, TensorSpill


def test_tensors_come_back_bit_for_bit_after_they_changed(tmp_path):
    big = torch.randn(CHUNK // 4 + 1001)  # more than one chunk, not a multiple of it
    tensors = [
        big,
        torch.randn(7, 5).to(torch.bfloat16),
        torch.tensor(3.0),  # AdamW's step count
        torch.randn(6, 4).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64),
    ]
    saved = [t.clone() for t in tensors]
    spill = TensorSpill(tmp_path / ".committed-r0")
    spill.write(tensors)
    spill.wait()
    for t in tensors:
        t.mul_(2).add_(1)
    spill.read_into(tensors)
    for t, s in zip(tensors, saved, strict=True):
        assert torch.equal(t, s)
    assert (tmp_path / ".committed-r0").stat().st_size == sum(
        t.numel() * t.element_size() for t in tensors
    )
    spill.close()
    assert not (tmp_path / ".committed-r0").exists()


def test_a_later_write_replaces_the_first_and_the_file_shrinks_with_it(tmp_path):
    spill = TensorSpill(tmp_path / "s")
    spill.write([torch.ones(1000)])
    a = torch.full((10,), 7.0)
    spill.write([a])  # (waits for the first)
    spill.wait()  # (what the optimizer's step does before it changes the tensors)
    a.zero_()
    spill.read_into([a])
    assert torch.equal(a, torch.full((10,), 7.0))
    assert (tmp_path / "s").stat().st_size == 40


def test_the_values_leave_anonymous_memory(tmp_path):
    """What the record spills is not kept in the process: 64 MiB written, RssAnon grows by
    at most a few chunks (the file's pages are the page cache's)."""
    t = torch.randn(16 << 20)
    spill = TensorSpill(tmp_path / "s")
    before = rss_anon_kib()
    spill.write([t])
    spill.wait()
    grown_mib = (rss_anon_kib() - before) / 1024
    assert grown_mib < 16, f"RssAnon grew by {grown_mib:.1f} MiB for a 64 MiB spill"
    spill.close()


def test_a_failed_write_is_raised_where_the_record_is_next_used(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spill = TensorSpill(blocker / "s")  # a folder that cannot be made
    spill.write([torch.ones(4)])
    with pytest.raises(SpillError, match="could not write"):
        spill.wait()


def test_reading_into_other_tensors_is_refused(tmp_path):
    spill = TensorSpill(tmp_path / "s")
    spill.write([torch.ones(4)])
    with pytest.raises(SpillError, match="holds tensors of"):
        spill.read_into([torch.ones(5)])
    with pytest.raises(SpillError, match="holds tensors of"):
        TensorSpill(tmp_path / "never-written").read_into([torch.ones(4)])
