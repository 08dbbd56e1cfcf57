"""Bytes and seconds per parameter at a real model size, through the CLI (issue 35).

    uv run python benchmarks/real_size.py                             # 134M: dim 768, 12 layers
    uv run python benchmarks/real_size.py --dim 512 --n_layers 4      # 46M, a quick run

A `prime-mesh coordinator` and two member nodes, each `prime-train` in its own process and
folder (the 150M preset at --dim/--n_layers, CPU, one thread, batch 1, seq_len 64, H = 5,
uint8, synthetic data, a checkpoint every 10 steps, 2 kept); once the members committed
--join-at outer steps a third node runs the same command and joins; once it contributed
--joiner-rounds rounds every node gets SIGTERM. Prints, per node:
- anonymous and staging (file-backed and shared: the memory-mapped RAM tier) memory per
  parameter, sampled from /proc every 0.2 s (the peak of RssAnon, RssFile + RssShmem), and
  the peak RSS (VmHWM), over the node's process tree;
- disk per parameter at its peak (the node's folder, allocated blocks, sampled every 0.5 s);
- the outer step's own seconds per round, the rows' `outer_own_s` (the node's passes over
  the model: pseudo-gradient, Nesterov and the copy into the model, the weight hash, the
  replay log's entry), the median, against a one-thread memcpy of the fp32 weights timed in
  this process (`outer_own_over_memcpy`), and the same for the CPU seconds of the thread
  that ran them (`outer_own_cpu_over_memcpy`: with three nodes on two cores, wall time
  counts the others' turns too); the rest of a round besides its inner compute,
  all-reduce and sync point (`round_rest_s`: the vote's wait for the others, metrics, ...)
  over rounds that followed no checkpoint; checkpoint blocking: the same median over the
  rounds that followed a checkpoint, less that one, and as the node counted it (the
  progress rows' `ckpt_blocked_s` over `ckpt_saves`: per save and per GB of state);
- the same passes timed alone in this process, before the job, each over the memcpy;
- for the joiner: the snapshot's bytes and MB/s, the seconds it was held for the rounds'
  all-reduces and its final fsync took, and the MB/s without them (`snapshot_moving_MB_s`),
  start to first contribution;
- exit codes and seconds from SIGTERM to exit; the checkpoint errors the node's summary
  counts, and whether its final checkpoint reached its folder (`--remote hung|refused`:
  `ckpt.remote` at an S3 endpoint that never answers or refuses, the stopping variants).
Writes real_size.json into --out (default: a new temporary folder); exits 1 when a node did
not exit 0 after SIGTERM or the joiner's hash differs from the members'.
`measure(...)` is what tests/test_real_size.py runs at ~20M parameters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support")]

from node_sampler import Sampler  # noqa: E402

from prime_testkit.children import Children, wait_until  # noqa: E402
from prime_testkit.cli_node import cli_node  # noqa: E402
from prime_testkit.runs import folder_metrics, outer_rows  # noqa: E402
from prime_testkit.s3 import CREDENTIALS, DeadS3  # noqa: E402


def num_params(dim: int, n_layers: int, vocab_size: int | None) -> int:
    """The parameter count of the 150M preset at this shape (built on the meta device)."""
    import torch

    from prime_train.model import Transformer, model_args
    from prime_train.model import num_params as count

    with torch.device("meta"):
        return count(Transformer(model_args("150M", dim=dim, n_layers=n_layers,
                                            vocab_size=vocab_size)))  # fmt: skip


def memcpy_seconds(numel: int, repeat: int = 5) -> float:
    """The best of `repeat` one-thread copies of `numel` float32 (the baseline)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(numel), torch.empty(numel)
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(threads)


BASELINE = """
import torch, prime_train.cli, prime_train.trainer, prime_train.run, prime_mesh, prime_ckpt, prime_comm
import torch.distributed
print({k: int(v.split()[0]) * 1024 for k, v in
       (line.split(":", 1) for line in open("/proc/self/status")) if k in ("RssAnon", "VmRSS")})
"""


