"""The run's configuration: typed pydantic sections, one per TOML table.

Every field has a default and a description; `prime-train --help` prints them. Sections
`[launch]`, `[mesh]` and `[diloco]` configure a multi-node (DiLoCo) run (they are defined in
`prime_train.config_multinode` and importable from here); a single node without
`mesh.coordinator` ignores them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_train.config_multinode import DilocoConfig, LaunchConfig, MeshConfig
from prime_train.config_section import Section, check_folder_name

PRESETS = ("debug", "150M", "1B", "7B", "10B")


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
        return check_folder_name(v)


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
    ram: Literal["shm", "disk", "off"] = Field(
        "shm",
        description="where a checkpoint is staged before it is written to disk: 'shm' (the RAM "
        "tier, one checkpoint in /dev/shm, 20 B/param of a DiLoCo node), 'disk' (the same "
        "staging slot in a folder on disk, ckpt/.staging-rN or shm_dir: no RAM, a slower save) "
        "or 'off' (no staging copy: each save writes straight to disk while the loop waits)",
    )
    shm_dir: Path | None = Field(
        None, description="staging folder (default: one in /dev/shm, or in ckpt/ with ram='disk')"
    )
    remote: str | None = Field(None, description="fsspec URL for a remote copy (s3://...)")
    upload_timeout_s: float = Field(
        60.0,
        gt=0,
        description="on the way out, the longest the final checkpoint's upload is waited for "
        "(it is on disk by then; the next start finishes the upload)",
    )
    disk_timeout_s: float = Field(
        600.0,
        gt=0,
        description="the longest a checkpoint's disk write is waited for (by the next save, "
        "and on the way out) and may make no progress; past it that save is said and counted "
        "as failed and the node goes on (a hung disk or NFS mount never hangs the node)",
    )
    remote_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options for `remote` (e.g. endpoint_url); never saved to "
        "the run folder. Credentials are best left to the environment (AWS_ACCESS_KEY_ID, ...)",
    )

    @model_validator(mode="after")
    def _staging(self) -> CkptConfig:
        if self.ram == "off" and self.shm_dir is not None:
            raise ValueError(
                f"shm_dir = {str(self.shm_dir)!r} has no use with ram = 'off' (nothing is "
                "staged); leave shm_dir out, or use ram = 'disk' to stage in that folder"
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
    # ram: where this machine stages a checkpoint (its memory), not what is saved
    "ckpt": (
        "dir",
        "shm_dir",
        "ram",
        "remote",
        "keep",
        "upload_timeout_s",
        "disk_timeout_s",
    ),
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
