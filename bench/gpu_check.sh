#!/usr/bin/env bash
# Everything that needs a CUDA GPU, as commands that each finish well under 10 minutes (all but `all`) and write
# into one folder, each table row by row as it is measured, so a command cut short keeps its rows:
#
#     bash bench/gpu_check.sh tests  OUT   # environment + pytest -m gpu     -> OUT/tests.md, OUT/tests.log
#     bash bench/gpu_check.sh ladder OUT   # the optimization ladder         -> OUT/ladder.md, .json, .log
#     bash bench/gpu_check.sh mfu    OUT   # MFU, gpt2-124m at seq 1024 and 2048  -> OUT/mfu.md, OUT/mfu.log
#     bash bench/gpu_check.sh profile OUT  # one compiled gpt2-124m step profiled, AdamW then Muon -> OUT/profile_*.md
#     bash bench/gpu_check.sh fp8    OUT   # bf16 against TE and torchao FP8 at about 1B (d=2048, seq 2048) -> OUT/fp8_1b.md
#     bash bench/gpu_check.sh gate   OUT   # gpt2-124m's step with and without attention gates -> OUT/gate.md
#     bash bench/gpu_check.sh all    OUT   # all of them in a row (about 28 minutes)
#     bash bench/gpu_check.sh lease  OUT   # what decides a default first, within 8 min 30 s -> OUT/lease.md
#
# lease: the 124M step profiled as train.py runs it on CUDA (bf16 activations), the GPU tests of the TE options measured
# next (fused weight gradients, FP8 weight copies reused), then at about 1B bf16 and the FP8 rungs (TE delayed scaling
# with the FP8 lm_head, the same in two micro-batches a step without and with fused weight gradients, TE current scaling
# with the FP8 lm_head, torchao tensorwise, TE FP8 attention), then CUDA graphs at 124M, then the GPU tests, each
# started only while the budget (LEASE_BUDGET_S, 510 s) has room for it; OUT/lease.md gathers each rung's tokens/s, MFU,
# unprofiled ms/step, ms by kernel category and the gap (the step less its kernels: no kernel running).
# A session's 15 device minutes hold the kit's transfers, the install and this; `tests` gets what is left.
# tests: TE vs plain parity on the same weights, TE FP8 (both recipes, FP8 attention) through train.py, the
# activation estimate against CUDA's saved tensors. ladder: bench/ladder.py on its GPU defaults (12 layers,
# d=768, head_dim 128, batch 16 x 1024). mfu: the gpt2-124m preset at batch 8 and 16 for each sequence length.
# Each command has a hard time limit, and the ladder and the sweep start no new measurement after their
# --budget-s, so the limit is a backstop. Offline machines: TIKTOKEN_CACHE_DIR points at the GPT-2 BPE file
# that ../shared/gpu's kit installs (the ladder's default corpus is tokenized with it).
# Needs: a CUDA build of torch; pip install -r requirements-gpu.txt (or the kit).
set -u
cd "$(dirname "$0")/.."
WHAT=${1:-}
OUT=${2:-bench/results/gpu_check_$(date +%Y%m%d)}
PY=${PY:-python3}
case "$WHAT" in tests | ladder | mfu | profile | fp8 | gate | all | lease) ;; *)
    echo "usage: bash bench/gpu_check.sh tests|ladder|mfu|profile|fp8|gate|all|lease [OUT_DIR]" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"
# tiktoken's cache name for GPT-2's BPE file (the sha1 of its URL). An image may set TIKTOKEN_CACHE_DIR to a
# folder without it: look where the kit puts it.
GPT2_RANKS=0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4
if [ ! -f "${TIKTOKEN_CACHE_DIR:-.}/$GPT2_RANKS" ]; then
    for dir in "$HOME/.cache/pretrain/tiktoken" /tmp/gpu-kit/tiktoken .gpu/rest/tiktoken; do
        if [ -f "$dir/$GPT2_RANKS" ]; then export TIKTOKEN_CACHE_DIR=$dir && break; fi
    done
fi

limited() { # limited SECONDS LOG COMMAND...: run with a hard time limit, all output to LOG; -> a status line
    local limit=$1 log=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    local why=""
    [ $rc = 124 ] && why=" (killed at the ${limit} s limit)"
    echo "exit $rc after $((SECONDS - start)) s$why: \`$*\`"
    return $rc
}

environment() {
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version())" 2>&1 | tail -1
    for module in transformer_engine torchao bitsandbytes; do
        $PY -c "import importlib.metadata as m; print('$module', m.version('$module'))" 2>/dev/null || echo "$module: not installed"
    done
    echo "TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-unset}"
    echo '```'
}

