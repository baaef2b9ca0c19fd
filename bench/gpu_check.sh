#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command that finishes in under 10 minutes:
#
#     bash bench/gpu_check.sh [OUT_DIR]        # default: bench/results/gpu_check_<date>
#
#   1. the CUDA-only tests (pytest -m gpu): TE vs plain parity on the same weights, TE FP8 (both recipes,
#      FP8 attention) through train.py, the activation estimate against CUDA's saved tensors;
#   2. the optimization ladder (bench/ladder.py) on its GPU defaults: 12 layers, d=768, head_dim 128,
#      batch 16 x 1024;
#   3. one MFU-sweep point (124M preset, batch 16).
#
# Each step has its own time limit and the script carries on after a failure; SUMMARY.md collects the
# exit codes and the tables. Needs: a CUDA build of torch, pip install -r requirements-gpu.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu_check_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
SUMMARY="$OUT/SUMMARY.md"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record the exit code
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - start)) s (log: $OUT/$name.log)" | tee -a "$SUMMARY"
    return 0
}

{
    echo "# GPU check, $(date '+%Y-%m-%d %H:%M')"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'device', torch.cuda.get_device_name())" 2>&1
    python -c "import transformer_engine as t; print('transformer_engine', t.__version__)" 2>&1 | tail -1
    python -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
    python -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -1
    echo '```'
    echo
} > "$SUMMARY"

step pytest_gpu 180 python -m pytest -m gpu -v -rs tests
step ladder 300 python bench/ladder.py --windows 3 --steps-per-window 5 --warmup-steps 3 --out "$OUT/ladder"
step mfu_sweep 100 python bench/ladder.py --mfu-sweep --sizes 124M --batch-sizes 16 --windows 3 \
    --steps-per-window 5 --warmup-steps 3 --out "$OUT/mfu_sweep"

{
    echo
    echo "## pytest -m gpu"
    echo '```'
    tail -n 25 "$OUT/pytest_gpu.log"
    echo '```'
    for table in ladder mfu_sweep; do
        echo
        if [ -f "$OUT/$table.md" ]; then cat "$OUT/$table.md"; else echo "## $table: no table (see $OUT/$table.log)"; fi
    done
} >> "$SUMMARY"
echo "results: $SUMMARY"
