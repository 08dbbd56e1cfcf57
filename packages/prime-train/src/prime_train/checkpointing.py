"""The trainer's checkpoint state, saved and loaded through prime_ckpt.CheckpointManager.

prime-train owns only *what* goes into a checkpoint (model shards, optimizer, data position,
progress, RNG) as one nested dict; prime-ckpt owns the format, tiers and integrity.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prime_ckpt import TIERS, CheckpointFailure, CheckpointManager, SaveHandle
from prime_train.rundir import RunDirError


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter tensors keyed by parameter name (stable across runs)."""
    missing = [name for name, p in model.named_parameters() if p not in opt.state]
    if missing:
        # e.g. FSDP2 left parameters gathered after a forward without backward
        raise RuntimeError(f"parameters without optimizer state: {missing[:3]}; reshard first")
    return {name: opt.state[p] for name, p in model.named_parameters()}


STEPPED = ("model", "optim")  # the keys of `train_state` whose tensors an optimizer step changes
EXIT_S = 6.0  # after the final upload's wait: the mesh's leave, the process's teardown (4 s seen)


def train_state(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: dict[str, Any],
    progress: dict[str, Any],
) -> dict[str, Any]:
    """Everything a resumed run needs, as tensors to fill in place and plain values."""
    state: dict[str, Any] = {
        "model": dict(model.named_parameters()),
        "optim": optimizer_state(model, opt),
        "data": dict(data),
        "progress": dict(progress),
        "rng": {"torch": torch.get_rng_state()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])


class Checkpointer:
    """Saves every `every` steps (0: only on request) and resumes from the newest one.

    Every checkpoint carries `identity` (the run's name and config hash) in its manifest;
    `check_owner()` refuses folders and remote prefixes holding another run's checkpoints.
    `keep` checkpoints are kept on disk and in the remote store. `ram` ("shm", "disk", "off")
    is where a checkpoint is staged (`ckpt.ram`, prime_ckpt's `CheckpointManager(ram=)`);
    `disk_timeout_s` bounds every wait on a disk write (`ckpt.disk_timeout_s`).

    A save or upload that fails in the background does not stop training: prime_ckpt says
    it in one line (its `prime_ckpt` logger, printed as a line of the node's log by
    `metrics.LogLines`) and `errors` counts it (the metrics rows' `ckpt_errors`)."""

    def __init__(
        self,
        disk_dir: Path,
        every: int,
        keep: int,
        shm_dir: Path | None = None,
        remote: str | None = None,
        group: dist.ProcessGroup | None = None,
        remote_options: dict[str, Any] | None = None,
        identity: dict[str, str] | None = None,
        upload_timeout_s: float | None = None,
        ram: str = "shm",
        disk_timeout_s: float = 600.0,
    ):
        self.disk_dir, self.every, self.remote = disk_dir, every, remote
        self.upload_timeout_s = upload_timeout_s
        self.identity = dict(identity or {})
        self.manager = CheckpointManager(
            disk_dir,
            shm_dir=shm_dir,
            remote=remote,
            remote_options=remote_options or None,
            keep={"disk": keep, "remote": keep},
            group=group,
            on_error=self._failed,
            ram=ram,
            disk_timeout=disk_timeout_s,
        )
        self.last_saved: int | None = None
        self._last: SaveHandle | None = None
        self._on_disk: int | None = None  # `newest_on_disk`'s last answer
        self._disk_listed = False  # whether `_on_disk` was read from the folder yet
        self._leave_by: float | None = None  # a stop's deadline for the way out (`leave_by`)
        # the loop's time in save() and waiting for its copies, and the saves (metrics rows)
        self.blocked_s, self.saves = 0.0, 0

    @property
    def errors(self) -> int:
        """Checkpoint saves (disk) and uploads (remote) that failed so far."""
        return self.manager.errors

    def _failed(self, failure: CheckpointFailure) -> None:
        """Told by the manager's background thread: already logged and counted there, so
        neither `wait()` nor the next `save()` raises or warns about it again."""

    def check_owner(self) -> None:
        """RunDirError if any tier holds a checkpoint of another run (another name or config
        hash, or none: another program's): loading it, or letting retention prune this run's
        new steps in favour of its higher-numbered ones, would mix two runs."""
        for c in self.manager.list():
            if c.status != "ok" or not self.identity:
                continue
            held = {k: c.metadata.get(k) for k in self.identity}
            if held == self.identity:
                continue
            where = self.remote if c.tier == "remote" else str(self.disk_dir)
            if held.get("config_hash") is None:
                whose = "no run identity: made by another program or an older prime-train"
            else:
                whose = f"run {held.get('run')!r}, config hash {held.get('config_hash')}"
            raise RunDirError(
                f"{where} holds checkpoints of another run (step {c.step}, {whose}); this run "
                f"is {self.identity.get('run')!r} with config hash "
                f"{self.identity.get('config_hash')}. To resume that run, rerun with its "
                f"config; to start this one, move {where} aside or point ckpt.dir / "
                "ckpt.remote elsewhere (or use another --run.name)"
            )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Returns at once: the copy into RAM, then to disk and remote, is made in the
        background; `wait_staged()` before the state's tensors change."""
        if self.last_saved == step:
            return
        t0 = time.perf_counter()
        self._last = self.manager.save(
            step, state, metadata=self.identity, stage_in_background=True
        )
        self.last_saved, self.saves = step, self.saves + 1
        self.blocked_s += time.perf_counter() - t0

    def wait_staged(self, keys: tuple[str, ...] | None = None) -> float:
        """Block until the last save copied the state, or the tensors under its top-level
        `keys` (a load waits by itself); returns the seconds waited."""
        t0 = time.perf_counter()
        self.manager.wait_staged(keys)
        waited = time.perf_counter() - t0
        self.blocked_s += waited
        return waited

    def load_latest(self, state: dict[str, Any]) -> int | None:
        step = self.manager.load_latest(state, strict=True)
        if step is not None:
            self.last_saved = step
        return step

    def load(self, step: int, state: dict[str, Any]) -> None:
        self.manager.load(step, state, strict=True)
        self.last_saved = step

    def discard_after(self, step: int) -> list[int]:
        """Remove this node's checkpoints newer than the step the run resumed from (0: a fresh
        start) from every tier, so that retention keeps the steps the run makes next."""
        self._disk_listed = False
        return self.manager.discard_after(step)

    def wait(self) -> None:
        """Block until the last save ended (a failure was said in the log and counted)."""
        self.manager.wait()

    def wait_durable(self) -> None:
        """Block until the last save is on disk; CheckpointError if it failed."""
        if self._last is not None:
            self._last.wait()

    def committed_steps(self, local: bool = False) -> list[int]:
        """Steps this rank holds committed in RAM, on disk or in the remote store (each copy is
        verified when loaded, and a bad one falls back to the next tier); `local`: in RAM or
        on disk only (no listing of the remote, which may hang for its whole bound)."""
        return self.manager.committed_steps(("ram", "disk") if local else TIERS)

    @property
    def remote_unreachable(self) -> str | None:
        """Why the remote's listing fails at once for now (it hung or failed a moment ago), or
        None (see prime-ckpt's `CheckpointManager.remote_unreachable`)."""
        return self.manager.remote_unreachable

    def newest_on_disk(self) -> int | None:
        """The newest step this rank holds committed on disk (None: none). Asked at every
        progress row: the folder is listed once, then again only while the last save may not
        be there (nothing else of this process changes it but `discard_after`)."""
        newest = -1 if self._on_disk is None else self._on_disk
        behind = self.last_saved is not None and newest < self.last_saved
        if not self._disk_listed or behind:
            steps = self.manager.committed_steps(("disk",))
            self._on_disk, self._disk_listed = (steps[-1] if steps else None), True
        return self._on_disk

    def leave_by(self, deadline: float) -> None:
        """A stop signal came: `close()` waits for the final upload only until `deadline`
        (time.monotonic(); less `EXIT_S` for what follows it), within `upload_timeout_s`, so a
        slow or unreachable remote cannot hold the node past its stop bound."""
        self._leave_by = deadline

    def close(self) -> None:
        """The final checkpoint reaches disk; its upload is waited for `upload_timeout_s` at
        most, and only until `leave_by`'s deadline after a stop (the next start finishes it)."""
        wait = self.upload_timeout_s
        if self._leave_by is not None:
            left = max(0.0, self._leave_by - EXIT_S - time.monotonic())
            wait = left if wait is None else min(wait, left)
        self.manager.close(remote_timeout=wait)


