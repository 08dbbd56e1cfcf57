"""Hugging Face interop: `prime-train export` loads in real `transformers` with the same
logits, and `[model] init_from` starts a run from such a folder (export -> init_from ->
export is bit-identical). Every run goes through the CLI, as a user runs it."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_train.hf_export import read_run_config
from prime_train.hf_import import load_hf_weights, run_model_args
from prime_train.hf_layout import HFFormatError, args_from_hf
from prime_train.model import Transformer

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "debug.toml"


def cli(*args, cwd=None, timeout=280):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    return subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def export(*argv):
    """`prime-train export ...` in this process (the training runs are subprocesses)."""
    from prime_train.cli import main

    return main(["export", *map(str, argv)])


def tiny_run_args(runs_dir, tokenizer, corpus, name="debug", steps=3, *extra):
    return [
        "--config",
        str(DEBUG),
        "--run.runs_dir",
        str(runs_dir),
        "--run.name",
        name,
        "--launch.local_nodes",
        "1",
        "--data.path",
        str(corpus),
        "--data.tokenizer",
        str(tokenizer),
        "--data.seq_len",
        "32",
        "--train.batch_size",
        "4",
        "--train.steps",
        str(steps),
        "--eval.batches",
        "1",
        *extra,
    ]


def make_corpus_and_tokenizer(root: Path) -> tuple[Path, Path]:
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(
            f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (10 + i)
        )
    tk = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["[UNK]", "<|endoftext|>"])
    tk.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    tok = root / "tokenizer.json"
    tk.save(str(tok))
    return corpus, tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step run with a Hugging Face tokenizer, exported by the CLI."""
    root = tmp_path_factory.mktemp("hf")
    corpus, tok = make_corpus_and_tokenizer(root)
    r = cli(*tiny_run_args(root / "runs", tok, corpus))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run_dir = root / "runs" / "debug"
    assert export(run_dir, "--out", root / "hf") == 0
    return root, run_dir, root / "hf"


def prime_model_of(run_dir: Path, step: int) -> Transformer:
    """prime-train's model with the checkpoint's weights, read with prime-ckpt directly."""
    from prime_ckpt.manifest import step_dirname
    from prime_ckpt.reader import Source, read_tensor, tensor_paths

    src = Source.open("disk", run_dir / "ckpt" / step_dirname(step))
    weights = {p[1]: read_tensor(src, p) for p, _, _ in tensor_paths(src, ("model",))}
    args = run_model_args(
        read_run_config(run_dir), weights["tok_embeddings.weight"].shape[0], check=False
    )
    model = Transformer(args)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"rope_cos", "rope_sin"}
    return model.eval()


def load_hf(folder: Path, caplog):
    from transformers import AutoModelForCausalLM

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    words = ("missing", "unexpected", "newly initialized", "not used", "not initialized")
    assert not [r for r in caplog.records if any(w in r.getMessage().lower() for w in words)]
    return model.eval()


def test_export_loads_in_transformers_with_the_same_logits(exported, caplog):
    root, run_dir, hf = exported
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    model = load_hf(hf, caplog)
    assert model.dtype == torch.float32
    ours = prime_model_of(run_dir, 3)
    tokens = torch.randint(
        0, ours.args.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        theirs = model(tokens).logits
        mine = ours(tokens)
    assert theirs.shape == mine.shape
    assert torch.allclose(theirs, mine, atol=1e-4, rtol=0), (theirs - mine).abs().max()

    # the tokenizer files load with AutoTokenizer and encode as the run did
    from transformers import AutoTokenizer

    from prime_train.tokens import make_tokenizer

    at = AutoTokenizer.from_pretrained(hf)
    ours_tok = make_tokenizer(str(root / "tokenizer.json"))
    text = "the quick brown fox"
    assert at(text, add_special_tokens=False)["input_ids"] == ours_tok.encode_text(text).tolist()
    assert at.eos_token == "<|endoftext|>" and at.eos_token_id == ours_tok.eos_id
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["eos_token_id"] == ours_tok.eos_id and cfg["vocab_size"] == ours.args.vocab_size


def test_sharded_export_and_bad_input(exported, caplog, capsys):
    root, run_dir, hf = exported
    out = root / "hf-sharded"
    capsys.readouterr()
    assert export(run_dir, "--step", "3", "--out", out, "--max-shard-size", "40KB") == 0
    assert "exported step 3 (21 tensors)" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    from safetensors.torch import load_file

    whole = load_file(hf / "model.safetensors")
    parts = {}
    for s in shards:
        parts.update(load_file(out / s))
    assert parts.keys() == whole.keys() and all(torch.equal(parts[k], whole[k]) for k in whole)
    model = load_hf(out, caplog)
    tokens = torch.arange(20).view(1, 20)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, load_hf(hf, caplog)(tokens).logits)

    capsys.readouterr()  # transformers' progress bars
    for argv, expect in [
        ([root / "nope", "--out", root / "x"], "has no config.json"),
        ([run_dir, "--out", hf], "exists and is not empty"),
        ([run_dir, "--step", "2", "--out", root / "y"], "has no step 2"),
        ([run_dir, "--node", "1", "--out", root / "z"], "no committed"),
        ([run_dir, "--out", root / "w", "--max-shard-size", "lots"], "--max-shard-size"),
    ]:
        assert export(*argv) == 2
        err = capsys.readouterr().err
        assert expect in err and err.startswith("prime-train: "), err
        assert len(err.strip().splitlines()) == 1
    assert not (root / "y").exists() and not (root / "z").exists()


