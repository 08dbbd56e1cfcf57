"""The run's configuration: typed pydantic sections, one per TOML table.

Every field has a default and a description; `prime-train --help` prints them. Sections
`[launch]`, `[mesh]` and `[diloco]` configure a multi-node (DiLoCo) run; a single node
without `mesh.coordinator` ignores them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

PRESETS = ("debug", "150M", "1B", "7B", "10B")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("default", description="run name; outputs go to RUNS_DIR/NAME")
    runs_dir: Path = Field(Path("runs"), description="folder holding one sub-folder per run")
    seed: int = Field(0, ge=0, description="seed for weights and data order")
    log_every: int = Field(10, ge=1, description="print and record a progress line every N steps")
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="also log metrics rows to 'tensorboard' (RUN_DIR/tensorboard) and/or 'wandb'",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError("use letters, digits, '.', '_' or '-' (it names a folder)")
        return v


class ModelConfig(Section):
    preset: Literal["debug", "150M", "1B", "7B", "10B"] = Field(
        "debug", description="model shape: debug, 150M, 1B, 7B or 10B (INTELLECT-1 family)"
    )
    dim: int | None = Field(None, ge=8, description="override the preset's width")
    n_layers: int | None = Field(None, ge=1, description="override the preset's depth")
    n_heads: int | None = Field(None, ge=1, description="override the preset's attention heads")
    n_kv_heads: int | None = Field(None, ge=1, description="override the preset's KV heads (GQA)")
    vocab_size: int | None = Field(
        None, ge=2, description="override the preset's vocabulary (debug: the tokenizer's)"
    )
    init_from: Path | None = Field(
        None,
        description="start from a Hugging Face Llama folder (config.json + safetensors); "
        "its config.json gives the shape",
    )


class DataConfig(Section):
    source: Literal["text", "parquet", "jsonl", "synthetic"] = Field(
        "text",
        description="'text' (each file matching data.path is a document), 'parquet' or 'jsonl' "
        "(one document per row, in data.text_field) or 'synthetic' random tokens",
    )
    path: str = Field(
        "{stdlib}/*.py",
        description="the corpus: a folder or a glob; '{stdlib}' is Python's standard library",
    )
    text_field: str = Field("text", description="parquet column / JSON field holding the text")
    workers: int | None = Field(
        None, ge=0, description="tokenizer processes per rank (default: the cores available)"
    )
    tokenizer: str = Field(
        "byte", description="'byte' (256 bytes + end-of-text) or a Hugging Face tokenizer.json"
    )
    seq_len: int = Field(128, ge=2, description="tokens per training sequence")
    slots: int = Field(
        64,
        ge=1,
        description="disjoint data slots the training sequences are cut into; each node reads "
        "its own slots, so a run never has more nodes than slots (part of the run's identity)",
    )
    heldout_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="share of documents held out for evaluation"
    )
    cache_dir: Path | None = Field(
        None, description="where tokenized files are cached (default RUNS_DIR/.token-cache)"
    )


class TrainConfig(Section):
    steps: int = Field(1000, ge=1, description="optimizer steps in the whole run")
    batch_size: int = Field(8, ge=1, description="sequences per rank per step")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="sequences per forward/backward: the step's batch is split into "
        "micro-batches whose gradients are summed (same math, less activation memory); must "
        "divide batch_size. Default: the whole batch at once",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' uses CUDA when present, else CPU"
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="'auto': bf16 mixed precision on CUDA, float32 on CPU"
    )
    grad_clip: float = Field(1.0, ge=0.0, description="max gradient norm (0 disables clipping)")
    activation_checkpointing: bool = Field(False, description="recompute blocks in backward")
    compile: bool = Field(False, description="torch.compile each transformer block")
    cpu_offload: bool = Field(False, description="FSDP2 CPU offload of parameters and grads")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")
    stop_within_s: float = Field(
        25.0,
        ge=0.0,
        description="a stop signal mid-round (a multi-node run): stop at the round's end if "
        "that comes within this many seconds, else leave the mesh at once and save the last "
        "committed outer step",
    )


class OptimConfig(Section):
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate of AdamW")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="'cosine', 'wsd' (warmup-stable-decay) or 'constant' after warmup"
    )
    warmup_steps: int = Field(100, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr as a share of lr")
    decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="wsd: share of steps spent decaying at the end"
    )


class EvalConfig(Section):
    every: int = Field(100, ge=0, description="held-out evaluation every N steps (0: only at end)")
    batches: int = Field(4, ge=1, description="held-out batches per evaluation")


class CkptConfig(Section):
    every: int = Field(100, ge=0, description="checkpoint every N steps (0: only when stopping)")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk")
    dir: Path | None = Field(None, description="checkpoint folder (default RUNS_DIR/NAME/ckpt)")
    shm_dir: Path | None = Field(None, description="RAM tier folder, e.g. /dev/shm/prime")
    remote: str | None = Field(None, description="fsspec URL for a remote copy (s3://...)")
    remote_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options for `remote` (e.g. endpoint_url); never saved to "
        "the run folder. Credentials are best left to the environment (AWS_ACCESS_KEY_ID, ...)",
    )


class LaunchConfig(Section):
    local_nodes: int = Field(
        1, ge=1, le=64, description="nodes simulated as local processes on this machine"
    )
    ranks_per_node: int = Field(
        1, ge=1, le=64, description="ranks (processes, FSDP2 shards) of each simulated node"
    )
    status_port: int | None = Field(
        None,
        ge=0,
        lt=65536,
        description="local launcher: serve the mesh status page on 127.0.0.1:PORT (0: a free one)",
    )


class MeshConfig(Section):
    coordinator: str | None = Field(None, description="HOST:PORT of the mesh coordinator")
    host: str | None = Field(
        None,
        description="address peers use to reach this node (default: the address of the "
        "interface that reaches the coordinator)",
    )
    serve_port: int = Field(
        0,
        ge=0,
        lt=65536,
        description="TCP port of the server sharing this node's checkpoints with joining "
        "peers (0: a free one; the local launcher's node K uses serve_port + K)",
    )
    serve_mbit: float = Field(
        500.0,
        ge=0.0,
        description="cap on the rate this node serves its checkpoints and update log to "
        "joiners, Mbit/s, all joiners together (0: no cap); default: half a 1 Gbit/s uplink, "
        "so a transfer never starves the members' all-reduce. Set it to about half your link",
    )
    fetch_mbit: float | None = Field(
        None,
        ge=0.0,
        description="cap on the rate a joiner fetches its snapshot while it listens, Mbit/s, "
        "from all donors together (0: no cap); default: 2 x serve_mbit, the whole link when "
        "serve_mbit is half of it. The fetch holds anyway while each round's all-reduce "
        "runs; set it lower to leave room for other traffic on the joiner's link",
    )
    node_name: str | None = Field(
        None,
        description="this node's name in the run, unique, the same across restarts (default: "
        "the host name plus '-K' for the local launcher's node K, else plus a short hash of "
        "the checkpoint folder); names its remote checkpoint prefix",
    )
    heartbeat_interval_s: float = Field(1.0, gt=0.0, description="seconds between heartbeats")
    heartbeat_timeout_s: float = Field(10.0, gt=0.0, description="silence before eviction")
    coordinator_grace_s: float = Field(
        120.0,
        ge=0.0,
        description="coordinator lost: seconds to retry its address at the next outer step "
        "before checkpointing the last committed outer step and exiting",
    )
    token: SecretStr | None = Field(
        None, description="shared secret; only from PRIME_TOKEN, never on the command line"
    )

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError("use letters, digits, '.', '_' or '-' (it names a folder)")
        return v

    @field_validator("coordinator")
    @classmethod
    def _hostport(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("write it as HOST:PORT, e.g. 10.0.0.1:29500")
        return v

    @model_validator(mode="after")
    def _timeouts(self) -> MeshConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "heartbeat_timeout_s must exceed heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        return self


class DilocoConfig(Section):
    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer steps")
    outer_lr: float = Field(0.7, gt=0.0, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer Nesterov momentum")
    compression: Literal["uint8", "uint4", "uint2", "none"] = Field(
        "uint8",
        description="pseudo-gradient all-reduce: 'uint8', 'uint4' or 'uint2' (8, 4 or 2 bits "
        "per element, blockwise codebooks) or 'none' (float32)",
    )
    error_feedback: bool = Field(
        False,
        description="carry what the compression took from this node's pseudo-gradient (its "
        "quantization residual) into the next round's; needs compression 'uint8', 'uint4' or "
        "'uint2'",
    )
    overlap: Literal["none", "delayed"] = Field(
        "none",
        description="'none': inner steps wait for each outer step; 'delayed': the all-reduce of "
        "round k runs in the background during round k+1 and its update is applied at the end "
        "of round k+1",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="F: streaming outer steps. The layers are split into F strided fragments "
        "(layer i in fragment i % F) and one fragment syncs every inner_steps / F steps, each "
        "sync its own outer step; every parameter still syncs once every inner_steps. With "
        "overlap = 'delayed' each fragment's all-reduce runs behind the inner_steps / F steps "
        "to the next fragment's sync point, where it is applied. 1: the whole model at once",
    )
    sync_timeout_s: float = Field(
        0.0,
        ge=0.0,
        description="once the first node reaches a sync point, seconds the others have to "
        "follow before they are left out of the round (evicted; they rejoin by themselves). "
        "0: auto, 4x the largest arrival spread of the last 8 sync points, within [30, 600] s",
    )
    round_seconds: float = Field(
        0.0,
        ge=0.0,
        description="T: each node runs inner steps until its round has lasted T seconds (at "
        "least min_inner_steps, at most inner_steps), then syncs; the average weights each "
        "node by the tokens it trained that round. 0: every round is inner_steps steps",
    )
    min_inner_steps: int = Field(
        1, ge=1, description="with round_seconds > 0: inner steps a node runs in every round"
    )
    max_missed_rounds: int = Field(
        3,
        ge=1,
        description="a node left out of this many rounds in a row (late at the sync point) "
        "exits 1; a round it contributed to resets the count",
    )
    max_rejoins: int = Field(
        3,
        ge=0,
        description="times a node that lost its membership (evicted: a cut link, a stall past "
        "the heartbeat timeout) rejoins the running job by itself before it exits 1",
    )
    rejoin_wait_s: float = Field(
        300.0, gt=0.0, description="how long such a node waits for the coordinator and members"
    )
    replay_rounds: int = Field(
        8,
        ge=0,
        description="K: committed updates (averaged pseudo-gradients) each node keeps on disk "
        "and serves, so a joiner whose checkpoint took up to K rounds to arrive replays them "
        "and enters (4 bytes per parameter each; 0: none, a late joiner takes a newer one)",
    )

    @model_validator(mode="after")
    def _feedback(self) -> DilocoConfig:
        if self.error_feedback and self.compression == "none":
            raise ValueError(
                "error_feedback = true needs a quantized compression ('uint8', 'uint4' or "
                "'uint2'): with 'none' nothing is lost to carry"
            )
        if self.fragments > 1 and self.inner_steps % self.fragments:
            raise ValueError(
                f"fragments = {self.fragments} must divide inner_steps = {self.inner_steps} "
                "(a fragment syncs every inner_steps / fragments inner steps)"
            )
        if self.fragments > 1 and self.round_seconds > 0:
            raise ValueError(
                f"fragments = {self.fragments} needs round_seconds = 0 (streaming fragments "
                "sync at fixed inner steps for now)"
            )
        if self.round_seconds > 0 and self.min_inner_steps > self.inner_steps:
            raise ValueError(
                f"min_inner_steps = {self.min_inner_steps} is more than inner_steps = "
                f"{self.inner_steps} (the most a round runs)"
            )
        return self


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    ckpt: CkptConfig = CkptConfig()
    launch: LaunchConfig = LaunchConfig()
    mesh: MeshConfig = MeshConfig()
    diloco: DilocoConfig = DilocoConfig()

    @property
    def run_dir(self) -> Path:
        return self.run.runs_dir / self.run.name

    def saved(self) -> dict[str, Any]:
        """The config as written into the run folder: JSON types, secrets left out."""
        d = self.model_dump(mode="json")
        d["mesh"].pop("token", None)
        d["ckpt"].pop("remote_options", None)  # may hold credentials
        return d

    def fingerprint(self) -> dict[str, Any]:
        """What must match to resume a run or train it together: everything but logging,
        where peers live and machine-local settings (folders, threads, device, remote URL and
        retention), so nodes on different machines, each with its own folders, agree."""
        d = self.saved()
        for section, keys in MACHINE_LOCAL.items():
            for key in keys:
                d[section].pop(key, None)
        d.pop("mesh")
        for section, key in UNSET_BY_DEFAULT:  # off: the hash of the runs made before it
            if d[section][key] is False:
                del d[section][key]
        if not self.diloco.round_seconds:  # fixed rounds: neither matters
            del d["diloco"]["round_seconds"], d["diloco"]["min_inner_steps"]
        if self.diloco.fragments == 1:  # the whole model at once: the hash of earlier runs
            del d["diloco"]["fragments"]
        if self.model.init_from is not None:  # the weights, wherever the folder lives
            from prime_train.hf_layout import weights_digest

            d["model"]["init_from"] = "sha256:" + weights_digest(self.model.init_from)
        return d

    def fingerprint_hash(self) -> str:
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# settings each machine may choose for itself: not part of the run's identity
MACHINE_LOCAL: dict[str, tuple[str, ...]] = {
    "run": ("log_every", "runs_dir", "trackers"),  # trackers: where a run is watched from
    "data": ("cache_dir", "workers"),  # workers: how fast tokens are made, not which
    "launch": ("status_port",),
    # micro_batch_size: memory, not the math; stop_within_s: a node's own patience
    "train": ("threads", "device", "micro_batch_size", "stop_within_s"),
    "ckpt": ("dir", "shm_dir", "remote", "keep"),
    # a node's own patience and disk, not the math
    "diloco": ("max_rejoins", "max_missed_rounds", "rejoin_wait_s", "replay_rounds"),
}

# settings added after runs existed: part of the hash only when on, so that leaving them off
# keeps every earlier run's hash (and its checkpoints resumable)
UNSET_BY_DEFAULT: tuple[tuple[str, str], ...] = (("diloco", "error_feedback"),)

SECTIONS: dict[str, type[Section]] = {
    name: info.annotation  # type: ignore[misc]
    for name, info in Config.model_fields.items()
}
SECRET_KEYS = {("mesh", "token")}
