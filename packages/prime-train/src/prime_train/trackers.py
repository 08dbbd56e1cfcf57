"""`[run] trackers`: the same metrics rows in TensorBoard event files and Weights & Biases.

Only the mesh's first member logs (so a run is one curve, not one per node); when it leaves,
the next first member picks up, writing under the same W&B run id and TensorBoard folder.
The config goes in as hyperparameters. W&B honours its own environment (WANDB_MODE=offline
logs without network; `wandb sync` uploads later).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prime_train.config import Config
from prime_train.errors import ConfigError
from prime_train.metrics import Log

_SKIP = {"step", "time", "outer_sha256"}


def flat_config(cfg: Config) -> dict[str, str | int | float | bool]:
    """The config as `section.key` -> a plain value (others as JSON text), for hparams."""
    out: dict[str, str | int | float | bool] = {}
    for section, values in cfg.saved().items():
        for key, value in values.items():
            plain = isinstance(value, str | int | float | bool)
            out[f"{section}.{key}"] = value if plain else json.dumps(value)
    return out


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k not in _SKIP and isinstance(v, int | float) and not isinstance(v, bool)
    }


class Trackers:
    """A metrics sink for TensorBoard and/or W&B, opened the first time this node leads."""

    def __init__(
        self, cfg: Config, run_dir: Path, leader: Callable[[], bool], log: Log, node: int = 0
    ) -> None:
        self.cfg, self.run_dir, self.leader, self.log, self.node = cfg, run_dir, leader, log, node
        self._tb: Any = None
        self._wandb: Any = None
        self._opened = False
        for name in cfg.run.trackers:  # a missing package is a user mistake: say so up front
            module = {"tensorboard": "tensorboard", "wandb": "wandb"}[name]
            try:
                __import__(module)
            except ImportError:
                raise ConfigError(
                    f"run.trackers includes {name!r} but {module} is not installed: "
                    "pip install 'prime-train[trackers]'"
                ) from None

    def _open(self) -> None:
        self._opened = True
        cfg = self.cfg
        hparams = flat_config(cfg)
        if "tensorboard" in cfg.run.trackers:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams as hparams_summary

            self._tb = SummaryWriter(
                str(self.run_dir / "tensorboard"), filename_suffix=f".node{self.node}"
            )
            for summary in hparams_summary(hparams, {}):
                self._tb.file_writer.add_summary(summary)
            self._tb.add_text("config", f"```\n{json.dumps(cfg.saved(), indent=2)}\n```")
        if "wandb" in cfg.run.trackers:
            import wandb

            # one id for the run on every node, so a new first member continues the same run
            run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{cfg.run.name}-{cfg.fingerprint_hash()}")
            self._wandb = wandb.init(
                project="prime",
                name=cfg.run.name,
                id=run_id,
                resume="allow",
                dir=str(self.run_dir),
                config=cfg.saved(),
                settings=wandb.Settings(silent=True, console="off"),
            )
            self._wandb.define_metric("step")
            self._wandb.define_metric("*", step_metric="step")
        self.log.info(
            f"logging metrics to {' and '.join(cfg.run.trackers)} as the mesh's first member"
        )

    def write(self, record: dict[str, Any]) -> None:
        if not self.leader():
            return
        if not self._opened:
            self._open()
        step, values = int(record.get("step", 0)), _scalars(record)
        if not values:
            return
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**values, "step": step})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