def interpreter_memory() -> dict[str, int]:
    """RssAnon and VmRSS of an interpreter that imported what a node imports, before any
    model: the fixed cost subtracted from the per-parameter figures (`*_less_interpreter`)."""
    import ast
    import subprocess

    out = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def own_passes(numel: int, memcpy_s: float) -> dict[str, float]:
    """The outer step's own passes timed here, alone (a model of one flat parameter of
    `numel`; the best of 2), each over the memcpy: pseudo-gradient, Nesterov and the copy
    into the model, the weight hash, and the replay-log entry whole: the all-reduce's copy of
    the codes it kept (`keep_encoding`), the packing, and the body's msgpack and HMAC (done in
    the log's writer thread in a run, counted here all the same)."""
    import torch

    import prime_comm
    from prime_train.diloco import update_codec
    from prime_train.diloco.outer_optimizer import OuterOptimizer
    from prime_train.diloco.replay_log import Entry, entry_key

    torch.set_num_threads(1)
    model = torch.nn.Parameter(torch.randn(numel))
    opt = OuterOptimizer([model], lr=0.7, momentum=0.9)
    with torch.no_grad():
        model.add_(1e-3)
    q = prime_comm.quantize(torch.randn(numel) * 1e-3)
    kept = prime_comm.EncodedResult(torch.empty_like(q.data), 8, (numel,))
    update, key = prime_comm.dequantize(q), entry_key("bench")

    def entry() -> None:
        kept.data.copy_(q.data)
        Entry(1, 1, 0, "h", "h", update).pack(update_codec.Encoded(kept)).parts(key)

    parts = {"pseudo_gradient": opt.compute_pseudo_gradient, "nesterov_and_copy": opt.apply,
             "hash": opt.digest, "entry": entry}  # fmt: skip
    out = {}
    for name, f in parts.items():
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        out[name] = round(best / memcpy_s, 2)
    out["total"] = round(sum(out.values()), 2)
    out["committed_record_write_background"] = round(spill_seconds(numel) / memcpy_s, 2)
    return out


def spill_seconds(numel: int) -> float:
    """The committed record's write (AdamW's two moments to its scratch file,
    `prime_train/spill.py`), the best of 2: a thread's work while the next inner step computes,
    so not in the passes' total."""
    import torch

    from prime_train.spill import TensorSpill

    moments = [torch.randn(numel), torch.randn(numel)]
    with tempfile.TemporaryDirectory() as folder:
        spill = TensorSpill(Path(folder) / ".committed-r0")
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            spill.write(moments)
            spill.wait()
            best = min(best, time.perf_counter() - t)
        spill.close()
    return best


def node_args(args: argparse.Namespace) -> list[str]:
    """The settings every node runs with (on top of tests' debug-config node)."""
    model = ["--model.preset", "150M", "--model.dim", str(args.dim),
             "--model.n_layers", str(args.n_layers)]  # fmt: skip
    if args.vocab_size:
        model += ["--model.vocab_size", str(args.vocab_size)]
    return [*model, "--data.source", "synthetic", "--data.seq_len", "64",
            "--train.batch_size", "1", "--train.threads", "1", "--ckpt.every", "10",
            "--ckpt.keep", "2", "--run.log_every", "5", "--mesh.serve_mbit", str(args.serve_mbit),
            "--train.stop_within_s", str(args.stop_within_s), *args.extra]  # fmt: skip


