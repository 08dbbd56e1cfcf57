#!/usr/bin/env bash
# The GPU path as users run it, in one script (about 4 minutes on one H200), ending in one table:
#   single   150M, bf16 on 1 GPU (one rank: no FSDP2, autocast): steps/s, tokens/s, MFU
#            against the bf16 matmul peak measured here; train and held-out loss must fall
#            (Python stdlib text, byte tokens)
#   node     one node of every GPU here (--launch.ranks_per_node = GPU count, NCCL inside the
#            node); skipped with fewer than 2 GPUs (two NCCL ranks cannot share one GPU)
#   diloco   2 local nodes of 1 rank on GPU 0 through the launcher (gloo between them, uint8
#            pseudo-gradients): loss must fall and the nodes' outer weight hashes match
#   offload  the single stage with train.cpu_offload (parameters, gradients and optimizer
#            state on the CPU): its peak GPU memory against the single stage's
# Each stage is time-boxed (GPU_CHECK_STAGE_S seconds, diloco twice that) and its row is
# written to GPU_CHECK_OUT/results.jsonl as soon as it ends. Exit 0 only if every stage that
# ran passed. Without CUDA it fails at once (exit 1) and says so.
#
# On a GPU machine without uv or network (Python 3.12 with torch): if prime_train is not
# importable, the wheels it lacks are installed from GPU_CHECK_WHEELS (default .whl/, filled by
# benchmarks/gpu_wheels.sh on a machine with a package index) and the four packages with
# `pip install --no-deps --no-build-isolation` (prime-comm built with the cmake and pybind11
# there), all into GPU_CHECK_SITE (default /tmp/prime-site) on PYTHONPATH.
#
# GPU_CHECK_DRY_RUN=1 runs the same stages on CPU with the debug model (the node stage with 2
# gloo ranks, no offload stage): a check of this script, not of a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
RESULTS_DIR=${GPU_CHECK_OUT:-runs/gpu-check}
STAGE_S=${GPU_CHECK_STAGE_S:-50}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/prime-site}

say() { echo "[gpu_check] $*"; }
fail() {
    echo "gpu_check: FAILED: $*" >&2
    exit 1
}

if [ "$DRY" != 1 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
        fail "no CUDA device visible to $PY (torch.cuda.is_available() is False, or no torch): \
run this on a GPU machine; GPU_CHECK_DRY_RUN=1 runs the script's stages on CPU instead"
fi

if ! "$PY" -c "import prime_train.cli, prime_comm, pydantic, zstandard" 2>/dev/null; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 ||
        fail "prime_train is not importable and $WHEELS/ holds no wheels: run \
benchmarks/gpu_wheels.sh where a package index is reachable, and bring $WHEELS/ along"
    say "installing the carried wheels and the four packages into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || fail "pip could not install $WHEELS/*.whl"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    for p in mesh ckpt comm train; do
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
            --upgrade --target "$SITE" "./packages/prime-$p" || fail "installing prime-$p failed"
    done
    "$PY" -c "import prime_train.cli, prime_comm" || fail "the installed packages do not import"
fi

mkdir -p "$RESULTS_DIR"
RESULTS=$RESULTS_DIR/results.jsonl
RUNS=$RESULTS_DIR/runs
: >"$RESULTS"

if [ "$DRY" = 1 ]; then
    say "DRY RUN on CPU with the debug model: no GPU figures"
    GPUS=2 # the node stage: 2 gloo ranks
    PEAK=n/a
    DEV=CPU
    COMMON=(--config configs/debug.toml --data.path "{stdlib}/[a-c]*.py" --data.seq_len 64
        --train.batch_size 4 --train.steps 20 --run.log_every 5 --eval.every 0
        --eval.batches 2 --ckpt.every 0 --launch.local_nodes 1 --train.device cpu)
    DILOCO=(--diloco.inner_steps 10) # 2 outer steps in the 20 steps
else
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    DEV=GPU
    PEAK=$("$PY" benchmarks/gpu_check.py peak) || fail "could not measure the bf16 matmul peak"
    say "$GPUS GPU(s): $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))"), \
bf16 matmul $PEAK TFLOP/s measured"
    COMMON=(--config configs/150M.toml --data.path "{stdlib}/*.py" --data.tokenizer byte
        --data.seq_len 1024 --train.batch_size 16 --train.steps 100 --optim.warmup_steps 10
        --run.log_every 10 --eval.every 0 --eval.batches 4 --ckpt.every 0
        --launch.local_nodes 1 --train.device cuda --train.precision bf16)
    DILOCO=(--diloco.inner_steps 25)
fi

run_stage() { # name setup gpus peak seconds [prime-train overrides...]
    local name=$1 setup=$2 gpus=$3 peak=$4 secs=$5
    shift 5
    rm -rf "${RUNS:?}/$name"
    say "stage $name ($setup), at most ${secs}s"
    timeout -k 20 "$secs" "$PY" -m prime_train.cli "${COMMON[@]}" "$@" \
        --run.runs_dir "$RUNS" --run.name "$name" --data.cache_dir "$RESULTS_DIR/token-cache" \
        >"$RESULTS_DIR/$name.log" 2>&1
    local rc=$?
    "$PY" benchmarks/gpu_check.py record "$RESULTS" "$name" "$RUNS/$name" --setup "$setup" \
        --peak "$peak" --gpus "$gpus" --rc "$rc"
    [ "$rc" -eq 0 ] || tail -n 5 "$RESULTS_DIR/$name.log" | sed "s/^/[gpu_check] $name: /"
}

run_stage single "1 $DEV, 1 rank" 1 "$PEAK" "$STAGE_S"
if [ "$GPUS" -ge 2 ]; then
    run_stage node "1 node x $GPUS ranks" "$GPUS" "$PEAK" "$STAGE_S" \
        --launch.ranks_per_node "$GPUS"
else
    "$PY" benchmarks/gpu_check.py skip "$RESULTS" node --why "1 GPU (NCCL ranks need a GPU each)"
fi
run_stage diloco "2 nodes x 1 rank, one $DEV" 1 n/a $((2 * STAGE_S)) \
    --launch.local_nodes 2 "${DILOCO[@]}"
if [ "$DRY" = 1 ]; then
    "$PY" benchmarks/gpu_check.py skip "$RESULTS" offload --why "CPU dry run"
else
    run_stage offload "1 GPU, cpu_offload" 1 "$PEAK" "$STAGE_S" --train.cpu_offload true \
        --train.steps 30
fi

echo
"$PY" benchmarks/gpu_check.py table "$RESULTS"
