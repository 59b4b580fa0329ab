#!/usr/bin/env bash
# The tricks on one GPU, in at most 8 minutes; one table at the end.
#
#   bash scripts/gpu_check.sh                          # from a checkout, with ".[demo,test]" installed
#   docker run --gpus all --rm --entrypoint bash nlp-tricks scripts/gpu_check.sh    # in the image
#
# Steps (each under `timeout`, all within GPU_CHECK_BUDGET_S, default 480 s; logs in GPU_CHECK_OUT, default
# outputs/gpu_check):
#   1. pytest tests/gpu                  fp16 / bf16 adversarial steps vs fp32, overflow skips, float32 losses, ...
#   2. NER (demo data, MiniLM), 40 steps: fp16 + FGM (accelerate --mixed_precision fp16), fp16 + PGD (--fp16),
#      bf16 + FGM (accelerate --mixed_precision bf16), bf16 + PGD (--bf16); loss_clean / loss_adv must be logged and
#      finite, and the attack skipped on at most a quarter of the steps (fp16 overflow steps)
#   3. summarization (demo data, BERT2BERT MiniLM), fp16, scheduled sampling (linear): the teacher-forcing ratio must
#      fall and the loss stay finite
#   4. benchmarks/adversarial.py --device cuda and benchmarks/scheduled_sampling.py --device cuda
# Exit status: 0 when every step passed, 1 when one failed or the budget ran out, 2 without a CUDA device.
#
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU with tiny sizes (bf16 autocast only; fp16 is fp32 there):
# a dry run of this script's plumbing, not a GPU check.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-outputs/gpu_check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
# The dry run on a CPU is slow (bf16 without hardware support): no per-step limits, a larger budget.
[[ "$DEVICE" == cuda ]] || BUDGET=${GPU_CHECK_BUDGET_S:-1800}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_DISABLED=true
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1

if [[ "$DEVICE" == cuda ]]; then
    if ! WHERE=$("$PY" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' \
        2>/dev/null); then
        echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was run" >&2
        exit 2
    fi
    LAUNCH=(--config_file accelerate_configs/single_gpu.yaml)
    NER_SIZE=(--max_steps 40 --max_train_samples 640 --max_eval_samples 128 --per_device_train_batch_size 16
        --logging_steps 10)
    SUM_SIZE=(--max_steps 30 --max_train_samples 240 --max_eval_samples 32 --per_device_train_batch_size 8
        --generation_max_length 48)
    SS_K=30
    BENCH=(--device cuda)
    PYTEST_ENV=()
else
    WHERE="CPU dry run (not a GPU check)"
    LAUNCH=(--config_file accelerate_configs/cpu.yaml)
    NER_SIZE=(--max_steps 2 --max_train_samples 16 --max_eval_samples 4 --per_device_train_batch_size 8
        --max_seq_length 32 --use_cpu true --logging_steps 1)
    SUM_SIZE=(--max_steps 4 --max_train_samples 16 --max_eval_samples 4 --per_device_train_batch_size 4
        --generation_max_length 8 --max_source_length 64 --max_target_length 16)
    SS_K=4
    BENCH=(--quick)
    PYTEST_ENV=(NLP_TRICKS_GPU_TESTS_DEVICE=cpu)
fi

rm -rf "$OUT"
mkdir -p "$OUT"
START=$SECONDS
ROWS=()
FAILED=0

# run_step NAME TIMEOUT_S COMMAND...: run under the remaining budget, log to $OUT/NAME.log, record status and time.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 15)); then
        ROWS+=("| $name | SKIPPED (budget spent) | 0 | |")
        FAILED=1
        return 1
    fi
    [[ "$DEVICE" == cuda ]] || limit=$left
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit}s)" >&2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    STEP_SECONDS=$((SECONDS - t0))
    if ((rc == 124 || rc == 137)); then
        STEP_STATUS="FAIL (timeout ${limit}s)"
    elif ((rc != 0)); then
        STEP_STATUS="FAIL (exit $rc)"
    else
        STEP_STATUS=ok
    fi
    return $rc
}

# record NAME DETAILS: one table row from the last step; a failed step shows the end of its log.
record() {
    local name=$1 details=$2
    if [[ "$STEP_STATUS" != ok ]]; then
        FAILED=1
        echo "---- $name failed; last lines of $OUT/$name.log:" >&2
        tail -n 25 "$OUT/$name.log" >&2
    fi
    ROWS+=("| $name | $STEP_STATUS | $STEP_SECONDS | ${details//|//} |")
}

# check NAME PYTHON_CODE: check a passed step's outputs (in $OUT/NAME, sys.argv[1]); sets DETAILS for its row, and
# STEP_STATUS to a failure when the check fails (its traceback goes to the step's log).
check() {
    local name=$1 code=$2
    [[ "$STEP_STATUS" == ok ]] || return 0
    if ! DETAILS=$("$PY" -c "$code" "$OUT/$name" 2>>"$OUT/$name.log"); then
        STEP_STATUS="FAIL (check)"
        DETAILS="$(tail -n 1 "$OUT/$name.log")"
    fi
}