run_tests() { # [LIMIT_S [PYTEST ARGS]]: pytest -v writes one line per test as it finishes
    {
        echo "# GPU tests, $(date '+%Y-%m-%d %H:%M')"
        echo
        environment
        echo
        # The kit's install log, when the command put it here (OUT/install.log): one file fewer to bring back.
        if [ -f "$OUT/install.log" ]; then echo '```'; cat "$OUT/install.log"; echo '```'; echo; fi
    } > "$OUT/tests.md"
    rm -f "$OUT/install.log"
    local status
    local limit=${1:-420}
    shift
    # tests/conftest.py appends each failure's traceback to PYTEST_FAILURES as it happens.
    local failures
    failures=$(mktemp)
    status=$(PYTEST_FAILURES=$failures limited "$limit" "$OUT/tests.log" $PY -m pytest -m gpu -v -rs \
        -p no:cacheprovider "$@" tests)
    local rc=$?
    {
        echo "$status"
        echo
        echo '```'
        grep -iE "passed|failed|error|skipped" "$OUT/tests.log" | tail -n 40
        echo '```'
        if [ -s "$failures" ]; then echo; echo "## Failures"; cat "$failures"; fi
    } >> "$OUT/tests.md"
    rm -f "$failures"
    echo "tests: $status"
    return $rc
}

run_ladder() { # [LIMIT_S BUDGET_S [ladder.py flags]]: ladder.md and .json rewritten after every rung; stderr: start-up tables
    local status limit=${1:-480} budget=${2:-330}
    shift 2
    status=$(limited "$limit" "$OUT/ladder.log" $PY bench/ladder.py --windows 3 --steps-per-window 5 \
        --warmup-steps 3 --budget-s "$budget" --no-chart --out "$OUT/ladder" "$@")
    local rc=$?
    echo "$status" >> "$OUT/ladder.md"
    echo "ladder: $status"
    return $rc
}

run_mfu() { # [LIMIT_S BUDGET_S SEQ_LENS BATCH_SIZES]: the sweep rewrites mfu.md after every point
    local status
    status=$(limited "${1:-420}" "$OUT/mfu.log" $PY bench/ladder.py --mfu-sweep --sizes gpt2-124m \
        --seq-lens "${3:-1024,2048}" --batch-sizes "${4:-8,16}" --windows 3 --steps-per-window 5 --warmup-steps 3 \
        --budget-s "${2:-300}" --out "$OUT/mfu")
    local rc=$?
    echo "$status" >> "$OUT/mfu.md"
    echo "mfu: $status"
    return $rc
}

# The gpt2-124m preset's shape as the MFU sweep runs it (bench/ladder.py SIZES and SWEEP_SETTINGS), so that the
# profile's tokens/s compares with the sweep's.
GPT2_124M="--n-layer 12 --n-embd 768 --n-head 6 --n-kv-head 3 --head-dim 128 --tie-embeddings --seq-len 1024
    --batch-size 16 --dtype bf16 --tf32 --compile default --fused-adamw"
# About 1B parameters at seq 2048, where every block GEMM is at least 2048 wide and FP8 should pay; the default
# architecture (attention gates), which both FP8 paths build.
SHAPE_1B="--n-layer 16 --n-embd 2048 --n-head 16 --n-kv-head 4 --head-dim 128 --seq-len 2048 --batch-size 8
    --dtype bf16 --tf32 --compile default --optimizer adamw --fused-adamw"

run_profile() { # NAME LIMIT_S [train.py flags]: bench/profile_step.py -> OUT/profile_NAME.md, its log onto OUT/profile.log
    local name=$1 limit=$2 status
    shift 2
    status=$(limited "$limit" "$OUT/profile_$name.log" $PY bench/profile_step.py --out "$OUT/profile_$name.md" "$@")
    local rc=$?
    { echo "== $name: $status"; cat "$OUT/profile_$name.log"; } >> "$OUT/profile.log" && rm "$OUT/profile_$name.log"
    echo "$status" >> "$OUT/profile_$name.md"
    echo "profile $name: $status"
    return $rc
}

run_profiles() { # [LIMIT_S for each]: Muon's second, its compilation mostly from inductor's cache
    # shellcheck disable=SC2086
    run_profile adamw "${1:-120}" $GPT2_124M --optimizer adamw
    local r1=$?
    # shellcheck disable=SC2086
    run_profile muon "${1:-120}" $GPT2_124M --optimizer muon
    return $((r1 | $?))
}

