"""Checkpoints carry their run's identity: a folder or remote prefix holding another run's
checkpoints is refused at start (nothing loaded, nothing pruned), and `ckpt.keep` holds on the
disk and remote tiers."""

from pathlib import Path

import pytest

from prime_ckpt import committed_steps


def short(tiny_cli_args, runs: Path, *extra: str) -> list[str]:
    return tiny_cli_args(
        runs, "--train.steps", "10", "--train.batch_size", "4", "--ckpt.every", "2",
        "--ckpt.keep", "2", "--eval.every", "0", *extra,
    )  # fmt: skip


@pytest.mark.slow
def test_a_checkpoint_folder_of_another_run_is_refused(tmp_path, run_cli, tiny_cli_args):
    shared = tmp_path / "shared-ckpt"
    a = run_cli(*short(tiny_cli_args, tmp_path / "a", "--run.name", "a", "--ckpt.dir", shared))
    assert a.returncode == 0, a.stderr[-2000:]
    assert committed_steps(shared) == [8, 10]  # keep = 2

    # another run name in the same checkpoint folder: refused, with what it holds and the fix
    b = run_cli(*short(tiny_cli_args, tmp_path / "b", "--run.name", "b", "--ckpt.dir", shared))
    assert b.returncode == 2, b.stdout[-2000:] + b.stderr[-2000:]
    msg = b.stderr
    assert "Traceback" not in msg
    assert f"{shared} holds checkpoints of another run" in msg and "run 'a'" in msg, msg
    assert "this run is 'b'" in msg and "move" in msg and "ckpt.dir" in msg, msg
    # the same name with another config (here the length of the run) is another run too
    c = run_cli(
        *short(tiny_cli_args, tmp_path / "c", "--run.name", "a", "--ckpt.dir", shared),
        "--train.steps", "12",
    )  # fmt: skip
    assert c.returncode == 2 and "holds checkpoints of another run" in c.stderr, c.stderr[-2000:]
    assert committed_steps(shared) == [8, 10], "a refused run touched the folder"

    # the same run from another runs folder (a new machine sharing the folder) resumes it
    d = run_cli(*short(tiny_cli_args, tmp_path / "d", "--run.name", "a", "--ckpt.dir", shared))
    assert d.returncode == 0, d.stderr[-2000:]
    assert "resumed from the step-10 checkpoint" in d.stdout


@pytest.mark.slow
def test_remote_prefix_keeps_ckpt_keep_and_refuses_another_run(tmp_path, run_cli, tiny_cli_args):
    remote = f"file://{tmp_path / 'bucket'}"
    prefix = tmp_path / "bucket" / "n1"  # ckpt.remote + '/' + node name
    common = ("--ckpt.remote", remote, "--mesh.node_name", "n1", "--run.name", "a")
    a = run_cli(*short(tiny_cli_args, tmp_path / "a", *common))
    assert a.returncode == 0, a.stderr[-2000:]
    assert committed_steps(tmp_path / "a" / "a" / "ckpt") == [8, 10]
    assert committed_steps(prefix) == [8, 10], "the remote tier ignores ckpt.keep"
    assert sorted(p.name for p in (tmp_path / "bucket").iterdir()) == ["n1"]

    # another run naming the same remote prefix, on an empty disk: refused
    b = run_cli(*short(tiny_cli_args, tmp_path / "b", *common, "--run.name", "b"))
    assert b.returncode == 2, b.stdout[-2000:] + b.stderr[-2000:]
    assert f"{remote}/n1 holds checkpoints of another run" in b.stderr, b.stderr
    assert "run 'a'" in b.stderr and "ckpt.remote" in b.stderr
    assert committed_steps(prefix) == [8, 10]

    # the same run on an empty disk (a new machine) resumes from the remote copy
    d = run_cli(*short(tiny_cli_args, tmp_path / "d", *common))
    assert d.returncode == 0, d.stderr[-2000:]
    assert "resumed from the step-10 checkpoint" in d.stdout

    # under another node name, its own prefix is empty: it starts afresh, and says where the
    # checkpoints of the other names are
    e = run_cli(*short(tiny_cli_args, tmp_path / "e", *common, "--mesh.node_name", "n2"))
    assert e.returncode == 0, e.stderr[-2000:]
    assert "no checkpoint of node 'n2' in any tier" in e.stdout and "holds ['n1']" in e.stdout
    assert "resumed" not in e.stdout


def test_default_node_names_are_unique_on_a_machine_and_survive_restarts(tmp_path):
    """Without --mesh.node_name: the host name plus a hash of the checkpoint folder (nodes
    started by hand on one machine each have their own), or plus -K for the launcher's node K;
    names the coordinator and MeshConfig both accept."""
    import socket

    from prime_mesh.address import check_name
    from prime_train.config import MeshConfig
    from prime_train.placement import default_node_name

    a = default_node_name(tmp_path / "a" / "runs" / "debug" / "ckpt", None)
    assert a == default_node_name(tmp_path / "a" / "runs" / "debug" / "ckpt", None)  # restart
    assert a != default_node_name(tmp_path / "b" / "runs" / "debug" / "ckpt", None)
    assert a.startswith(socket.gethostname() + "-")
    assert default_node_name(tmp_path / "c", 3) == f"{socket.gethostname()}-3"
    assert check_name(a) == MeshConfig(node_name=a).node_name == a
