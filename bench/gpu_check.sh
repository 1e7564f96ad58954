#!/usr/bin/env bash
# One prepared GPU check for a single H100/H200 (about 7 minutes, no downloads):
#   1. the CUDA tests (flex_attention vs the dense-mask path, bf16 vs fp32 training);
#   2. Stack-100M on the built-in corpus, compile + bf16, micro-batch 32 x 2,048, no
#      activation checkpointing, for STEPS steps: tokens/s, MFU in both conventions, peak
#      memory beside the start-up estimate;
#   3. the FSDP2 path (accelerate_configs/fsdp2.yaml) with one process for a few steps,
#      then the same command again, which resumes from the checkpoint the first one saved:
#      train.py's own sharding, the path tests/test_fsdp.py runs on CPU processes.
# It ends with one JSON line of figures.   Usage: bash bench/gpu_check.sh [--quick] [OUT_DIR]
# --quick (about 3 minutes) skips 2., which bench/gpu_sweep.py's `default` row measures,
# and runs 3. for 2 + 2 steps: `bash bench/gpu_check.sh --quick; python
# bench/gpu_sweep.py --budget_s=300 --steps=15` fits one 9-minute device call.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=false
if [ "${1:-}" = "--quick" ]; then quick=true; shift; fi
out=${1:-/tmp/gpu_check}
steps=${STEPS:-150}
fsdp_steps=6
if $quick; then fsdp_steps=2; fi
rm -rf "$out/stack100m" "$out/fsdp2"  # a rerun starts afresh, never resumes an old run
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python -m pytest -q -m cuda tests/ 2>&1 | tee "$out/cuda_tests.log"
[ -f data/stdlib-32k/manifest.json ] || python prepare.py | tail -n 3

# Stack-100M for $steps steps. stop_at_step < the decay start, so the schedule is the
# reference one; evaluation and checkpoints are pushed past the end of this check.
$quick || python train.py --preset=stack100m --out_dir="$out/stack100m" --resume=none \
  --stop_at_step="$steps" --eval_every=100000 --ckpt_every=100000 --log_every=10 \
  2>&1 | grep -v "it/s]" | tee "$out/stack100m.log"

# FSDP2 with one process: $fsdp_steps steps and a checkpoint, then resume to twice that.
fsdp=(accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1
      train.py --preset=stack100m --out_dir="$out/fsdp2" --compile_model=false
      --log_every=1 --eval_every=100000 --ckpt_every=100000)
"${fsdp[@]}" --stop_at_step=$fsdp_steps 2>&1 | grep -v "it/s]" | tee "$out/fsdp2_first.log"
"${fsdp[@]}" --stop_at_step=$((2 * fsdp_steps)) 2>&1 | grep -v "it/s]" \
  | tee "$out/fsdp2_resumed.log"

python - "$out" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
metrics = out / "stack100m/metrics.jsonl"  # absent with --quick
records = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
train = [r for r in records if "tokens_per_s" in r]
steady = [r for r in train if r["step"] > 30] or train  # after compile and warm-up
median = lambda key: statistics.median(r[key] for r in steady) if steady else None
log = out / "stack100m.log"
estimate = re.search(r"= ([\d.]+) GiB", log.read_text()) if metrics.exists() else None
fsdp = [json.loads(l) for l in (out / "fsdp2/metrics.jsonl").read_text().splitlines()]
fsdp_steps = [r["step"] for r in fsdp if "tokens_per_s" in r]
resumed = "resumed from" in (out / "fsdp2_resumed.log").read_text()
tests = (out / "cuda_tests.log").read_text().strip().splitlines()[-1]
print(json.dumps({
    "bench": "gpu_check", "cuda_tests": tests,
    "tokens_per_s": median("tokens_per_s"), "mfu_causal": median("mfu"),
    "mfu_palm": median("mfu_palm"),
    "peak_memory_gib": max((r["memory_gib"] for r in train), default=None),
    "memory_estimate_gib": float(estimate.group(1)) if estimate else None,
    "final_loss": train[-1]["loss"] if train else None,
    "steps": train[-1]["step"] if train else None,
    "fsdp2_steps": fsdp_steps, "fsdp2_resumed": resumed,
    "fsdp2_final_loss": [r["loss"] for r in fsdp if "tokens_per_s" in r][-1]}))
EOF
