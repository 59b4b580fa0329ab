#!/usr/bin/env bash
# The example plots of docs/recipes.md#plots-of-a-run: one short demo run of each kind (NER, classification,
# summarization, self-training), then `nlp-tricks plot` on it, and the PNGs copied to docs/images/plot_*.png.
#
#   bash scripts/plot_examples.sh            # from a checkout with ".[demo,plot]" installed; runs in PLOT_EXAMPLES_OUT
#
# The runs are kept short (a few dozen optimizer steps on a part of each demo) so the script finishes in minutes on a
# CPU: the plots show what each PNG holds, not how well a full run does (docs/recipes.md has the measured demos).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${PLOT_EXAMPLES_OUT:-outputs/plot_examples}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
COMMON=(--overwrite_output_dir true --disable_tqdm true)

python recipes/ner.py --output_dir "$OUT/ner" "${COMMON[@]}" --max_train_samples 160 --num_train_epochs 1 \
    --per_device_train_batch_size 8 --learning_rate 5e-4 --max_seq_length 64 --eval_strategy steps --eval_steps 5 \
    --logging_steps 5 --max_eval_samples 60
python recipes/classification.py --output_dir "$OUT/classification" "${COMMON[@]}" --max_train_samples 160 \
    --num_train_epochs 1 --per_device_train_batch_size 8 --max_seq_length 64 --eval_strategy steps --eval_steps 5 \
    --logging_steps 5 --max_eval_samples 60
python recipes/summarization.py --output_dir "$OUT/summarization" "${COMMON[@]}" --max_train_samples 48 \
    --num_train_epochs 3 --per_device_train_batch_size 8 --max_source_length 128 --logging_steps 2 \
    --max_eval_samples 8 --generation_max_length 32
python recipes/self_training.py --output_dir "$OUT/self_training" "${COMMON[@]}" --task classification \
    --unlabeled_fraction 0.5 --rounds 2 --max_train_samples 96 --num_train_epochs 1 --per_device_train_batch_size 8 \
    --max_seq_length 64 --max_eval_samples 60 --logging_steps 2

for run in ner classification summarization self_training; do
    python -m nlp_tricks.cli plot "$OUT/$run"
done
cp "$OUT/ner/eval.png" docs/images/plot_ner_eval.png
cp "$OUT/classification/eval.png" docs/images/plot_classification_eval.png
cp "$OUT/summarization/eval.png" docs/images/plot_summarization_eval.png
cp "$OUT/self_training/self_training.png" docs/images/plot_self_training.png