# ---- 1. The GPU tests ----
if run_step pytest_gpu 180 env "${PYTEST_ENV[@]}" "$PY" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider; then
    details=$(tail -n 1 "$OUT/pytest_gpu.log" | tr -d '=')
else
    details=$(grep -E '^(FAILED|ERROR)' "$OUT/pytest_gpu.log" | head -n 3 | tr '\n' ';')
fi
record pytest_gpu "$details"

# ---- 2. NER in fp16 and bf16 with FGM and PGD ----
NER_CHECK='
import json, math, sys
state = json.load(open(sys.argv[1] + "/trainer_state.json"))
results = json.load(open(sys.argv[1] + "/all_results.json"))
logs = [h for h in state["log_history"] if "loss_adv" in h]
assert logs, "no loss_adv in the training logs"
assert all(math.isfinite(h["loss_adv"]) and math.isfinite(h["loss_clean"]) for h in logs), "non-finite loss"
clean, adv, skipped, steps = logs[-1]["loss_clean"], logs[-1]["loss_adv"], logs[-1]["adv_skipped"], state["global_step"]
assert skipped <= steps / 4, f"attack skipped on {skipped} of {steps} steps"
f1 = results["eval_f1"]
print(f"loss_clean {clean:.3f}, loss_adv {adv:.3f}, adv_skipped {skipped}/{steps}, eval_f1 {f1:.3f}")
'
ner_run() {
    local name=$1 method=$2
    shift 2
    local precision=("$@")
    run_step "$name" 90 "$PY" -m accelerate.commands.launch "${LAUNCH[@]}" "${precision[@]:0:2}" recipes/ner.py \
        --output_dir "$OUT/$name" --tricks none --adversarial "$method" "${NER_SIZE[@]}" "${precision[@]:2}" \
        --eval_strategy no --learning_rate 1e-4 --disable_tqdm true --seed 0
    DETAILS=""
    check "$name" "$NER_CHECK"
    record "$name" "$DETAILS"
}
# Arguments after the method: two for `accelerate launch` (its --mixed_precision), then the recipe's own flags.
if [[ "$DEVICE" == cuda ]]; then
    ner_run ner_fp16_fgm fgm --mixed_precision fp16
    ner_run ner_fp16_pgd pgd --mixed_precision no --fp16 true
else
    echo "== ner_fp16_*: skipped in the CPU dry run (Accelerate trains fp16 only on CUDA)" >&2
fi
ner_run ner_bf16_fgm fgm --mixed_precision bf16
ner_run ner_bf16_pgd pgd --mixed_precision no --bf16 true

# ---- 3. Summarization with scheduled sampling ----
SUM_CHECK='
import json, math, sys
state = json.load(open(sys.argv[1] + "/trainer_state.json"))
results = json.load(open(sys.argv[1] + "/all_results.json"))
logs = [h for h in state["log_history"] if "teacher_forcing_ratio" in h]
assert logs, "no teacher_forcing_ratio in the training logs"
ratios = [h["teacher_forcing_ratio"] for h in logs]
assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1.0, f"the ratio did not fall: {ratios}"
assert all(math.isfinite(h["loss"]) for h in logs), "non-finite loss"
loss, rouge = logs[-1]["loss"], results["eval_rougeL"]
print(f"teacher_forcing_ratio {ratios[0]:.2f} -> {ratios[-1]:.2f}, loss {loss:.3f}, eval_rougeL {rouge:.3f}")
'
SUM_PRECISION=(--fp16 true)
[[ "$DEVICE" == cuda ]] || SUM_PRECISION=(--bf16 true --use_cpu true)
run_step summarization_ss 120 "$PY" -m accelerate.commands.launch "${LAUNCH[@]}" recipes/summarization.py \
    --output_dir "$OUT/summarization_ss" --scheduled_sampling linear --ss_k "$SS_K" "${SUM_SIZE[@]}" \
    "${SUM_PRECISION[@]}" --eval_strategy no --logging_steps 1 --disable_tqdm true --seed 0
DETAILS=""
check summarization_ss "$SUM_CHECK"
record summarization_ss "$DETAILS"

# ---- 4. Benchmarks ----
run_step bench_adversarial 150 "$PY" benchmarks/adversarial.py "${BENCH[@]}"
record bench_adversarial "$(grep -E '^FGM / plain:' "$OUT/bench_adversarial.log" | head -n 1)"
run_step bench_scheduled_sampling 90 "$PY" benchmarks/scheduled_sampling.py "${BENCH[@]}"
record bench_scheduled_sampling \
    "$(grep -E '^\| (scheduled_sampling \(argmax\)|naive)' "$OUT/bench_scheduled_sampling.log" |
        awk -F'|' '{printf "%s x%s;", $2, $4}')"

# ---- The table ----
{
    echo
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%MZ) on $WHERE; torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'); $((SECONDS - START)) s"
    echo
    echo "| step | status | s | details |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/summary.md"
echo "Logs and outputs: $OUT"
exit $FAILED
