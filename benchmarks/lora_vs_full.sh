#!/usr/bin/env bash
# Full fine-tuning vs LoRA on SmolLM2-135M-Instruct, the same GRPO config, run one after the other in
# pairs (full, LoRA, full, LoRA, ... for PAIRS pairs), each a fresh `gcore fit` process. Writes each
# run's metrics under OUT/<variant>-<i>/ and `uptime` before each run to OUT/load.txt; summarise with
# `python benchmarks/lora_vs_full_summary.py OUT`.
#   usage: benchmarks/lora_vs_full.sh MODEL_DIR OUT [STEPS] [PAIRS]
set -euo pipefail
model=$1 out=$2 steps=${3:-8} pairs=${4:-1}
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  for variant in full lora; do
    extra=()
    if [ "$variant" = lora ]; then extra=(--config examples/real_model/grpo_smollm2_compare_lora.yaml); fi
    echo "$variant-$i $(date -u +%H:%M:%S) $(uptime)" >> "$out/load.txt"
    OMP_NUM_THREADS=2 /usr/bin/time -v -o "$out/$variant-$i.time" gcore fit \
      --config examples/real_model/grpo_smollm2_compare.yaml "${extra[@]}" --model.path "$model" \
      --trainer.max_steps "$steps" --trainer.eval_every "$steps" --trainer.enable_progress_bar false \
      --trainer.default_root_dir "$out/$variant-$i" > "$out/$variant-$i.log" 2>&1
  done
done