run_variants() { # NAME LIMIT_S TITLE SHAPE VARIANT...: bench/throughput.py at SHAPE plus each VARIANT's flags -> OUT/NAME.md, .log
    local name=$1 limit=$2 title=$3 shape=$4 rc=0 status variant
    shift 4
    { echo "# $title, $(date '+%Y-%m-%d %H:%M')"; echo; echo "shape: \`$(echo $shape)\`"; } > "$OUT/$name.md"
    for variant in "$@"; do
        # shellcheck disable=SC2086
        status=$(limited "$limit" "$OUT/${name}_run.log" $PY bench/throughput.py --windows 3 --steps-per-window 5 \
            --warmup-steps 3 $shape $variant)
        rc=$((rc | $?))
        { echo; echo "## $variant"; echo; echo "$status"; echo; grep '^|' "$OUT/${name}_run.log"; } >> "$OUT/$name.md"
        { echo "== $variant: $status"; cat "$OUT/${name}_run.log"; } >> "$OUT/$name.log" && rm "$OUT/${name}_run.log"
        echo "$name $variant: $status"
    done
    return $rc
}

run_fp8() { # [LIMIT_S for each] [MODES]: bf16 and FP8 at SHAPE_1B -> OUT/fp8_1b.md, .log
    local modes=() mode
    for mode in ${2:-off te torchao}; do modes+=("--fp8 $mode"); done
    run_variants fp8_1b "${1:-150}" "bf16 against FP8 at about 1B parameters" "$SHAPE_1B" "${modes[@]}"
}

run_gate() { # [LIMIT_S for each]: GPT2_124M with and without the attention gates -> OUT/gate.md, .log
    run_variants gate "${1:-90}" "What the attention gates cost per step at gpt2-124m" "$GPT2_124M --optimizer adamw" \
        --attn-gate --no-attn-gate
}

LEASE_BUDGET_S=${LEASE_BUDGET_S:-510}
# A lighter profile for the lease: 3 warm-up steps (compilation), 2 timed windows of 4 steps, 2 profiled steps.
LEASE_PROFILE="--warmup-steps 3 --windows 2 --steps-per-window 4 --steps 2"

room() { # NEEDED_S NAME: whether the lease's budget still has NEEDED_S seconds; else NAME's row says it was skipped
    if [ $((LEASE_BUDGET_S - SECONDS)) -ge "$1" ]; then return 0; fi
    echo "| $2 | skipped: needs $1 s, $((LEASE_BUDGET_S - SECONDS)) s of ${LEASE_BUDGET_S} left | | | | | | | | |" \
        | tee -a "$OUT/lease.md"
    return 1
}