def outer_figures(rows: list[dict], memcpy_s: float) -> dict:
    """The outer step's own seconds and checkpoint blocking from a node's rows (module doc)."""
    outer = [r for r in outer_rows(rows) if r.get("round_s") and r["outer_step"] > 1]
    if not outer:
        return {}
    own = statistics.median(r["outer_own_s"] for r in outer)
    own_cpu = statistics.median(r["outer_own_cpu_s"] for r in outer)
    # besides its inner compute, all-reduce and sync point, a round holds the previous
    # boundary's work: its checkpoint every 10 steps, the vote, the metrics
    rest = {r["step"]: r["round_s"] - r["compute_s"] - r["allreduce_seconds"]
            - r.get("sync_seconds", 0.0) for r in outer}  # fmt: skip
    clean = [s for step, s in rest.items() if (step - 5) % 10 != 0]
    after_ckpt = [s for step, s in rest.items() if (step - 5) % 10 == 0]
    return {
        "rounds": len(outer),
        "outer_own_s": round(own, 3),
        "outer_own_over_memcpy": round(own / memcpy_s, 1),
        # the CPU the passes took (one torch thread): what other nodes' load does not inflate
        "outer_own_cpu_over_memcpy": round(own_cpu / memcpy_s, 1),
        "round_rest_s": round(statistics.median(clean), 3) if clean else None,
        "ckpt_blocking_s": round(statistics.median(after_ckpt) - statistics.median(clean), 3)
        if clean and after_ckpt
        else None,
    }


def joiner_figures(rows: list[dict], started: float, serve_mbit: float) -> dict:
    """The joiner's snapshot and start to first contribution; with a cap (`serve_mbit`, the
    joiner's twice it: `mesh.fetch_mbit`'s default), the moving rate over the joiner's cap."""
    joined = next((r for r in rows if r.get("joined")), None)
    first = next((r for r in outer_rows(rows)
                  if r["contributors"] == r["nodes"] and r["outer_step"] > 0
                  and joined and r["time"] > joined["time"] - 1e-3), None)  # fmt: skip
    if joined is None:
        return {"joined": False}
    moving = joined["fetch_seconds"] - joined["fetch_held_seconds"] - joined["fetch_commit_seconds"]
    return {
        "joined": True,
        "snapshot_bytes": joined["fetch_bytes"],
        "snapshot_MB_s": round(joined["fetch_bytes"] / 1e6 / max(joined["fetch_seconds"], 1e-9), 1),
        # less the time held for the rounds' all-reduces and the final fsync: the bytes moving
        "snapshot_held_s": round(joined["fetch_held_seconds"], 2),
        "snapshot_fsync_s": round(joined["fetch_commit_seconds"], 2),
        "snapshot_moving_MB_s": round(joined["fetch_bytes"] / 1e6 / max(moving, 1e-9), 1),
        **(
            {
                "snapshot_moving_of_cap": round(
                    joined["fetch_bytes"] / max(moving, 1e-9) / (2 * serve_mbit * 1e6 / 8), 2
                )
            }
            if serve_mbit
            else {}
        ),  # fmt: skip
        "start_to_first_contribution_s": round(first["time"] - started, 1) if first else None,
    }


def blocking_figures(rows: list[dict], params: int) -> dict:
    """Checkpoint blocking from the last progress row: the loop's seconds in `save()` and
    waiting for the copies into RAM, per save and per GB of state (20 B/param)."""
    last = next((r for r in reversed(rows) if "ckpt_blocked_s" in r), None)
    if last is None or not last["ckpt_saves"]:
        return {}
    per_save = last["ckpt_blocked_s"] / last["ckpt_saves"]
    return {"ckpt_saves": last["ckpt_saves"], "ckpt_blocked_s_per_save": round(per_save, 3),
            "ckpt_blocked_s_per_GB": round(per_save / (20 * params / 1e9), 3)}  # fmt: skip


def stop_figures(folder: Path) -> dict:
    """From a node's summary: the checkpoint errors it counted, and whether the step it
    stopped at is a committed checkpoint in its folder (the final one reached disk)."""
    from prime_ckpt import committed_steps

    found = sorted(folder.glob("runs/*/summary*.json"))
    if not found:
        return {"summary": False}
    summary = json.loads(found[0].read_text())
    steps = committed_steps(summary["checkpoint_dir"]) if summary["checkpoint_dir"] else []
    return {"ckpt_errors": summary["ckpt_errors"], "stopped_at": summary["steps"],
            "final_ckpt_on_disk": summary["steps"] in steps}  # fmt: skip