@pytest.mark.slow
def test_init_from_export_round_trip_is_bit_identical(exported, capsys):
    """export -> init_from -> export of the step-0 checkpoint gives the same bytes; the run
    starts from those weights, and resuming its own checkpoint takes precedence."""
    root, _, hf = exported
    corpus, tok = root / "corpus", root / "tokenizer.json"
    argv = tiny_run_args(root / "runs", tok, corpus, "cont", 2, "--model.init_from", str(hf))
    r = cli(*argv)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cont = root / "runs" / "cont"
    assert export(cont, "--step", "0", "--out", root / "hf-again") == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (root / "hf-again" / name).read_bytes() == (hf / name).read_bytes(), name
    # it trained from there: the step-2 weights moved away from the starting ones
    start, end = prime_model_of(cont, 0), prime_model_of(cont, 2)
    assert not torch.equal(start.output.weight, end.output.weight)
    # the config hash holds a digest of the weights, not the path
    saved = json.loads((cont / "config.json").read_text())
    assert saved["model"]["init_from"] == str(hf)
    fp = read_run_config(cont).fingerprint()["model"]["init_from"]
    assert fp.startswith("sha256:") and str(hf) not in fp
    # the same command again resumes the run's own step-2 checkpoint, not init_from
    r = cli(*argv)
    assert r.returncode == 0 and "resumed from the step-2 checkpoint" in r.stdout, r.stderr
    # changed weights under the same path: a different run, refused
    (hf / "model.safetensors").write_bytes(
        (root / "hf-again" / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"
    )
    from prime_train.cli import main

    assert main(argv) == 2  # in this process: it stops before training
    err = capsys.readouterr().err
    assert "different config" in err and "init_from" in err, err
    (hf / "model.safetensors").write_bytes((root / "hf-again" / "model.safetensors").read_bytes())


def make_hf_folder(folder: Path, **cfg_overrides) -> "torch.nn.Module":
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
    )
    cfg.update(cfg_overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(folder)
    return model


def test_init_from_loads_bf16_tied_weights_with_the_same_logits(tmp_path):
    """A folder made by transformers (bf16, tied embeddings) loads into prime-train's model."""
    hf_model = make_hf_folder(tmp_path / "m", tie_word_embeddings=True).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["tie_word_embeddings"] is True
    args = args_from_hf(tmp_path / "m", max_seq_len=64)
    assert (args.dim, args.ffn_hidden, args.kv_heads, args.rope_theta) == (64, 80, 2, 50000.0)
    ours = Transformer(args)
    load_hf_weights(ours, args, tmp_path / "m")
    assert ours.output.weight.dtype == torch.float32
    assert torch.equal(ours.output.weight, ours.tok_embeddings.weight)
    assert ours.output.weight.data_ptr() != ours.tok_embeddings.weight.data_ptr()  # untied
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf_model.float()(tokens).logits
        assert torch.allclose(ours(tokens), theirs, atol=1e-4, rtol=0)


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # wavelengths 6.3 (kept), 32 (blended), 167+ (scaled)
}


