"""The root README's "Across machines" commands, run as written on the WAN bed.

The coordinator's command runs in one network namespace, the node command (torchrun, 2 ranks
per machine) in two others as machines `dc1-a` and `dc1-b`, no `--mesh.host` given; the
README's addresses, config, rank count, node count and bucket are substituted, and the test
adds a small run (debug model on a few files, an outer step every 25 steps), which it stops
with SIGTERM once it has seen what it checks. While it trains: `prime-mesh status`
shows the names, each node's checkpoint server advertises the node's own address (not
127.0.0.1), nothing listens outside the README's port table, and a third machine started
under `dc1-a`'s name is refused with one clear line.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prime_netbed import WanBed, bed_unavailable_reason

from prime_testkit import wait_until
from prime_train.metrics import read_metrics

pytestmark = [
    pytest.mark.wan,
    pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason())),
]
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # what `uv run` runs: the workspace's environment
TOKEN = "readme-machines-token"
COORD, MACHINES, TWIN = 0, (1, 2), 3  # namespaces of the bed
NAMES = {1: "dc1-a", 2: "dc1-b"}
STEPS, H = 5000, 25  # stopped by the test once it has seen what it checks
SHORT = [
    "--data.path", "{stdlib}/[a-c]*.py", "--data.seq_len", "64", "--train.batch_size", "4",
    "--train.steps", str(STEPS), "--diloco.inner_steps", str(H), "--ckpt.every", str(H),
    "--eval.every", "0", "--run.log_every", "5",
    "--mesh.heartbeat_interval_s", "0.5", "--mesh.heartbeat_timeout_s", "3",
]  # fmt: skip


def readme_commands() -> tuple[str, str]:
    """The coordinator's and a machine's command, from the README's block under the heading."""
    section = (ROOT / "README.md").read_text().split("## Across machines", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    coordinator, node = [c for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    return coordinator, node


def as_run_here(command: str, subs: dict[str, str]) -> list[str]:
    """`command` with `subs` applied (each must occur), `PRIME_TOKEN=...` left to the
    environment and `uv run X` as the environment's X."""
    for old, new in subs.items():
        assert old in command, (old, command)
        command = command.replace(old, new)
    words = shlex.split(command)
    assert words[:3] == ["PRIME_TOKEN=...", "uv", "run"], words
    return [str(BIN / words[3]), *words[4:]]


def listeners(bed: WanBed, k: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in namespace k, IPv6 as "v6:HEX"."""
    out = subprocess.run(bed.exec_prefix(k) + ["cat", "/proc/net/tcp", "/proc/net/tcp6"],
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    found = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[3] != "0A" or ":" not in parts[1]:
            continue
        addr, port = parts[1].split(":")
        if len(addr) == 8:
            addr = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
        else:
            addr = "::" if set(addr) == {"0"} else f"v6:{addr}"
        found.add((addr, int(port, 16)))
    return found


def ephemeral(bed: WanBed, k: int) -> range:
    out = subprocess.run(bed.exec_prefix(k) + ["cat", "/proc/sys/net/ipv4/ip_local_port_range"],
                         capture_output=True, text=True, timeout=30).stdout.split()  # fmt: skip
    return range(int(out[0]), int(out[1]) + 1)


def ranks(bed: WanBed, k: int) -> list[int]:
    """The rank processes (torchrun's workers) running in namespace k."""
    found = []
    for pid in bed.pids(k):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prime_train.cli" in argv and not any(a.endswith(b"torchrun") for a in argv):
            found.append(pid)
    return found


def logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_commands_across_machines(tmp_path, children):
    coordinator_cmd, node_cmd = readme_commands()
    cache = tmp_path / "token-cache"
    bucket = f"file://{tmp_path}/bucket/runs/150M"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    env.update(PRIME_TOKEN=TOKEN, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    with WanBed(4, rate_mbit=100) as bed:
        coord_ip = bed.ip(COORD)
        argv = as_run_here(coordinator_cmd, {"--min-nodes 4": "--min-nodes 2"})
        with open(tmp_path / "coordinator.log", "w") as out:
            coord = children.popen(bed.exec_prefix(COORD) + argv, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip

        def machine(k: int, name: str, ranks: int):
            folder = tmp_path / f"machine{k}"
            folder.mkdir()
            subs = {
                "--nproc-per-node 8": f"--nproc-per-node {ranks}",
                "configs/150M.toml": str(ROOT / "configs" / "debug.toml"),
                "10.0.0.1": coord_ip,
                "dc1-a": name,
                "s3://my-bucket/runs/150M": bucket,
            }
            argv = as_run_here(node_cmd, subs) + [
                "--run.runs_dir", str(folder / "runs"), "--data.cache_dir", str(cache), *SHORT]  # fmt: skip
            with open(tmp_path / f"{name}-{k}.log", "w") as out:
                return children.popen(bed.exec_prefix(k) + argv, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, cwd=folder)  # fmt: skip

        nodes = {k: machine(k, NAMES[k], 2) for k in MACHINES}

        def outer_rows(k: int) -> list[dict]:
            path = tmp_path / f"machine{k}" / "runs" / "debug" / "metrics.jsonl"
            return [r for r in read_metrics(path) if "outer_step" in r] if path.exists() else []

        running = lambda: all(p.poll() is None for p in nodes.values())  # noqa: E731

        def status() -> dict[str, dict]:
            """`prime-mesh status --json` on the coordinator's machine: its nodes by name."""
            r = subprocess.run(
                bed.exec_prefix(COORD) + [str(BIN / "prime-mesh"), "status", "--coordinator",
                                          f"{coord_ip}:29500", "--json"],
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if r.returncode != 0:  # not listening yet
                return {}
            return {n["node_id"]: n for n in json.loads(r.stdout)["nodes"]}

        wait_until(lambda: "dc1-a" in status() or not running(), 180, what="dc1-a registered")
        assert running(), logs(tmp_path)
        # A third machine started by mistake under dc1-a's name: refused, one clear line.
        twin = machine(TWIN, "dc1-a", 1)
        wait_until(lambda: all(outer_rows(k) for k in MACHINES) or not running(), 180,
                   what="both machines' first outer step")  # fmt: skip
        assert running(), logs(tmp_path)
        # `prime-mesh status` shows the names users gave, and each node's checkpoint server
        # advertises the address that reaches the coordinator
        seen = status()
        assert {"dc1-a", "dc1-b"} <= set(seen), seen
        for k in MACHINES:
            node = seen[NAMES[k]]
            assert node["state"] == "member", node
            assert node["metadata"]["serve_url"] == f"http://{bed.ip(k)}:29502", node

        # Nothing listens outside the README's table: the coordinator on 29500, its store on
        # 29501 (--host 0.0.0.0); a machine its checkpoint server on 29502 and gloo on
        # ephemeral ports, on its own address; torchrun's own store (--standalone, wildcard)
        # and the loopback ones are for its own ranks.
        assert listeners(bed, COORD) == {("0.0.0.0", 29500), ("0.0.0.0", 29501)}
        for k in MACHINES:
            found = listeners(bed, k)
            assert (bed.ip(k), 29502) in found, found
            assert any(a == bed.ip(k) and p in ephemeral(bed, k) for a, p in found), found
            outside = {
                (a, p) for a, p in found
                if not (a.startswith("127.") or (a, p) == (bed.ip(k), 29502)
                        or (a in (bed.ip(k), "0.0.0.0", "::") and p in ephemeral(bed, k)))
            }  # fmt: skip
            assert not outside, found

        assert twin.wait(timeout=180) == 1, logs(tmp_path)
        said = [ln for ln in (tmp_path / f"dc1-a-{TWIN}.log").read_text().splitlines()
                if ln.startswith("prime-train: MeshNameTaken:")]  # fmt: skip
        assert said and "the node name 'dc1-a' is held by a live node of this run" in said[0], logs(
            tmp_path
        )
        assert running(), logs(tmp_path)

        # Stop both machines as a user would stop a run (SIGTERM to the ranks: they finish
        # their step, checkpoint, and exit 0, and so does torchrun).
        for k in MACHINES:
            for pid in ranks(bed, k):
                os.kill(pid, signal.SIGTERM)
        for p in nodes.values():
            assert p.wait(timeout=180) == 0, logs(tmp_path)
        rows = {k: {r["outer_step"]: r for r in outer_rows(k)} for k in MACHINES}
        both = sorted(set(rows[1]) & set(rows[2]))
        assert both and both[0] == 1, rows
        for step in both:
            assert rows[1][step]["outer_sha256"] == rows[2][step]["outer_sha256"], step
        assert rows[1][1]["nodes"] == rows[2][1]["nodes"] == 2
        # each machine uploaded its checkpoints under its name
        assert {p.name for p in (tmp_path / "bucket" / "runs" / "150M").iterdir()} >= {
            "dc1-a", "dc1-b"}  # fmt: skip
        coord_log = (tmp_path / "coordinator.log").read_text()
        assert re.search(r"epoch 1: 2 members \['dc1-[ab]', 'dc1-[ab]'\]", coord_log), coord_log
        assert "refused registration" in coord_log and "'dc1-a' is held" in coord_log
        coord.terminate()
        assert coord.wait(timeout=30) == 0, coord_log
