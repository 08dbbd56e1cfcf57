"""Config parsing: precedence, every error path, secrets, --help."""

import json
from pathlib import Path

import pytest

from prime_train.config import Config
from prime_train.config_load import ConfigError, describe_fields, load_config, parse_overrides
from prime_train.rundir import RunDirError, claim_run_dir

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_without_file():
    cfg = load_config(None, [], env={})
    assert cfg == Config()
    assert cfg.diloco.outer_lr == 0.7 and cfg.diloco.outer_momentum == 0.9
    assert cfg.diloco.compression == "uint8" and cfg.launch.local_nodes == 1


@pytest.mark.parametrize("width", ["uint4", "uint2"])
def test_low_bit_compression_is_accepted_and_passed_through(tmp_path, width):
    p = write(tmp_path, f'[diloco]\ncompression = "{width}"\n')
    assert load_config(p, [], env={}).diloco.compression == width
    cfg = load_config(None, ["--diloco.compression", width], env={})
    assert cfg.diloco.compression == width


def test_precedence_cli_over_env_over_toml_over_default(tmp_path):
    p = write(tmp_path, "[train]\nsteps = 5\nbatch_size = 3\n[optim]\nlr = 0.5\n")
    env = {"PRIME_TRAIN__STEPS": "7", "PRIME_OPTIM__LR": "0.25"}
    cfg = load_config(p, ["--train.steps", "9"], env=env)
    assert cfg.train.steps == 9  # command line beats env and TOML
    assert cfg.optim.lr == 0.25  # env beats TOML
    assert cfg.train.batch_size == 3  # TOML beats default
    assert cfg.optim.weight_decay == 0.1  # default
    cfg = load_config(p, ["--train.steps=11", "--train.compile"], env={})
    assert cfg.train.steps == 11 and cfg.train.compile is True


def test_optional_values_and_types_from_strings(tmp_path):
    cfg = load_config(
        None,
        ["--model.dim", "64", "--data.cache_dir", "/tmp/x", "--ckpt.shm_dir", "none"],
        env={"PRIME_TRAIN__ACTIVATION_CHECKPOINTING": "true"},
    )
    assert cfg.model.dim == 64 and cfg.data.cache_dir == Path("/tmp/x")
    assert cfg.ckpt.shm_dir is None and cfg.train.activation_checkpointing is True


def test_shipped_configs_parse():
    names = sorted(p.name for p in (REPO / "configs").glob("*.toml"))
    assert {"debug.toml", "150M.toml", "1B.toml", "10B.toml"} <= set(names)
    for name in names:
        load_config(REPO / "configs" / name, [], env={})
    big = load_config(REPO / "configs" / "10B.toml", [], env={})
    assert big.model.preset == "10B" and big.optim.schedule == "wsd"


@pytest.mark.parametrize(
    ("toml", "args", "env", "expect"),
    [
        ("[train]\nstepz = 3\n", [], {}, ["train.stepz", "did you mean `train.steps`"]),
        ("[trian]\nsteps = 3\n", [], {}, ["trian", "did you mean `train`"]),
        (
            "",
            ["--optim.wieght_decay", "1"],
            {},
            ["optim.wieght_decay", "did you mean `optim.weight_decay`"],
        ),
        ("", [], {"PRIME_TRAIN__BATCHSIZE": "3"}, ["PRIME_TRAIN__BATCHSIZE", "train.batch_size"]),
        ("[train]\nsteps = 'many'\n", [], {}, ["train.steps", "'many'", "integer", "Fix:"]),
        ("", ["--train.steps", "0"], {}, ["train.steps", "from --train.steps", "greater than"]),
        ("", ["--model.preset", "3B"], {}, ["model.preset", "'debug'", "'10B'"]),
        ("", ["--data.heldout_fraction", "0.9"], {}, ["data.heldout_fraction", "less than 0.5"]),
        ("", ["--mesh.coordinator", "nohost"], {}, ["mesh.coordinator", "HOST:PORT"]),
        ("", ["--diloco.compression", "fp8"], {}, ["diloco.compression", "'uint8'", "'none'"]),
        ("", ["--run.name", "a/b"], {}, ["run.name", "names a folder"]),
        ("", ["--diloco.max_rejoins", "-1"], {}, ["diloco.max_rejoins", "greater than"]),
        ("", ["--mesh.heartbeat_timeout_s", "0.5"], {}, ["heartbeat_timeout_s must exceed"]),
        ("train = 3\n", [], {}, ["`train` must be a table"]),
        ("[train\n", [], {}, ["not valid TOML"]),
        ("", ["steps", "3"], {}, ["unexpected argument `steps`", "--section.key"]),
        ("", ["--mesh.token", "s3cret"], {}, ["refused", "PRIME_TOKEN"]),
        # DiLoCo checkpoints at outer steps only: the two multiples of H around the value
        (
            "[diloco]\ninner_steps = 20\n",
            ["--launch.local_nodes", "2", "--ckpt.every", "30"],
            {},
            [
                "`ckpt.every` = 30 (from --ckpt.every)",
                "`diloco.inner_steps` = 20 (in ",
                "use ckpt.every = 20 or 40 (or 0: only when stopping)",
            ],
        ),
        (
            "",
            ["--mesh.coordinator", "h:1", "--diloco.inner_steps", "50"],
            {"PRIME_CKPT__EVERY": "20"},
            ["`ckpt.every` = 20 (from environment PRIME_CKPT__EVERY)", "ckpt.every = 50 (or 0"],
        ),
        (
            "",
            ["--launch.ranks_per_node", "2", "--ckpt.every", "7", "--diloco.inner_steps", "5"],
            {},
            ["ckpt.every = 5 or 10"],
        ),
    ],
)
def test_errors_name_the_key_and_the_fix(tmp_path, toml, args, env, expect):
    p = write(tmp_path, toml)
    with pytest.raises(ConfigError) as e:
        load_config(p, args, env=env)
    msg = str(e.value)
    for piece in expect:
        assert piece in msg, (piece, msg)
    assert len(msg.splitlines()) <= 2
    assert "s3cret" not in msg


