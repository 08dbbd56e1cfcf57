"""The run folder: one per run name, holding its config, metrics, checkpoints and plot.

A folder made by a run with a different config is refused (never overwritten), so re-running
the same command resumes while a changed command cannot silently mix two runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prime_train.config import Config
from prime_train.files import write_atomic

CONFIG_FILE = "config.json"
# what identifies the run, as computed when it started: with model.init_from it holds the
# digest of the weights then, so changed weights under the same path are caught
FINGERPRINT_FILE = "fingerprint.json"


class RunDirError(ValueError):
    """The run folder belongs to another config (or cannot be used)."""


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def claim_run_dir(cfg: Config, write: bool) -> Path:
    """Check RUNS_DIR/NAME is free or holds this same config; record the config if `write`."""
    run_dir = cfg.run_dir
    saved = run_dir / CONFIG_FILE
    if saved.is_file():
        try:
            old = json.loads(saved.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunDirError(f"{saved} is unreadable ({e}); move the folder aside") from None
        try:
            recorded = run_dir / FINGERPRINT_FILE
            if recorded.is_file():
                old_fp = json.loads(recorded.read_text())
            else:
                old_fp = Config.model_validate(old).fingerprint()
        except ValueError:
            raise RunDirError(
                f"{saved} was written by another version of prime-train; use another --run.name"
            ) from None
        changes = _diff(old_fp, cfg.fingerprint())
        if changes:
            shown = "; ".join(changes[:3]) + (
                f"; +{len(changes) - 3} more" if len(changes) > 3 else ""
            )
            raise RunDirError(
                f"{run_dir} holds a run with a different config ({shown}). "
                f"Use another --run.name, or delete {run_dir} to start over."
            )
        return run_dir
    if write:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / FINGERPRINT_FILE, json.dumps(cfg.fingerprint()) + "\n")
            write_atomic(saved, json.dumps(cfg.saved(), indent=2) + "\n")
        except OSError as e:
            raise RunDirError(f"cannot create run folder {run_dir}: {e.strerror}") from None
    return run_dir
