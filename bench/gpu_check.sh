#!/usr/bin/env bash
# The first lent GPU's one prepared call: at most 9 minutes on one H100/H200, no downloads.
# docs/figures.md gives its budget stage by stage, and the second call's plan. In order:
#   versions     python, torch, CUDA, accelerate and the GPU, written first; every import
#                the call needs, checked: one missing is one line, and the call stops;
#   prepare      the built-in corpus (data/stdlib-32k), if missing;
#   cuda_tests   the tests that skip without CUDA (the files that mark them, found by grep);
#   fsdp2_first  Stack-100M as docs/scale.md runs it: accelerate launch with fsdp2.yaml,
#                one process, compiled blocks, bf16, FIRST_STEPS steps and a checkpoint
#                (tokens/s, MFU, peak memory beside the banner's estimate);
#   fsdp2_resumed  the same command to RESUMED_STEPS: it resumes from that checkpoint;
#   sweep        bench/gpu_sweep.py's rows in the docs' order, each bounded, in the time left.
# Each stage has its own bound (timeout) and runs whatever the one before did (a lent GPU
# gives one call). Logs, figures and one JSON line go to $OUT (the device tool's folder;
# /tmp/gpu_check without it); the checkpoints, gigabytes, to $RUNS (/tmp/gpu_check_runs).
#   Usage: bash bench/gpu_check.sh [--dry_run]
# --dry_run runs every stage on a CPU at micro shapes, uncompiled, in fp32 (the tests do).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=false
if [ "${1:-}" = "--dry_run" ]; then dry=true; shift; fi
out=${OUT:-/tmp/gpu_check}
runs=${RUNS:-/tmp/gpu_check_runs}
# A rerun starts afresh: it never resumes an old run, nor reports an old stage's status.
rm -rf "$runs" && mkdir -p "$out" "$runs" && rm -f "$out"/*.status "$out"/*.seconds
export PYTHONUNBUFFERED=1
call_s=530  # the call's whole budget, under the device tool's 9 minutes
started=$SECONDS

if $dry; then
  preset=tiny
  # bounds in seconds: versions prepare cuda_tests fsdp2_first fsdp2_resumed (generous for
  # a loaded CPU; the stages take seconds)
  bounds=(60 300 120 120 120)
  first_steps=2; resumed_steps=3
  shape=(--model.n_layers=1 --model.d_model=64 --model.intermediate=176 --seq_len=16
         --micro_batch_size=8 --global_batch_tokens=256 --eval_tokens=256
         --downstream_items=4 --compile_model=false --mixed_precision=no)
  sweep=(--dry-run)
else
  preset=stack100m
  bounds=(30 60 90 150 90)
  first_steps=12; resumed_steps=18
  shape=(--eval_tokens=65536 --compile_model=true --mixed_precision=bf16)
  sweep=(--steps=5 --warmup=1 --min_variant_s=20)
fi

stage() {  # stage NAME BOUND COMMAND...: run it within BOUND seconds, its output to the
  local name=$1 bound=$2 from=$SECONDS; shift 2  # terminal and $out/NAME.log, its exit
  timeout --kill-after=10 "$bound" "$@" 2>&1 | grep --line-buffered -v "it/s]" \
    | tee "$out/$name.log"  # status to NAME.status and its seconds to NAME.seconds
  echo "${PIPESTATUS[0]}" > "$out/$name.status"
  echo $((SECONDS - from)) > "$out/$name.seconds"
}

stage versions "${bounds[0]}" python - "$out/versions.json" <<'EOF'
import importlib, json, platform, sys
needed = ["torch", "accelerate", "numpy", "tokenizers", "tqdm", "matplotlib", "pytest",
          "safetensors", "psutil"]  # requirements.txt but wandb, which the call leaves off
import torch
if torch.cuda.is_available():
    needed.append("triton")  # torch.compile's GPU kernels
for name in needed:
    try:
        importlib.import_module(name)
    except Exception as e:  # one line, then the call stops: nothing after it could run
        print(f"versions: cannot import {name} ({type(e).__name__}: {e}); install it "
              f"(pip install -r requirements.txt) and run the call again", file=sys.stderr)
        sys.exit(2)
import accelerate
versions = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "accelerate": accelerate.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            **{name: getattr(sys.modules[name], "__version__", None) for name in needed}}
print(json.dumps(versions))
open(sys.argv[1], "w").write(json.dumps(versions))
EOF
if [ "$(cat "$out/versions.status")" != 0 ]; then
  echo "gpu_check: stopped: the versions stage failed ($out/versions.log)" >&2
  exit 2
fi

stage prepare "${bounds[1]}" python -c "import config, prepare
cfg = config.$preset()
prepare.ensure_builtin([cfg.data_dir], cfg.model.vocab_size)"

mapfile -t cuda_files < <(grep -l "mark.cuda" tests/test_*.py)
stage cuda_tests "${bounds[2]}" python -m pytest -q -m cuda "${cuda_files[@]}"

# The production path. Evaluation and the end's sample run, as in any run; a small
# eval_tokens keeps them short.
fsdp=(accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 1
      train.py --preset=$preset --out_dir="$runs/fsdp2" --log_every=1 --eval_every=100000
      --ckpt_every=$first_steps "${shape[@]}")
stage fsdp2_first "${bounds[3]}" "${fsdp[@]}" --resume=none --stop_at_step=$first_steps
stage fsdp2_resumed "${bounds[4]}" "${fsdp[@]}" --stop_at_step=$resumed_steps
cp "$runs/fsdp2/metrics.jsonl" "$out/fsdp2.metrics.jsonl" 2>/dev/null
ls "$runs/fsdp2/ckpt" > "$out/fsdp2.checkpoints" 2>/dev/null

left=$((call_s - (SECONDS - started) - 15))  # 15 s for the report
stage sweep $((left + 30)) python bench/gpu_sweep.py "${sweep[@]}" --budget_s=$left

python - "$out" "$first_steps" "$resumed_steps" <<'EOF'
import json, re, statistics, sys
from pathlib import Path
out, first_steps, resumed_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
NAMES = ("versions", "prepare", "cuda_tests", "fsdp2_first", "fsdp2_resumed", "sweep")

def text(name):  # a file the call wrote, or "" where its stage did not run or write it
    path = out / name
    return path.read_text() if path.exists() else ""

def last_json(name):
    lines = [l for l in text(name).splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None

stages = {name: {"status": int(text(f"{name}.status") or -1),
                 "seconds": int(text(f"{name}.seconds") or 0)} for name in NAMES}
records = [json.loads(l) for l in text("fsdp2.metrics.jsonl").splitlines() if l.strip()]
train = [r for r in records if r["kind"] == "train"]
steady = [r for r in train if 3 < r["step"] <= first_steps] or train  # after compile
def median(key):  # None where no step has the figure (MFU on a CPU)
    values = [r[key] for r in steady if r.get(key) is not None]
    return statistics.median(values) if values else None
estimate = re.search(r"memory estimate per rank: .*= ([\d.]+) GiB", text("fsdp2_first.log"))
tests = text("cuda_tests.log").strip().splitlines()
sweep = last_json("sweep.log")
print(json.dumps({
    "bench": "gpu_check", "versions": last_json("versions.json"), "stages": stages,
    "seconds": sum(s["seconds"] for s in stages.values()),
    "cuda_tests": tests[-1] if tests else None,
    "tokens_per_s": median("tokens_per_s"), "mfu_causal": median("mfu"),
    "mfu_palm": median("mfu_palm"),
    "peak_memory_gib": max((r["memory_gib"] for r in train), default=None),
    "memory_estimate_gib": float(estimate.group(1)) if estimate else None,
    "saved": f"step_{first_steps:07d}" in text("fsdp2.checkpoints"),
    "resumed": "resumed from" in text("fsdp2_resumed.log"),
    "steps": [r["step"] for r in train],
    "final_loss": train[-1]["loss"] if train else None,
    "sweep": [{k: row[k] for k in ("name", "tokens_per_s", "mfu", "peak_gib", "loss",
                                   "seconds", "error")} for row in sweep["variants"]]
    if sweep else None}))
sys.exit(1 if any(s["status"] != 0 for s in stages.values()) else 0)
EOF
