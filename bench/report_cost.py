"""What the run report costs the Stack-100M reference run.

    python bench/report_cost.py [--rounds 3] [--tokens_per_s 560000]

A synthetic metrics.jsonl the size of the reference run's (34,332 steps: a log line every
10 steps, 36 evaluations, a checkpoint every 1,000 steps and at the last step, the start,
sample and end records) is reported, side by side in one process:
  cold        `python report.py OUT_DIR --quiet`, a fresh interpreter, as the run starts it
  in_process  report.write in this process once its imports are warm
  spawn       what the training process itself pays to start the report at a checkpoint
              (subprocess.Popen returning; the drawing then runs on another core)
Each is the median of --rounds. Set beside the reference run's wall time at
--tokens_per_s (README's target: 45% MFU on one H200 ≈ 560k tokens/s; 8 GPUs divide it by
8), the run's 35 checkpoint reports (1,000, …, 34,000 and the last step) and its final one
cost the training process 35 × spawn + 1 × cold (the final report is waited for), and at
most 36 × cold of another core's time.

Prints one JSON line.
"""

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere
import config  # noqa: E402
import report  # noqa: E402
from plumbing import cli  # noqa: E402


def synthetic_log(out_dir: Path, steps: int, log_every: int, eval_every: int,
                  ckpt_every: int) -> int:
    """A reference-sized metrics.jsonl with plausible curves; returns its size in bytes."""
    cfg = config.stack100m()
    phases = config.wsd_phases(cfg)
    batch = cfg.global_batch_tokens
    start = {"kind": "start", "step": 0, "tokens_seen": 0, "time": "synthetic",
             "preset": "stack100m", "preset_changes": [], "config": dataclasses.asdict(cfg),
             "revision": "synthetic", "plan": [{"start": 0, "source": cfg.data_dir, "weight": 1.0,
                                                "available": 20 * 10**9,
                                                "planned": steps * batch}],
             "hardware": {"world": 8, "device": "cuda:0", "distributed": "MULTI_GPU",
                          "precision": "bf16", "compiled": True, "device_name": "NVIDIA H200"},
             "phases": phases._asdict(), "resumed_from": None, "resume_changes": []}
    lines = [start]
    for step in range(0, steps + 1):
        loss = 2.5 + 8 / math.sqrt(1 + step / 50) + 0.05 * math.sin(step)
        if step and (step % log_every == 0 or step == steps):
            lines.append({"kind": "train", "step": step, "loss": loss, "ce": loss - 0.01,
                          "z": 0.01, "grad_norm": 0.3 + 0.1 * math.cos(step),
                          "lr_muon": 0.006, "lr_adamw": 0.003, "tokens_seen": step * batch,
                          "tokens_per_s": 4.5e6, "tflops": 3800.0, "mfu": 0.48,
                          "memory_gib": 60.0, "skipped_steps": 0, "elapsed_s": step * 0.117})
        if step % eval_every == 0 or step == steps:
            lines.append({"kind": "eval", "step": step, "tokens_seen": step * batch,
                          "val_loss": loss + 0.05, "val_bpb": (loss + 0.05) / 2.3})
        if step and (step % ckpt_every == 0 or step == steps):  # the last step is saved too
            lines.append({"kind": "checkpoint", "step": step, "seconds": 8.0})
    lines += [{"kind": "sample", "step": steps, "prompt": "def ", "text": "def main():"},
              {"kind": "end", "step": steps, "outcome": "finished", "error": None,
               "elapsed_s": steps * 0.117}]
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (out_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
    return len(text)


def median_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=cli.at_least(1), default=34_332)
    parser.add_argument("--log_every", type=cli.at_least(1), default=10)
    parser.add_argument("--eval_every", type=cli.at_least(1), default=1_000)
    parser.add_argument("--ckpt_every", type=cli.at_least(1), default=1_000)
    parser.add_argument("--rounds", type=cli.at_least(1), default=3)
    parser.add_argument("--tokens_per_s", type=float, default=560_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference"
        size = synthetic_log(out, args.steps, args.log_every, args.eval_every, args.ckpt_every)
        command = [sys.executable, str(REPO / "report.py"), str(out), "--quiet"]
        report.write([out])  # warm: imports and font cache
        in_process = median_seconds(lambda: report.write([out]), args.rounds)
        cold = median_seconds(lambda: subprocess.run(command, check=True), args.rounds)
        spawned = []
        spawn = median_seconds(lambda: spawned.append(subprocess.Popen(
            command, start_new_session=True)), args.rounds)
        for process in spawned:
            process.wait()
        run = report.read_run(out)
    tokens = args.steps * config.stack100m().global_batch_tokens
    wall = tokens / args.tokens_per_s
    reports = len(run.records["checkpoint"]) + 1
    on_training = (reports - 1) * spawn + cold
    print(json.dumps({
        "metrics_bytes": size, "train_records": len(run.records["train"]),
        "evals": len(run.records["eval"]), "reports_per_run": reports,
        "cold_s": round(cold, 3), "in_process_s": round(in_process, 3),
        "spawn_s": round(spawn, 4),
        "reference_wall_s_one_gpu": round(wall), "reference_wall_s_8_gpus": round(wall / 8),
        "training_process_share_one_gpu": on_training / wall,
        "training_process_share_8_gpus": on_training / (wall / 8),
        "all_reports_serial_share_one_gpu": reports * cold / wall,
        "all_reports_serial_share_8_gpus": reports * cold / (wall / 8),
    }))


if __name__ == "__main__":
    main()