@pytest.mark.parametrize("written_as", ["rope_parameters", "rope_scaling"])
def test_init_from_llama3_rope_scaling_gives_transformers_logits(tmp_path, written_as):
    """A Llama 3.1-style folder (rope_type llama3), as transformers 5 writes it
    (`rope_parameters`) and as Llama 3.1's own config.json and transformers 4 do
    (`rope_scaling` beside `rope_theta`): prime-train's logits equal LlamaForCausalLM's."""
    from prime_train.model import Llama3RopeScaling

    hf_model = make_hf_folder(
        tmp_path / "m", rope_theta=500000.0, max_position_embeddings=128, rope_scaling=dict(LLAMA3)
    )
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    if written_as == "rope_scaling":
        meta.pop("rope_parameters")
        meta.update(rope_scaling=dict(LLAMA3), rope_theta=500000.0)
        path.write_text(json.dumps(meta))
    else:
        assert meta["rope_parameters"]["rope_type"] == "llama3"
    args = args_from_hf(tmp_path / "m", max_seq_len=64)
    assert args.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64, context_len=128)
    assert args.rope_theta == 500000.0
    ours = Transformer(args)
    load_hf_weights(ours, args, tmp_path / "m")
    tokens = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        assert torch.allclose(ours(tokens), theirs, atol=1e-4, rtol=0)
        # the scaling matters at these positions: without it the rotations and logits are off
        from dataclasses import replace

        plain = Transformer(replace(args, rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        assert (plain.rope_cos - ours.rope_cos).abs().max() > 0.5
        assert (plain(tokens) - theirs).abs().max() > 1e-3  # 10x the tolerance above


def test_llama3_folder_trains_and_exports_back(tmp_path, caplog):
    """The user's path: `--model.init_from` a llama3-scaled folder, train, `prime-train export`
    the step-0 checkpoint: transformers loads it as llama3 with the source model's logits."""
    debug_shape = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4)
    hf_model = make_hf_folder(
        tmp_path / "m",
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling=dict(LLAMA3),
        **debug_shape,
    )
    r = cli(
        "--config", DEBUG, "--run.runs_dir", tmp_path / "runs", "--launch.local_nodes", "1",
        "--model.init_from", tmp_path / "m", "--data.path", "{stdlib}/[a-c]*.py",
        "--data.seq_len", "64", "--train.batch_size", "4", "--train.steps", "2",
        "--eval.batches", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert export(tmp_path / "runs" / "debug", "--step", "0", "--out", tmp_path / "out") == 0
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["rope_scaling"] == LLAMA3 and meta["rope_parameters"]["rope_type"] == "llama3"
    assert meta["max_position_embeddings"] == 512  # the source's context, not data.seq_len
    back = load_hf(tmp_path / "out", caplog)
    assert back.config.rope_parameters["rope_type"] == "llama3"
    tokens = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(back(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"head_dim": 32}, "head_dim"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_init_from_rejects_what_the_model_cannot_represent(tmp_path, overrides, field):
    make_hf_folder(tmp_path / "m", **overrides)
    with pytest.raises(HFFormatError, match=field):
        args_from_hf(tmp_path / "m", max_seq_len=64)


def test_init_from_config_errors_are_one_clear_line(tmp_path, capsys):
    from prime_train.cli import main

    debug_shape = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4)
    make_hf_folder(tmp_path / "m", **debug_shape)  # the debug preset's shape, 300 tokens
    make_hf_folder(tmp_path / "small", vocab_size=200, **debug_shape)
    base = ["--config", str(DEBUG), "--run.runs_dir", str(tmp_path), "--launch.local_nodes", "1"]
    base += ["--train.steps", "1", "--model.init_from"]
    for i, (extra, expect) in enumerate(
        [
            ([str(tmp_path / "m"), "--model.dim", "256"], "model.dim = 256 disagrees"),
            ([str(tmp_path / "m"), "--model.preset", "150M"], "model.preset = '150M' disagrees"),
            ([str(tmp_path / "small")], "'vocab_size' = 200 is smaller than the tokenizer's 257"),
            ([str(tmp_path / "none")], "none/config.json not found"),
        ]
    ):
        capsys.readouterr()
        assert main([*base, *extra, "--run.name", f"r{i}"]) == 2
        err = capsys.readouterr().err
        assert expect in err and err.startswith("prime-train: "), err
        assert len(err.strip().splitlines()) == 1, err


def readme_commands(heading: str) -> list[str]:
    text = (REPO / "packages" / "prime-train" / "README.md").read_text()
    block = text.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_readme_interop_commands(tmp_path):
    """The README's interop commands, run as written (`uv run X` runs X from this venv) in a
    folder holding the repo's configs and a small parquet corpus in data/."""
    import shlex

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data").mkdir()
    for i in range(4):
        texts = [
            f"row {i}-{j}: " + "def f(x):\n    return x + 1\n" * (5 + j % 9) for j in range(200)
        ]
        pq.write_table(
            pa.table({"text": texts}), tmp_path / "data" / f"{i}.parquet", row_group_size=50
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    outputs = []
    for line in readme_commands("## Interop: Hugging Face models and datasets"):
        argv = shlex.split(line)
        assert argv[:2] == ["uv", "run"], line
        r = subprocess.run(
            argv[2:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, line + "\n" + r.stdout[-2000:] + r.stderr[-3000:]
        outputs.append(r.stdout)
    assert "done: 20/20 steps" in outputs[0]
    assert "exported step 20 (21 tensors)" in outputs[1]
    assert int(outputs[2].strip().splitlines()[-1]) > 400_000  # the debug model's 0.44M
    assert "done: 20/20 steps" in outputs[3] and (tmp_path / "runs/cont/ckpt").is_dir()
    assert "done: 20/20 steps" in outputs[4]


@pytest.mark.slow
def test_sharded_and_multi_node_checkpoints_export_the_same_model(exported, tmp_path):
    """init_from under torchrun with 2 ranks: each rank loads its FSDP2 shard, and the step-0
    checkpoint (2 shards) exports bit-identical to the source. Then 2 DiLoCo nodes: node 0's
    and node 1's checkpoints export the same (outer) weights."""
    from prime_testkit import free_port

    root, _, hf = exported
    corpus, tok = root / "corpus", root / "tokenizer.json"
    argv = tiny_run_args(tmp_path, tok, corpus, "ranks", 2, "--model.init_from", str(hf))
    argv += ["--data.heldout_fraction", "0.3"]  # held-out batches for 2 ranks
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "prime_train.cli"]
    r = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FSDP2 over 2 rank(s)" in r.stdout
    step0 = tmp_path / "ranks" / "ckpt" / "step-0000000000"
    assert (step0 / "rank-00001.bin").is_file()  # saved as 2 shards
    assert export(tmp_path / "ranks", "--step", "0", "--out", tmp_path / "from-2-ranks") == 0
    assert (tmp_path / "from-2-ranks" / "model.safetensors").read_bytes() == (
        hf / "model.safetensors"
    ).read_bytes()

    nodes = tiny_run_args(tmp_path, tok, corpus, "nodes", 4, "--diloco.inner_steps", "2")
    nodes[nodes.index("--launch.local_nodes") + 1] = "2"
    r = cli(*nodes)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for k in (0, 1):
        assert export(tmp_path / "nodes", "--node", k, "--out", tmp_path / f"node{k}") == 0
    a = (tmp_path / "node0" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "node1" / "model.safetensors").read_bytes()


@pytest.mark.slow  # two CLI nodes: the quick loop keeps its 10-minute budget
def test_every_node_writes_config_json_so_export_works_on_any_machine(tmp_path):
    """Two DiLoCo nodes, each in its own folder as on its own machine (no launcher): both run
    folders hold config.json, and `prime-train export` on either gives the same model."""
    from prime_mesh import Coordinator

    token = "every-node-config-token"
    coord = Coordinator("127.0.0.1", port=0, token=token, min_nodes=2).start()
    procs = []
    try:
        for k in range(2):
            argv = [
                sys.executable, "-m", "prime_train.cli", "--config", str(DEBUG),
                "--run.runs_dir", str(tmp_path / f"machine{k}" / "runs"),
                "--data.cache_dir", str(tmp_path / "cache"),
                "--data.path", "{stdlib}/[a-c]*.py", "--data.seq_len", "32",
                "--train.batch_size", "4", "--train.steps", "4", "--eval.batches", "1",
                "--diloco.inner_steps", "2", "--ckpt.every", "2", "--launch.local_nodes", "1",
                "--mesh.coordinator", coord.address, "--mesh.host", "127.0.0.1",
                "--mesh.node_name", f"machine{k}",
            ]  # fmt: skip
            env = {key: v for key, v in os.environ.items() if not key.startswith("PRIME_")}
            env.update(PRIME_TOKEN=token, OMP_NUM_THREADS="1")
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        outs = [p.communicate(timeout=280)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coord.close()
    for k, p in enumerate(procs):
        assert p.returncode == 0, outs[k][-3000:]
    models = []
    for k in range(2):
        run_dir = tmp_path / f"machine{k}" / "runs" / "debug"
        assert json.loads((run_dir / "config.json").read_text())["diloco"]["inner_steps"] == 2
        assert export(run_dir, "--out", tmp_path / f"hf{k}") == 0
        models.append((tmp_path / f"hf{k}" / "model.safetensors").read_bytes())
    assert models[0] == models[1]  # DiLoCo checkpoints hold the outer weights