def test_ckpt_every_off_the_outer_steps_is_fine_without_diloco():
    """One node without a mesh checkpoints at any step (torchrun's ranks of one node too)."""
    load_config(None, ["--ckpt.every", "30", "--diloco.inner_steps", "20"], env={})
    args = ["--launch.ranks_per_node", "2", "--ckpt.every", "7", "--diloco.inner_steps", "5"]
    load_config(None, args, env={"LOCAL_RANK": "0"})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml", [], env={})


def test_token_from_env_never_saved(tmp_path):
    cfg = load_config(None, ["--run.runs_dir", str(tmp_path)], env={"PRIME_TOKEN": "s3cret"})
    assert cfg.mesh.token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cfg)
    claim_run_dir(cfg, write=True)
    text = (cfg.run_dir / "config.json").read_text()
    assert "s3cret" not in text and "token" not in json.loads(text)["mesh"]
    assert json.loads(text)["train"]["steps"] == cfg.train.steps


def test_run_dir_with_other_config_is_refused(tmp_path):
    cfg = load_config(None, ["--run.runs_dir", str(tmp_path)], env={})
    claim_run_dir(cfg, write=True)
    claim_run_dir(cfg, write=True)  # same config: fine (a resume)
    same_but_logging = load_config(None, ["--run.runs_dir", str(tmp_path), "--run.log_every", "3"])
    claim_run_dir(same_but_logging, write=True)
    other = load_config(None, ["--run.runs_dir", str(tmp_path), "--train.steps", "5"], env={})
    with pytest.raises(RunDirError, match=r"train.steps: 1000 -> 5.*another --run.name"):
        claim_run_dir(other, write=True)
    assert json.loads((cfg.run_dir / "config.json").read_text())["train"]["steps"] == 1000


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=2", "--e.f"]) == [
        ("a.b", "1"),
        ("c.d", "2"),
        ("e.f", "true"),
    ]


def test_describe_fields_covers_every_key():
    text = describe_fields()
    for section, cls in Config.model_fields.items():
        for key in cls.annotation.model_fields:
            assert f"--{section}.{key} " in text


def test_cli_config_errors_exit_2_without_traceback(tmp_path, run_cli):
    bad = write(tmp_path, "[train]\nstepz = 3\n")
    r = run_cli("--config", str(bad))
    assert r.returncode == 2, r.stderr
    assert "did you mean `train.steps`" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2
    r = run_cli("--config", str(DEBUG), "--mesh.token", "s3cret")
    assert r.returncode == 2 and "PRIME_TOKEN" in r.stderr and "s3cret" not in r.stderr
    r = run_cli("--config", str(DEBUG), env={"PRIME_TRAIN__STEPS": "-1"})
    assert r.returncode == 2 and "PRIME_TRAIN__STEPS" in r.stderr and "Traceback" not in r.stderr
    # the debug config's 2 DiLoCo nodes take an outer step every 50: refused before any starts
    r = run_cli("--config", str(DEBUG), "--run.runs_dir", str(tmp_path), "--ckpt.every", "120")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "prime-train: config error: `ckpt.every` = 120 (from --ckpt.every) is not a multiple of "
        f"`diloco.inner_steps` = 50 (in {DEBUG}): a DiLoCo node checkpoints only at outer steps; "
        "use ckpt.every = 100 or 150 (or 0: only when stopping)"
    )
    assert "coordinator" not in r.stdout and not (tmp_path / "debug").exists()


