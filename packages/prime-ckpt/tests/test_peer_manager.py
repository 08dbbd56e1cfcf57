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


def folder_steps(disk_dir) -> list[str]:
    return sorted(p.name for p in disk_dir.iterdir() if p.name.startswith("step-"))


def test_a_polling_joiner_and_a_transfer_add_at_most_one_checkpoint_beyond_keep(tmp_path):
    """keep=2, a joiner polling the index after every save (each answer leases the newest):
    the folder never holds more than keep + 1 checkpoints (it held every step polled, for
    the 120 s lease). A transfer in flight pins its step, which counts toward keep; the lease
    is a file beside the checkpoint, nothing is copied."""
    from prime_ckpt.peer import ask_donors
    from prime_ckpt.peer.auth import resolve_token

    key = resolve_token(TOKEN)
    sizes = []
    with (
        CheckpointManager(tmp_path / "donor", shm_dir=tmp_path / "shm-d", keep=2) as donor,
        serve_directory(donor.disk_dir, "127.0.0.1", token=TOKEN) as server,
    ):
        for step in range(1, 7):
            donor.save(step, seeded_state(step)).wait()
            assert len(folder_steps(donor.disk_dir)) <= 3, folder_steps(donor.disk_dir)
            wait_until(lambda step=step: ask_donors([server.url], key, 10)[0].step == step,
                       30, what=f"step {step} offered")  # fmt: skip
            sizes.append(sum(f.stat().st_size for f in donor.disk_dir.rglob("*")))
        assert folder_steps(donor.disk_dir) == [step_dirname(5), step_dirname(6)]
        # a transfer of step 6 in flight: 6 stays while 7 and 8 come; never more than 3
        opened = threading.Event()
        got = {}

        def pace(n: int) -> None:
            assert opened.wait(60)

        from prime_ckpt.peer import fetch_checkpoint

        t = threading.Thread(target=lambda: got.update(r=fetch_checkpoint(
            [server.url], tmp_path / "joiner", token=TOKEN, connections=1,
            chunk_bytes=256 << 10, pace=pace)), daemon=True)  # fmt: skip
        t.start()
        wait_until(lambda: any((tmp_path / "joiner").glob(".peer-*.partial")), 30,
                   what="the transfer to start")  # fmt: skip
        for step in (7, 8):
            donor.save(step, seeded_state(step)).wait()
            assert len(folder_steps(donor.disk_dir)) <= 3, folder_steps(donor.disk_dir)
        assert folder_steps(donor.disk_dir) == [step_dirname(6), step_dirname(8)]
        opened.set()
        t.join(60)
        assert not t.is_alive() and got["r"].step == 6
    one = sizes[0]  # step 1 alone (plus its lease file)
    assert max(sizes) <= 3 * one + 4096, (sizes, one)
    got_state = blank()
    with CheckpointManager(tmp_path / "joiner", shm_dir=tmp_path / "shm-j") as joiner:
        assert joiner.load_latest(got_state) == 6
    assert_state_equal(got_state, seeded_state(6))