lease_rung() { # NAME LIMIT_S [train.py flags]: one profiled rung if the budget has room: a row of lease.md, its
    # whole profile onto lease_profiles.md (6 files in all come back: the device returns at most 8)
    local name=$1 limit=$2 rc md
    shift 2
    room "$limit" "$name" || return 0
    # shellcheck disable=SC2086
    run_profile "$name" "$limit" $LEASE_PROFILE "$@"
    rc=$?
    md="$OUT/profile_$name.md"
    [ -f "$md" ] || return $rc
    awk -v name="$name" -F'|' '
        /tokens\/s \(median/ { match($0, /unprofiled: [0-9,]+ tokens\/s/); tps = substr($0, RSTART + 12, RLENGTH - 21)
                                match($0, /MFU [^,]+/); mfu = substr($0, RSTART + 4, RLENGTH - 4)
                                match($0, /[0-9.]+ ms\/step/); step = substr($0, RSTART, RLENGTH - 8) + 0 }
        /^\|/ && !done { key = $2; sub(/^ +/, "", key); sub(/ +$/, "", key); ms[key] = $(NF - 2) + 0; table = 1
                         if (key !~ /^(category|-+|idle .*|step .*)$/) kernels += ms[key]; next }
        table { done = 1 }
        /^exit [0-9]+ after/ { status = $0; sub(/: `.*/, "", status) }
        END { if (tps == "") { printf "| %s | no profile: %s | | | | | | | | |\n", name, status; exit }
              gap = step - kernels; if (gap < 0) gap = 0  # the profiled kernels can outlast the unprofiled step
              printf "| %s | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", name, tps, mfu, step,
              ms["GEMM"], ms["attention"], ms["loss"], ms["norm/elementwise"], ms["optimizer"], gap }
    ' "$md" >> "$OUT/lease.md"
    { echo; cat "$md"; } >> "$OUT/lease_profiles.md" && rm "$md"
    return $rc
}

# The GPU tests of the TE options that the 1B rungs measure (fused weight gradients, FP8 weight copies reused), as
# pytest -k takes them: lease_te_tests runs them before those rungs, the lease's last test run leaves them out.
LEASE_TE_TESTS="fused_weight_gradients or refreshes_its_fp8"

lease_te_tests() { # LEASE_TE_TESTS: a row of lease.md, OUT/tests_te.log
    room 90 "TE option tests" || return 0
    local status rc
    status=$(limited 90 "$OUT/tests_te.log" $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -k "$LEASE_TE_TESTS" \
        tests/test_model_te.py tests/test_fp8.py)
    rc=$?
    local summary
    summary=$(grep -E 'passed|failed|error|skipped' "$OUT/tests_te.log" | tail -1)
    echo "| TE option tests | ${summary:-no summary}: $status | | | | | | | | |" >> "$OUT/lease.md"
    echo "TE option tests: ${summary:-no summary}: $status"
    return $rc
}

lease_1b_rungs() { # "NAME:LIMIT_S:train.py flags"...: a lease_rung at SHAPE_1B for each
    local rung rc=0
    for rung in "$@"; do
        # shellcheck disable=SC2086
        lease_rung "${rung%%:*}" "$(echo "$rung" | cut -d: -f2)" $SHAPE_1B ${rung#*:*:} || rc=1
    done
    return $rc
}

run_lease() { # the 124M step, the TE options' tests, the 1B FP8 rungs, 124M's CUDA graphs, the tests, in LEASE_BUDGET_S
    {
        echo "# GPU lease, $(date '+%Y-%m-%d %H:%M'), budget ${LEASE_BUDGET_S} s (profiles: lease_profiles.md)"
        echo
        echo "| rung | tokens/s | MFU | ms/step | GEMM | attention | loss | norm/elementwise | optimizer | gap |"
        echo "|---|---|---|---|---|---|---|---|---|---|"
    } > "$OUT/lease.md"
    local rc=0
    # The 124M step as train.py runs it on CUDA (bf16 activations, --activation-dtype auto; the float32 stream was
    # 0.96x of it on 2026-11-30), then the GPU tests of the TE options the next rungs measure. At 1B: bf16, TE
    # delayed scaling with the FP8 head (the likeliest FP8 default), the same step in two micro-batches without and
    # with fused weight gradients. Then the 124M step with its lm_head in FP8 (the head's GEMMs are a third of
    # 124M's, unmeasured there); at 1B TE current scaling with the FP8 head, torchao, TE FP8 attention; CUDA graphs
    # at 124M. TE delayed without the FP8 head (1.14x on 2026-11-30) is not run again.
    # shellcheck disable=SC2086
    lease_rung 124m 100 $GPT2_124M --optimizer adamw || rc=1
    lease_te_tests || rc=1
    local delayed_head="--fp8 te --fp8-recipe delayed --fp8-head" two_micro="--batch-size 4 --grad-accum 2"
    lease_1b_rungs "1b_bf16:100:" "1b_te_delayed_head:100:$delayed_head" \
        "1b_te_delayed_head_ga2:100:$delayed_head $two_micro" \
        "1b_te_delayed_head_ga2_fused:100:$delayed_head $two_micro --fp8-fused-wgrad" || rc=1
    # shellcheck disable=SC2086
    lease_rung 124m_fp8_head 100 $GPT2_124M --optimizer adamw --fp8-head || rc=1
    lease_1b_rungs "1b_te_head:100:--fp8 te --fp8-head" "1b_torchao:180:--fp8 torchao" \
        "1b_te_delayed_attn:100:--fp8 te --fp8-recipe delayed --fp8-attn" || rc=1
    # shellcheck disable=SC2086
    lease_rung 124m_cuda_graphs 90 ${GPT2_124M/--compile default/--compile reduce-overhead} --optimizer adamw || rc=1
    room 60 "the GPU tests" && { run_tests $((LEASE_BUDGET_S - SECONDS)) -n 4 -k "not ($LEASE_TE_TESTS)" || rc=1; }
    return $rc
}

case "$WHAT" in
tests) run_tests ;;
gate) run_gate ;;
ladder) run_ladder 480 330 ;;
mfu) run_mfu ;;
profile) run_profiles ;;
fp8) run_fp8 ;;
all) run_tests; r1=$?; run_gate; r2=$?; run_profiles; r3=$?; run_fp8; r4=$?; run_ladder 480 330; r5=$?; run_mfu
    r6=$?; (exit $((r1 | r2 | r3 | r4 | r5 | r6))) ;;
lease) run_lease ;;
esac
rc=$?
echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
