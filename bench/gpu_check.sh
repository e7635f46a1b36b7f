#!/usr/bin/env bash
# GPU check of the trainer's mixed-precision paths: fp16 (dynamic loss scaling) and bf16, ZeRO-2, on an MoE
# recipe for 50 steps each, on all GPUs of this machine. Prints one line per run and fails if a run does not
# finish, produces a non-finite loss, or does not lower the loss.
#
#   bash bench/gpu_check.sh                       # CONFIG=configs/nova_moe.yaml NGPU=<all> STEPS=50
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/nova_moe.yaml}
STEPS=${STEPS:-50}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
OUT=${OUT:-runs/gpu_check}
for precision in fp16 bf16; do
    run="$OUT/$precision"
    rm -rf "$run"
    deepspeed --num_gpus "$NGPU" pretrain.py --ds_config "ds_configs/zero2_${precision}.json" --config "$CONFIG" \
        --set "train.max_steps=$STEPS" train.log_every=5 "train.output_dir=$run" train.eval_every=null \
        train.checkpoint.every_steps=null train.micro_batch_size=8 data.source=builtin:16
    python - "$run" "$precision" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
losses = [r["loss"] for r in rows if "loss" in r]
ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
extra = f" loss_scale {rows[-1].get('loss_scale')} skipped {rows[-1].get('skipped_steps', 0)}" if sys.argv[2] == "fp16" else ""
print(f"{sys.argv[2]}: steps {rows[-1]['step']} loss {losses[0]:.3f} -> {losses[-1]:.3f} "
      f"tokens/s {rows[-1]['tokens_per_s']:.0f} mfu {rows[-1].get('mfu', float('nan')):.3f}{extra} "
      f"{'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
done
