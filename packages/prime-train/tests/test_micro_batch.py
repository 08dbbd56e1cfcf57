"""`[train] micro_batch_size`: the step's batch split into micro-batches with their gradients
summed trains the same run as the whole batch (float32 on CPU), is machine-local (outside the
config hash, so a run may resume with another), and bad values are refused at start."""

import pytest

from prime_testkit import losses
from prime_train.config_load import load_config
from prime_train.rundir import claim_run_dir
from prime_train.trainer import train


def test_micro_batches_train_the_same_run_as_the_whole_batch(tiny):
    common = ("--train.steps", "12", "--run.log_every", "1", "--eval.every", "6")
    whole = tiny(*common, "--run.name", "whole")
    split = tiny(*common, "--run.name", "split", "--train.micro_batch_size", "2")
    train(whole)
    train(split)
    (a, ea), (b, eb) = losses(whole.run_dir), losses(split.run_dir)
    assert len(a) == len(b) == 12 and len(ea) == len(eb) == 3
    assert max(abs(x - y) for x, y in zip(a + ea, b + eb, strict=True)) < 1e-4, (a, b)
    assert a[-1] < a[0]  # it trained


def test_micro_batch_size_is_machine_local(tiny):
    a = tiny("--train.micro_batch_size", "2")
    b = tiny("--train.micro_batch_size", "4")
    assert a.fingerprint_hash() == b.fingerprint_hash() == tiny().fingerprint_hash()
    claim_run_dir(a, write=True)
    claim_run_dir(b, write=True)  # the same run, resumed with other micro-batches: accepted


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ("3", "`train.micro_batch_size` = 3 (from --train.micro_batch_size) does not divide "
              "`train.batch_size` = 8"),
        ("3", "use a divisor such as 2 or 4"),
        ("16", "use a divisor such as 4 or 8"),
        ("0", "greater than or equal to 1"),
        ("-2", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_micro_batch_sizes_are_refused(tiny, value, expect):
    from prime_train.config_load import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny("--train.micro_batch_size", value)
    assert expect in str(e.value), str(e.value)


def test_the_cli_refuses_bad_micro_batches_with_exit_2(tmp_path, run_cli, tiny_cli_args):
    for value in ("5", "0"):
        r = run_cli(*tiny_cli_args(tmp_path, "--train.micro_batch_size", value))
        assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-1000:]
        assert r.stderr.startswith("prime-train: config error: `train.micro_batch_size` = ")
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "debug").exists()  # refused before anything was made


def test_micro_batch_size_from_the_environment_names_its_origin():
    with pytest.raises(ValueError, match="from environment PRIME_TRAIN__MICRO_BATCH_SIZE"):
        load_config(None, [], env={"PRIME_TRAIN__MICRO_BATCH_SIZE": "3"})