def checkpoint_dir(cfg, launcher_index: int | None) -> Path:
    """Where this node keeps its checkpoints. Nodes simulated on one machine (`launcher_index`
    from the local launcher) each get their own folder; a node on its own machine uses `ckpt/`."""
    if cfg.ckpt.dir is not None:
        return cfg.ckpt.dir / f"node{launcher_index}" if launcher_index else cfg.ckpt.dir
    return cfg.run_dir / ("ckpt" if not launcher_index else f"ckpt-node{launcher_index}")


def remote_prefix(cfg, node_name: str) -> str | None:
    """This node's remote checkpoint URL: `ckpt.remote` + '/' + the node's name, so nodes
    sharing one bucket never touch each other's uploads."""
    if cfg.ckpt.remote is None:
        return None
    return f"{cfg.ckpt.remote.rstrip('/')}/{node_name}"


HINT_LIST_TIMEOUT_S = 10.0  # a hint's listing: a remote that hangs must not hold the start


def other_node_prefixes(cfg, node_name: str) -> list[str]:
    """The names under `ckpt.remote` other than this node's (best effort: [] if unlistable
    within `HINT_LIST_TIMEOUT_S`), to tell a node restarted under a new name where its
    checkpoints may be."""
    import fsspec

    from prime_ckpt.bounded import bounded

    def names_under() -> list[str]:
        fs, root = fsspec.core.url_to_fs(cfg.ckpt.remote, **cfg.ckpt.remote_options)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]

    try:
        names = bounded(names_under, HINT_LIST_TIMEOUT_S, f"listing {cfg.ckpt.remote}")
    except Exception:  # missing root, no credentials yet, no answer: nothing to say
        return []
    return sorted(n for n in names if n != node_name)


def remote_hint(cfg, node_name: str, ckpt: Checkpointer) -> str | None:
    """A warning for a node that holds no checkpoint in any tier while `ckpt.remote` holds
    other nodes' (a node restarted on a new machine under a new name), or None. A remote
    whose own listing just hung or failed is not listed again for it."""
    if cfg.ckpt.remote is None or ckpt.committed_steps() or ckpt.remote_unreachable:
        return None
    others = other_node_prefixes(cfg, node_name)
    if not others:
        return None
    return (
        f"no checkpoint of node {node_name!r} in any tier, but {cfg.ckpt.remote} holds "
        f"{others}: a node restarted on a new machine finds its checkpoints only under its "
        "former --mesh.node_name"
    )
