#!/usr/bin/env bash
# One prepared GPU check for a single H100/H200 (about 7 minutes, no downloads):
#   1. the CUDA tests (flex_attention vs the dense-mask path, bf16 vs fp32 training, pinned
#      memory);
#   2. Stack-100M on the built-in corpus, compile + bf16, micro-batch 32 x 2,048, no
#      activation checkpointing, for STEPS steps: tokens/s, MFU in both conventions, peak
#      memory beside the start-up estimate;
#   3. the FSDP2 path (accelerate_configs/fsdp2.yaml) with one process for a few steps,
#      then the same command again, which resumes from the checkpoint the first one saved:
#      train.py's own sharding, the path tests/test_fsdp.py runs on CPU processes.
# Every stage runs whatever the one before did (a lent GPU gives one call), and the check
# ends with one JSON line: each stage's exit status, and the figures of those that ran.
#   Usage: bash bench/gpu_check.sh [--quick] [OUT_DIR]
# --quick (about 3 minutes) skips 2., which bench/gpu_sweep.py's `default` row measures,
# and runs 3. for 2 + 2 steps: `bash bench/gpu_check.sh --quick; python
# bench/gpu_sweep.py --budget_s=300 --steps=15` fits one 9-minute device call.
set -uo pipefail
cd "$(dirname "$0")/.."
quick=false
if [ "${1:-}" = "--quick" ]; then quick=true; shift; fi
out=${1:-/tmp/gpu_check}
steps=${STEPS:-150}  # 150 steps read the built-in corpus ~10 times: within --max_epochs=16
fsdp_steps=6
if $quick; then fsdp_steps=2; fi
mkdir -p "$out"
# A rerun starts afresh: it never resumes an old run, nor reports an old stage's status.
rm -rf "$out/stack100m" "$out/fsdp2" && rm -f "$out"/*.status
export PYTHONUNBUFFERED=1

stage() {  # stage NAME COMMAND...: run it, its output to the terminal and $out/NAME.log,
  local name=$1; shift  # its exit status to $out/NAME.status
  "$@" 2>&1 | grep --line-buffered -v "it/s]" | tee "$out/$name.log"
  echo "${PIPESTATUS[0]}" > "$out/$name.status"
}

stage cuda_tests python -m pytest -q -m cuda tests/
[ -f data/stdlib-32k/manifest.json ] || stage prepare python prepare.py

# Stack-100M for $steps steps. stop_at_step < the decay start, so the schedule is the
# reference one; evaluation and checkpoints are pushed past the end of this check.
$quick || stage stack100m python train.py --preset=stack100m --out_dir="$out/stack100m" \
  --resume=none --stop_at_step="$steps" --eval_every=100000 --ckpt_every=100000 --log_every=10

# FSDP2 with one process: $fsdp_steps steps and a checkpoint, then resume to twice that.
fsdp=(accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1
      train.py --preset=stack100m --out_dir="$out/fsdp2" --compile_model=false
      --log_every=1 --eval_every=100000 --ckpt_every=100000)
stage fsdp2_first "${fsdp[@]}" --stop_at_step=$fsdp_steps
stage fsdp2_resumed "${fsdp[@]}" --stop_at_step=$((2 * fsdp_steps))

python - "$out" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])

def text(name):  # a file the check wrote, or "" where its stage did not run or write it
    path = out / name
    return path.read_text() if path.exists() else ""

def records(run):
    return [json.loads(l) for l in text(f"{run}/metrics.jsonl").splitlines() if l.strip()]

stages = {name: int(text(f"{name}.status")) if text(f"{name}.status") else "skipped"
          for name in ("cuda_tests", "prepare", "stack100m", "fsdp2_first", "fsdp2_resumed")}
train = [r for r in records("stack100m") if r["kind"] == "train"]
steady = [r for r in train if r["step"] > 30] or train  # after compile and warm-up
median = lambda key: statistics.median(r[key] for r in steady) if steady else None
estimate = re.search(r"= ([\d.]+) GiB", text("stack100m.log"))
fsdp = [r for r in records("fsdp2") if r["kind"] == "train"]
tests = text("cuda_tests.log").strip().splitlines()
print(json.dumps({
    "bench": "gpu_check", "stages": stages, "cuda_tests": tests[-1] if tests else None,
    "tokens_per_s": median("tokens_per_s"), "mfu_causal": median("mfu"),
    "mfu_palm": median("mfu_palm"),
    "peak_memory_gib": max((r["memory_gib"] for r in train), default=None),
    "memory_estimate_gib": float(estimate.group(1)) if estimate else None,
    "final_loss": train[-1]["loss"] if train else None,
    "steps": train[-1]["step"] if train else None,
    "fsdp2_steps": [r["step"] for r in fsdp],
    "fsdp2_resumed": "resumed from" in text("fsdp2_resumed.log"),
    "fsdp2_final_loss": fsdp[-1]["loss"] if fsdp else None}))
failed = [name for name, status in stages.items() if status not in (0, "skipped")]
sys.exit(1 if failed else 0)
EOF
