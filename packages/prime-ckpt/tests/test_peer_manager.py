"""Peer transfer with real CheckpointManagers on both sides: what a donor's manager saved is
what the joiner's manager loads, and the donor's pruning waits for a transfer in flight."""

import threading

import torch

from prime_ckpt import CheckpointManager
from prime_ckpt.manifest import is_leased, step_dirname
from prime_ckpt.peer import fetch_from_peer, serve_directory
from prime_ckpt.peer.journal import JOURNAL
from prime_testkit import wait_until

TOKEN = "run-secret"


def seeded_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g)},
        "data": {"pos": seed * 10, "files": ["a", "b"]},
    }


def blank() -> dict:
    return {
        "model": {"w": torch.zeros(512, 1024), "b": torch.zeros(1024)},
        "data": {"pos": -1, "files": []},
    }


def assert_state_equal(got: dict, want: dict) -> None:
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["data"] == want["data"]


def test_manager_save_serve_fetch_load(tmp_path):
    with CheckpointManager(tmp_path / "donor", shm_dir=tmp_path / "shm-d") as donor:
        donor.save(5, seeded_state(5)).wait()
        with donor.serve("127.0.0.1", token=TOKEN) as server:
            assert fetch_from_peer([server.url], tmp_path / "joiner", token=TOKEN) == 5
    got = blank()
    with CheckpointManager(tmp_path / "joiner", shm_dir=tmp_path / "shm-j") as joiner:
        assert joiner.load_latest(got) == 5
    assert_state_equal(got, seeded_state(5))


def test_donor_pruning_waits_for_a_transfer_in_flight(tmp_path):
    """keep=1: the donor saves step 2 mid-transfer; step 1 is leased, so it is not pruned
    and the transfer of step 1 completes; the next joiner gets step 2."""
    joiner_dir = tmp_path / "joiner"
    with CheckpointManager(tmp_path / "donor", shm_dir=tmp_path / "shm-d", keep=1) as donor:
        donor.save(1, seeded_state(1)).wait()
        with serve_directory(
            donor.disk_dir, "127.0.0.1", token=TOKEN, max_bytes_per_s=2 << 20
        ) as server:
            errors, steps = [], []

            def fetch():
                try:
                    steps.append(
                        fetch_from_peer(
                            server.url,
                            joiner_dir,
                            token=TOKEN,
                            connections=2,
                            chunk_bytes=256 << 10,
                        )
                    )
                except Exception as e:  # reported below
                    errors.append(e)

            t = threading.Thread(target=fetch)
            t.start()
            digest_dirs = lambda: [p for p in joiner_dir.glob(".peer-*.partial")]  # noqa: E731
            wait_until(
                lambda: any((p / JOURNAL).exists() for p in digest_dirs()),
                timeout=30,
                what="the transfer to start",
            )
            assert is_leased(donor.disk_dir, 1)
            donor.save(2, seeded_state(2)).wait()  # would prune step 1 (keep=1) but for the lease
            assert (donor.disk_dir / step_dirname(1)).is_dir()
            assert t.is_alive(), "the transfer ended before the donor saved step 2"
            t.join(timeout=60)
            assert not t.is_alive() and not errors, errors
            assert steps == [1]
            got = blank()
            with CheckpointManager(joiner_dir, shm_dir=tmp_path / "shm-j") as joiner:
                assert joiner.load_latest(got) == 1
            assert_state_equal(got, seeded_state(1))
            assert fetch_from_peer(server.url, joiner_dir, token=TOKEN) == 2
    assert sorted(p.name for p in joiner_dir.iterdir()) == [step_dirname(1), step_dirname(2)]