def _contributed(folder: Path, rounds: int) -> bool:
    """The node in `folder` contributed to `rounds` rounds since it joined."""
    rows = folder_metrics(folder)
    joined = next((r for r in rows if r.get("joined")), None)
    return joined is not None and sum(
        1 for r in outer_rows(rows)
        if r["contributors"] == r["nodes"] and r["time"] > joined["time"] - 1e-3
    ) >= rounds  # fmt: skip


def _stop(procs: dict, timeout: float) -> dict[str, dict]:
    """SIGTERM to every node at once; each one's exit code and seconds to exit."""
    t0 = time.monotonic()
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    out = {}
    for name, p in procs.items():
        try:
            rc = p.wait(timeout=max(timeout - (time.monotonic() - t0), 1))
        except Exception:  # noqa: BLE001 (still running: killed below, reported as such)
            p.kill()
            rc = p.wait(timeout=30)
        out[name] = {"exit": rc, "exit_after_sigterm_s": round(time.monotonic() - t0, 1)}
    return out


def run_job(args: argparse.Namespace, work: Path, sampler: Sampler) -> tuple[dict, dict]:
    """The coordinator, two members, then the joiner, stopped once it contributed (module
    doc). Returns ({node: started}, {node: exit figures})."""
    from prime_mesh import Coordinator

    token = "real-size-benchmark"
    coord = Coordinator("127.0.0.1", port=0, token=token, min_nodes=2).start()
    children, procs, started = Children(), {}, {}
    env = {"PRIME_MESH__HEARTBEAT_TIMEOUT_S": "20", "PRIME_MESH__SERVE_PORT": "0"}
    dead, remote = DeadS3(args.remote) if args.remote else None, []
    if dead is not None:
        env.update(CREDENTIALS)
        remote = ["--ckpt.remote", "s3://real-size/run",
                  "--ckpt.remote_options", f'{{endpoint_url = "{dead.endpoint}"}}']  # fmt: skip
    try:
        for k, name in enumerate(["member0", "member1", "joiner"]):
            if name == "joiner":
                if not args.joiner:
                    break
                wait_until(lambda: len(outer_rows(folder_metrics(work / "member0"))) >= args.join_at,
                           args.timeout, interval=1, what="the members' outer steps")  # fmt: skip
            argv, node_env = cli_node(work / name, coordinator=coord.address, host="127.0.0.1",
                                      token=token, cache=work / "cache", steps=100_000,
                                      inner_steps=5, env=env,
                                      args=[*node_args(args), *remote])  # fmt: skip
            node_env["PRIME_MESH__HOST"] = "127.0.0.1"
            with open(work / f"{name}.log", "a") as out:
                started[name] = time.time()
                procs[name] = children.popen(argv, env=node_env, stdout=out, stderr=out,
                                             cwd=work / name)  # fmt: skip
            sampler.watch(name, procs[name].pid, work / name)
            if k == 0:
                wait_until(lambda: len(coord.status()["nodes"]) > 0, 300, interval=0.5,
                           what="member0 registers")  # fmt: skip
        last = work / ("joiner" if args.joiner else "member0")
        rounds = args.joiner_rounds if args.joiner else args.join_at + args.joiner_rounds
        done = (lambda: _contributed(last, rounds)) if args.joiner else (
            lambda: len(outer_rows(folder_metrics(last))) >= rounds)  # fmt: skip
        wait_until(lambda: done() or any(p.poll() is not None for p in procs.values()),
                   args.timeout, interval=1, what="the joiner's contributions")  # fmt: skip
        return started, _stop(procs, args.stop_within_s + 10 + 30)
    finally:
        children.kill_all()
        coord.close()
        if dead is not None:
            dead.close()


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Run the job in `work` and gather every figure (module doc)."""
    params = num_params(args.dim, args.n_layers, args.vocab_size)
    memcpy_s, fixed = memcpy_seconds(params), interpreter_memory()
    alone = own_passes(params, memcpy_s)
    sampler = Sampler()
    sampler.start()
    try:
        started, exits = run_job(args, work, sampler)
    finally:
        sampler.stop()
    nodes, hashes = {}, {}
    for name, peak in sampler.peak.items():
        rows = folder_metrics(work / name)
        hashes[name] = {r["outer_step"]: r["outer_sha256"] for r in outer_rows(rows)}
        nodes[name] = {
            "anon_B_per_param": round(peak["anon"] / params, 1),
            "anon_B_per_param_less_interpreter": round(
                (peak["anon"] - fixed["RssAnon"]) / params, 1
            ),
            "staging_B_per_param": round(peak["staging"] / params, 1),
            "peak_rss_B_per_param": round(peak["hwm"] / params, 1),
            "peak_rss_B_per_param_less_interpreter": round(
                (peak["hwm"] - fixed["VmRSS"]) / params, 1
            ),
            "disk_B_per_param": round(peak["disk"] / params, 1),
            **outer_figures(rows, memcpy_s),
            **blocking_figures(rows, params),
            **(joiner_figures(rows, started[name], args.serve_mbit) if name == "joiner" else {}),
            **exits.get(name, {}),
            **stop_figures(work / name),
        }
    same = all(h.get(k) in (None, v) for h in hashes.values() for k, v in hashes["member0"].items())
    return {"params": params, "interpreter": fixed, "memcpy_s": round(memcpy_s, 4),
            "own_passes_alone_over_memcpy": alone,
            "memcpy_GB_s": round(4 * params / 1e9 / memcpy_s, 2), "nodes": nodes,
            "hashes_agree": same}  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=768, help="model width (default 768)")
    ap.add_argument("--n_layers", type=int, default=12, help="model depth (default 12)")
    ap.add_argument("--vocab_size", type=int, default=None, help="default: the preset's 32000")
    ap.add_argument("--join-at", type=int, default=3, help="members' outer steps before the joiner")
    ap.add_argument("--joiner-rounds", type=int, default=2, help="its rounds before SIGTERM")
    ap.add_argument("--no-joiner", dest="joiner", action="store_false", help="members only")
    ap.add_argument("--remote", choices=DeadS3.KINDS, default=None,
                    help="ckpt.remote at an S3 endpoint that hangs or refuses (stopping with a "
                    "remote that fails)")  # fmt: skip
    ap.add_argument("--stop-within-s", type=float, default=25.0, help="train.stop_within_s")
    ap.add_argument("--serve-mbit", type=float, default=0.0,
                    help="mesh.serve_mbit, each donor's cap (default 0: none, the snapshot's "
                         "rate over loopback; the joiner's cap is twice it)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1800.0, help="bound on each wait, seconds")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: a temporary one)")
    ap.add_argument(
        "--work",
        default=None,
        help="the nodes' folders, kept (default: a temporary one; only logs kept)",
    )
    ap.add_argument("extra", nargs="*", help="more prime-train settings (after --)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="real_size-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = {**measure(args, work), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(result, indent=2))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="real_size-out-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_size.json").write_text(json.dumps({"args": vars(args), **result}, indent=2) + "\n")
    if not args.work:  # the nodes' folders (checkpoints: GBs at a real size) go, their logs stay
        for name in result["nodes"]:
            shutil.rmtree(work / name, ignore_errors=True)
    print(f"wrote {out / 'real_size.json'}; logs in {work}")
    bad = [n for n, f in result["nodes"].items() if f.get("exit") != 0]
    if bad or not result["hashes_agree"]:
        print(f"FAIL: nodes not exiting 0 after SIGTERM: {bad}; hashes agree: "
              f"{result['hashes_agree']}")  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
