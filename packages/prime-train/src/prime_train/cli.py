"""`prime-train`: train a model (DiLoCo across nodes; FSDP2 inside a node).

Usage:
  prime-train --config FILE.toml [--section.key VALUE ...]
  prime-train plot RUN_DIR [RUN_DIR ...] [--out FILE.png]
  prime-train export RUN_DIR [--step N] [--node K] --out DIR   (a Hugging Face Llama folder)

Settings come from, highest first: command-line overrides (--train.steps 20), environment
variables PRIME_SECTION__KEY (PRIME_TRAIN__STEPS=20), the TOML file, then the defaults below.
The shared secret is read from PRIME_TOKEN only. Re-running the same command resumes the run
from its newest checkpoint; Ctrl-C or SIGTERM finishes the step, checkpoints and exits 0.
SIGUSR1 prints every thread's stack to stderr and goes on (`kill -USR1 PID`: where a process
that does not end is waiting).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from prime_train.config_load import describe_fields, load_config
from prime_train.errors import ConfigError
from prime_train.host_memory import return_freed_memory

if TYPE_CHECKING:
    from prime_train.config import Config


def _fail(msg: str) -> int:
    print(f"prime-train: {msg}", file=sys.stderr)
    return 2


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="prime-train plot",
        description="Draw every node's loss into a PNG, marking outer steps where membership "
        "changed. Give one run folder, or one per machine (each node has its own there).",
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR",
                        help="run folder(s), e.g. runs/debug")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="PNG path (default FIRST_RUN_DIR/loss.png)"
    )
    args = parser.parse_args(argv)
    from prime_train.plot import node_files, plot_runs

    for run_dir in args.run_dirs:
        if not node_files(run_dir):
            return _fail(f"{run_dir} has no metrics.jsonl; pass a run folder such as runs/debug")
    try:
        out = plot_runs(args.run_dirs, args.out)
    except (FileNotFoundError, OSError) as e:
        return _fail(f"cannot plot {' '.join(map(str, args.run_dirs))}: {e}")
    print(f"wrote {out}")
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="prime-train export",
        description="Write a checkpoint's weights as a Hugging Face Llama folder "
        "(config.json, safetensors, tokenizer files) that transformers loads.",
    )
    parser.add_argument("run_dir", type=Path, help="a run folder, e.g. runs/debug")
    parser.add_argument("--out", type=Path, required=True, help="new folder to write")
    parser.add_argument("--step", type=int, default=None, help="default: newest that verifies")
    parser.add_argument("--node", type=int, default=0, help="whose checkpoint (DiLoCo node)")
    parser.add_argument(
        "--max-shard-size", default="2GiB", help="split safetensors above this (e.g. 500MB)"
    )
    args = parser.parse_args(argv)
    from prime_ckpt import CheckpointError
    from prime_train.hf_export import ExportError, export_hf, parse_size
    from prime_train.tokens import DataError

    try:
        limit = parse_size(args.max_shard_size)
    except ValueError:
        return _fail(f"--max-shard-size {args.max_shard_size!r}: write e.g. 2GiB or 500MB")
    try:
        done = export_hf(args.run_dir, args.out, args.step, args.node, limit)
    except (ExportError, ConfigError, DataError, CheckpointError) as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot export {args.run_dir}: {e}")
    print(
        f"exported step {done.step} ({done.tensors} tensors) to {done.out}: "
        + ", ".join(done.files)
    )
    return 0


def _exit_0_on_a_stop_while_starting() -> None:
    """Until the trainer takes over the signals (prime_train.stop), a stop while the heavy
    modules load has nothing to save: exit 0 as a stop does, not by the signal."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stopped_while_starting)


def _stopped_while_starting(signum: int, _frame: object) -> None:
    print(f"prime-train: {signal.Signals(signum).name} received while starting: nothing to "
          "save yet. Rerun the same command to start again", file=sys.stderr)  # fmt: skip
    raise SystemExit(0)


def _stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's stack to the process's own stderr (fd 2) and goes on:
    where a process that does not end waits."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no stderr file descriptor: nowhere to print
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _stacks_on_sigusr1()
    return_freed_memory()  # before the model's first allocation
    if argv[:1] == ["plot"]:
        return _plot(argv[1:])
    if argv[:1] == ["export"]:
        return _export(argv[1:])
    parser = argparse.ArgumentParser(
        prog="prime-train",
        description=__doc__,
        epilog="Settings (TOML table and key; --section.key VALUE on the command line):\n"
        + describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="path to a TOML config (see configs/)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        return _fail(f"config error: {e}")

    from prime_train.placement import launcher_index, pick_device

    try:  # before any node starts or joins a mesh
        pick_device(cfg.train.device)
        if cfg.mesh.coordinator and cfg.mesh.host:
            from prime_train.diloco.membership import node_address

            node_address(cfg)  # a loopback --mesh.host for a coordinator elsewhere
    except ConfigError as e:
        return _fail(f"config error: {e}")

    launched = launcher_index() is not None or "LOCAL_RANK" in os.environ  # launcher, torchrun
    several = cfg.launch.local_nodes > 1 or cfg.launch.ranks_per_node > 1
    if several and not launched and not cfg.mesh.coordinator:
        return _launch_local(cfg, argv)
    return _train(cfg)


def _launch_local(cfg: Config, argv: list[str]) -> int:
    """Simulate the run's nodes as local processes (`[launch]`), with a local coordinator."""
    from prime_mesh import MeshError
    from prime_train.launch import launch_local_nodes
    from prime_train.local_coordinator import local_coordinator
    from prime_train.preflight import check_settings
    from prime_train.tokens import DataError

    try:
        check_settings(cfg)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    except DataError as e:
        return _fail(str(e))

    coordinator = partial(local_coordinator, status_port=cfg.launch.status_port)
    try:
        return launch_local_nodes(
            argv, cfg.launch.local_nodes, coordinator, ranks_per_node=cfg.launch.ranks_per_node
        )
    except (MeshError, OSError) as e:  # the status page: extra missing, port taken
        return _fail(str(e))


def _train(cfg: Config) -> int:
    """This process's node (or local rank): train, and say how it ended in one line."""
    _exit_0_on_a_stop_while_starting()
    from prime_mesh import MeshError, RunCompleted
    from prime_train.diloco import OuterStepFailed
    from prime_train.rundir import RunDirError
    from prime_train.stop import StoppedEarly
    from prime_train.tokens import DataError
    from prime_train.trainer import train

    try:
        summary = train(cfg)
    except ConfigError as e:  # settings that only show as wrong once combined (shape, device)
        return _fail(f"config error: {e}")
    except (RunDirError, DataError) as e:
        return _fail(str(e))
    except RunCompleted as e:  # nothing left to do: not a failure
        print(f"prime-train: {e}; nothing to do", file=sys.stderr)
        return 0
    except StoppedEarly as e:  # asked to stop: done, with nothing to save
        print(f"prime-train: {e}: nothing of this node's to save (its last checkpoint, if "
              "any, stands); it left the mesh. Rerun the same command to start again",
              file=sys.stderr)  # fmt: skip
        return 0
    except (MeshError, OuterStepFailed) as e:
        print(f"prime-train: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0 if summary is not None else 1


if __name__ == "__main__":
    sys.exit(main())
