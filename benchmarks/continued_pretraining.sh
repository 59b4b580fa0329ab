#!/usr/bin/env bash
# Classification on 50 BBC News articles with and without continued pretraining: docs/recipes.md, "Continued
# pretraining". Hours on a shared 2-core CPU (each run's wall and CPU time go to $OUT/times.txt).
#
#   bash benchmarks/continued_pretraining.sh [OUT] [SEEDS]     # defaults: outputs/continued_pretraining, "1 2 3"
#
# Each run's output folder is named after it; a finished one (all_results.json) is not run again.
#
# 1. pretrained: the pretraining recipe's default demo run (100 steps of masked LM on the BBC articles that the
#    classification demo does not test on).
# 2. control: the same recipe at learning rate 0 (one step): MiniLM's weights unchanged, but saved as the masked LM
#    saves them (without BERT's pooler, which a classifier then starts fresh), to tell the pooler from the pretraining.
# 3. classification (same 50 training articles, same validation / test articles) from MiniLM, the control and the
#    pretrained folder, once per seed.
set -euo pipefail
OUT=${1:-outputs/continued_pretraining}
SEEDS=${2:-1 2 3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1
mkdir -p "$OUT"
LAUNCH=(accelerate launch -q --config_file accelerate_configs/cpu.yaml)
CLASSIFY=(--tricks none --max_train_samples 50 --num_train_epochs 10 --eval_strategy no --disable_tqdm true)

run() {  # name, command...; a run whose all_results.json exists is kept (rerun the script to add seeds)
    local name=$1
    shift
    if [[ -f "$OUT/$name/all_results.json" ]]; then return; fi
    echo "$(date +%T) $name: $*" >&2
    /usr/bin/time -f "$name %e s wall, %U s user, %S s sys" -a -o "$OUT/times.txt" "$@" >"$OUT/$name.log" 2>&1
    echo "$(date +%T) $name done; load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/times.txt" >&2
}

run pretrained "${LAUNCH[@]}" recipes/pretraining.py --output_dir "$OUT/pretrained" --disable_tqdm true
run control "${LAUNCH[@]}" recipes/pretraining.py --output_dir "$OUT/control" --learning_rate 0 --max_steps 1 \
    --max_eval_samples 32 --disable_tqdm true
for seed in $SEEDS; do
    run "minilm_seed$seed" "${LAUNCH[@]}" recipes/classification.py "${CLASSIFY[@]}" --seed "$seed" \
        --output_dir "$OUT/minilm_seed$seed"
    run "pretrained_seed$seed" "${LAUNCH[@]}" recipes/classification.py "${CLASSIFY[@]}" --seed "$seed" \
        --model_name_or_path "$OUT/pretrained" --output_dir "$OUT/pretrained_seed$seed"
    run "control_seed$seed" "${LAUNCH[@]}" recipes/classification.py "${CLASSIFY[@]}" --seed "$seed" \
        --model_name_or_path "$OUT/control" --output_dir "$OUT/control_seed$seed"
done

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
pre = json.loads((out / "pretrained" / "all_results.json").read_text())
print(f"masked LM: held-out loss {pre['eval_loss_before']:.3f} -> {pre['eval_loss']:.3f} "
      f"(perplexity {pre['eval_perplexity_before']:.0f} -> {pre['eval_perplexity']:.0f})")
print("| start | seed | eval accuracy | eval macro-F1 | test accuracy | test macro-F1 |")
print("|---|---|---|---|---|---|")
for path in sorted(out.glob("*_seed*/all_results.json")):
    r = json.loads(path.read_text())
    start, seed = path.parent.name.rsplit("_seed", 1)
    print(f"| {start} | {seed} | {r['eval_accuracy']:.3f} | {r['eval_f1']:.3f} | {r['test_accuracy']:.3f} | "
          f"{r['test_f1']:.3f} |")
PY
