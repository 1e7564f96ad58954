#!/usr/bin/env bash
# One prepared GPU check for a single H100/H200 (about 7 minutes, no downloads):
#   1. the CUDA tests (flex_attention vs the dense-mask path, bf16 vs fp32 training);
#   2. Stack-100M on the built-in corpus, compile + bf16, micro-batch 32 x 2,048, no
#      activation checkpointing, for STEPS steps: tokens/s, MFU in both conventions, peak
#      memory beside the start-up estimate;
#   3. the FSDP2 path (accelerate_configs/fsdp2.yaml) with one process for a few steps,
#      then the same command again, which resumes from the checkpoint the first one saved.
# It ends with one JSON line of figures.   Usage: bash bench/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gpu_check}
steps=${STEPS:-150}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python -m pytest -q -m cuda tests/ 2>&1 | tee "$out/cuda_tests.log"
[ -f data/stdlib-32k/manifest.json ] || python prepare.py | tail -n 3

# Stack-100M for $steps steps. stop_at_step < the decay start, so the schedule is the
# reference one; evaluation and checkpoints are pushed past the end of this check.
python train.py --preset=stack100m --out_dir="$out/stack100m" --resume=none \
  --stop_at_step="$steps" --eval_every=100000 --ckpt_every=100000 --log_every=10 \
  2>&1 | grep -v "it/s]" | tee "$out/stack100m.log"

# FSDP2 with one process: 6 steps and a checkpoint, then resume to step 12.
fsdp=(accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1
      train.py --preset=stack100m --out_dir="$out/fsdp2" --compile_model=false
      --log_every=1 --eval_every=100000 --ckpt_every=100000)
"${fsdp[@]}" --stop_at_step=6 2>&1 | grep -v "it/s]" | tee "$out/fsdp2_first.log"
"${fsdp[@]}" --stop_at_step=12 2>&1 | grep -v "it/s]" | tee "$out/fsdp2_resumed.log"

python - "$out" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
records = [json.loads(l) for l in (out / "stack100m/metrics.jsonl").read_text().splitlines()]
train = [r for r in records if "tokens_per_s" in r]
steady = [r for r in train if r["step"] > 30] or train  # after compile and warm-up
estimate = re.search(r"= ([\d.]+) GiB", (out / "stack100m.log").read_text())
fsdp = [json.loads(l) for l in (out / "fsdp2/metrics.jsonl").read_text().splitlines()]
fsdp_steps = [r["step"] for r in fsdp if "tokens_per_s" in r]
resumed = "resumed from" in (out / "fsdp2_resumed.log").read_text()
tests = (out / "cuda_tests.log").read_text().strip().splitlines()[-1]
print(json.dumps({
    "bench": "gpu_check", "cuda_tests": tests,
    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
    "mfu_causal": statistics.median(r["mfu"] for r in steady),
    "mfu_palm": statistics.median(r["mfu_palm"] for r in steady),
    "peak_memory_gib": max(r["memory_gib"] for r in train),
    "memory_estimate_gib": float(estimate.group(1)) if estimate else None,
    "final_loss": train[-1]["loss"], "steps": train[-1]["step"],
    "fsdp2_steps": fsdp_steps, "fsdp2_resumed": resumed,
    "fsdp2_final_loss": [r["loss"] for r in fsdp if "tokens_per_s" in r][-1]}))
EOF
