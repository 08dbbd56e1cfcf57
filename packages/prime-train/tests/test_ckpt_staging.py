"""`[ckpt] ram`: where a node stages a checkpoint ("shm", "disk" or "off"), through the
config and the CLI."""

import shutil

import pytest

from prime_ckpt.faults import ENV
from prime_ckpt.staging import default_shm_dir
from prime_train.checkpointing import Checkpointer
from prime_train.config_load import ConfigError, load_config


def test_ram_and_disk_timeout_are_accepted_refused_clearly_and_not_hashed(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[ckpt]\nram = "disk"\n')
    cfg = load_config(toml, [], env={})
    assert cfg.ckpt.ram == "disk"
    assert load_config(None, [], env={"PRIME_CKPT__RAM": "off"}).ckpt.ram == "off"
    assert load_config(None, [], env={}).ckpt.ram == "shm"
    with pytest.raises(ConfigError, match=r"`ckpt.ram` = 'tmpfs'.*'shm', 'disk' or 'off'"):
        load_config(None, ["--ckpt.ram", "tmpfs"], env={})
    with pytest.raises(ConfigError, match="shm_dir = '/x' has no use with ram = 'off'"):
        load_config(None, ["--ckpt.ram", "off", "--ckpt.shm_dir", "/x"], env={})
    # where a machine stages its checkpoints is its own business: nodes still agree
    hashes = {
        load_config(None, ["--ckpt.ram", r], env={}).fingerprint_hash()
        for r in ("shm", "disk", "off")
    }
    assert len(hashes) == 1
    bounded = load_config(None, ["--ckpt.disk_timeout_s", "7"], env={})
    assert bounded.fingerprint_hash() in hashes
    with pytest.raises(ConfigError, match="ckpt.disk_timeout_s"):
        load_config(None, ["--ckpt.disk_timeout_s", "0"], env={})
    ckpt = Checkpointer(
        tmp_path / "ckpt", 0, 1, ram=cfg.ckpt.ram, disk_timeout_s=bounded.ckpt.disk_timeout_s
    )
    try:
        assert (
            ckpt.manager.disk_timeout == 7.0
            and ckpt.manager.shm_dir == tmp_path / "ckpt" / ".staging-r0"
        )
    finally:
        ckpt.close()


@pytest.mark.parametrize("ram", ["shm", "disk", "off"])
def test_the_staging_folder_is_used_as_set(tmp_path, run_cli, tiny_cli_args, ram):
    """A node killed right after its first checkpoint is committed leaves its staging folder
    behind (as a real crash would): in /dev/shm, in ckpt/, or none."""
    runs = tmp_path / "runs"
    args = tiny_cli_args(runs, "--train.steps", "20", "--ckpt.every", "10", "--ckpt.ram", ram)
    ckpt = runs / "debug" / "ckpt"
    in_ram, on_disk = default_shm_dir(ckpt, 0), ckpt / ".staging-r0"
    try:
        r = run_cli(*args, env={ENV: "after_rename@10"}, timeout=200)
        assert r.returncode != 0 and (ckpt / "step-0000000010").is_dir(), r.stderr[-2000:]
        staged = {p for p in (in_ram, on_disk) if (p / "slot-0" / "rank-00000.bin").is_file()}
        assert staged == {"shm": {in_ram}, "disk": {on_disk}, "off": set()}[ram]
    finally:
        shutil.rmtree(in_ram, ignore_errors=True)