def test_cli_help_documents_fields(run_cli):
    r = run_cli("--help")
    assert r.returncode == 0
    for piece in (
        "--train.steps",
        "--diloco.outer_lr",
        "--launch.local_nodes",
        "PRIME_TOKEN",
        "PRIME_SECTION__KEY",
    ):
        assert piece in r.stdout


def test_remote_options_as_an_inline_table_never_saved(tmp_path):
    table = '{endpoint_url = "http://127.0.0.1:9000", client_kwargs = {region_name = "x"}}'
    cfg = load_config(
        None,
        ["--run.runs_dir", str(tmp_path), "--ckpt.remote_options", table],
        env={"PRIME_CKPT__REMOTE_OPTIONS": '{key = "ignored"}'},
    )
    assert cfg.ckpt.remote_options == {
        "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "x"},
    }
    env_only = load_config(None, [], env={"PRIME_CKPT__REMOTE_OPTIONS": '{secret = "s3cret"}'})
    assert env_only.ckpt.remote_options == {"secret": "s3cret"}
    claim_run_dir(cfg, write=True)
    saved = json.loads((cfg.run_dir / "config.json").read_text())
    assert "remote_options" not in saved["ckpt"] and "9000" not in json.dumps(saved)
    with pytest.raises(ConfigError, match="not a TOML inline table") as e:
        load_config(None, ["--ckpt.remote_options", "secret=s3cret"], env={})
    assert "s3cret" not in str(e.value)
    toml = tmp_path / "bad.toml"
    toml.write_text('[ckpt]\nremote_options = "secret=s3cret"\n')
    with pytest.raises(ConfigError, match="ckpt.remote_options") as e:
        load_config(toml, [], env={})
    assert "s3cret" not in str(e.value) and "<hidden>" in str(e.value)


def test_machine_local_settings_leave_the_config_hash_alone(tmp_path):
    base = load_config(None, [], env={})
    local = load_config(
        None,
        ["--run.runs_dir", str(tmp_path), "--data.cache_dir", "/x", "--train.threads", "3",
         "--ckpt.dir", "/c", "--ckpt.remote", "s3://b/r", "--ckpt.keep", "5",
         "--mesh.node_name", "n7", "--train.micro_batch_size", "2"],
        env={},
    )  # fmt: skip
    assert local.fingerprint_hash() == base.fingerprint_hash()
    for other in (["--train.steps", "5"], ["--run.name", "x"], ["--data.seq_len", "64"]):
        assert load_config(None, other, env={}).fingerprint_hash() != base.fingerprint_hash()


def test_time_budgeted_rounds_enter_the_config_hash_only_when_on():
    base = load_config(None, [], env={})
    # off (the default): the hash of the configs made before the settings existed
    assert "round_seconds" not in base.fingerprint()["diloco"]
    assert "min_inner_steps" not in base.fingerprint()["diloco"]
    same = ["--diloco.min_inner_steps", "5", "--diloco.max_missed_rounds", "9"]
    assert load_config(None, same, env={}).fingerprint_hash() == base.fingerprint_hash()
    on = load_config(None, ["--diloco.round_seconds", "30"], env={})
    assert on.fingerprint_hash() != base.fingerprint_hash()
    on_min = ["--diloco.round_seconds", "30", "--diloco.min_inner_steps", "5"]
    assert load_config(None, on_min, env={}).fingerprint_hash() != on.fingerprint_hash()
    with pytest.raises(ConfigError, match="min_inner_steps = 60 is more than inner_steps"):
        load_config(None, [*on_min[:2], "--diloco.min_inner_steps", "60"], env={})
    # a delayed run's rounds are time-budgeted the same way (the overlap is its own setting)
    delayed = load_config(None, [*on_min, "--diloco.overlap", "delayed"], env={})
    assert delayed.diloco.round_seconds == 30 and delayed.diloco.overlap == "delayed"
