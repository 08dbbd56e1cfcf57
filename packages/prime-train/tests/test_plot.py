"""`prime-train plot` over several run folders (one per machine), with membership changes."""

import json
import subprocess
import sys
from pathlib import Path

from prime_train.plot import membership_changes, node_files


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_metrics(shift: float, epochs: list[tuple[int, int]]) -> list[dict]:
    """The metrics rows of a node whose outer step k had epochs[k-1] = (epoch, members)."""
    rows = [{"step": 0, "eval_loss": 5.5}]
    for k, (epoch, nodes) in enumerate(epochs, start=1):
        step = 20 * k
        rows.append({"step": step - 10, "loss": 5 - k * 0.4 + shift})
        rows.append({"step": step, "outer_step": k, "nodes": nodes, "epoch": epoch})
        rows.append({"step": step, "loss": 5 - k * 0.5 + shift})
        rows.append({"step": step, "eval_loss": 5.2 - k * 0.5})
    return rows


def test_plot_several_run_folders_marks_membership_changes(tmp_path):
    # machine a: node 0 throughout; node 1 died after outer step 2, a new node joined at 4
    a, b = tmp_path / "a" / "debug", tmp_path / "b" / "debug"
    epochs0 = [(1, 2), (1, 2), (2, 1), (3, 2), (3, 2)]
    write_rows(a / "metrics.jsonl", fake_metrics(0.0, epochs0))
    write_rows(b / "metrics-node1.jsonl", fake_metrics(0.1, [(1, 2), (1, 2)]))
    write_rows(b / "metrics-node2.jsonl", fake_metrics(0.2, [(3, 2), (3, 2)])[2:])
    assert membership_changes(fake_metrics(0, epochs0)) == [(60, 2, 1), (80, 3, 2)]
    assert [label for label, _ in node_files(b)] == ["node 1", "node 2"]
    out = tmp_path / "loss.png"
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", "plot", str(a), str(b), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}" and out.stat().st_size > 10_000


def test_plot_refuses_a_folder_without_metrics(tmp_path):
    write_rows(tmp_path / "a" / "metrics.jsonl", fake_metrics(0.0, [(1, 1)]))
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", "plot", str(tmp_path / "a"),
         str(tmp_path / "empty")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"prime-train: {tmp_path / 'empty'} has no metrics.jsonl; pass a run folder such as "
        "runs/debug"
    )
