"""Crash and preemption trials: kill -9 and SIGTERM at random moments, then resume.

    python bench/crash_resume.py --kills 10 --signals 10
    python bench/crash_resume.py --kills 10 --signals 10 --ckpt_async   # background saves

A 2-layer model on a small slice of the built-in corpus (prepared on first use) trains for
`--steps` steps, checkpointing every 2, with one line of metrics per step.
- kill: `kill -9` at a random moment of a run (start-up, a step, a checkpoint write,
  evaluation), then the same command again until the run finishes; the final weights must
  equal, bit for bit, those of a run never interrupted.
- signal: SIGTERM at a random moment of training; the run must exit 0 having saved the
  step in flight: `extra_steps` = saved step − (last step logged before the signal + 1)
  is 0 when it does, −1 when the signal lands between a step's end and its log line, and
  1 if the run went on for a full step more.
With --ckpt_async every checkpoint but the last is written in the background, so a kill
often lands while one is in flight: the run must resume from the one before, just as
exactly, and a SIGTERM must complete the one in flight and save its step. Prints one JSON
line.
"""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from model import Transformer  # noqa: E402
from plumbing import checkpoint, cli, overrides  # noqa: E402


def flags(out_dir: str, steps: int, ckpt_async: bool = False) -> list[str]:
    return [f"--ckpt_async={str(ckpt_async).lower()}", "--preset=tiny", f"--out_dir={out_dir}",
            "--model.n_layers=2",
            "--model.d_model=64", "--model.n_heads=2", "--model.n_kv_heads=1",
            "--model.intermediate=176", "--micro_batch_size=4", "--global_batch_tokens=1024",
            f"--total_steps={steps}", f"--stop_at_step={steps}", "--warmup_steps=2",
            "--log_every=1", "--eval_every=10", "--eval_tokens=2048", "--ckpt_every=2",
            "--sample_tokens=2"]


def start(out_dir: str, steps: int, ckpt_async: bool = False) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "train.py", *flags(out_dir, steps, ckpt_async)],
                            cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def logged_steps(out_dir: str) -> int:
    metrics = Path(out_dir) / "metrics.jsonl"
    if not metrics.exists():
        return 0
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line]
    return max((r["step"] for r in rows if "lr_muon" in r), default=0)


def same_weights(a: str, b: str, steps: int) -> bool:
    """The two runs' final model weights, read from their newest checkpoints, bit for bit."""
    cfg = overrides.parse_args(flags(a, steps))[0]
    loaded = []
    for out in (a, b):
        sd = {"model": Transformer(cfg.model).state_dict()}
        dcp.load(sd, checkpoint_id=str(checkpoint.complete_checkpoints(out)[-1]))
        loaded.append(sd["model"])
    return all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])


def kill_trial(root: str, steps: int, rng: random.Random, seconds: float,
               ckpt_async: bool) -> dict:
    """kill -9 once at a random moment of a run (redrawn if the run ends first), then the
    same command again until it finishes."""
    while True:
        out = f"{root}/kill_{rng.random():.6f}"
        proc = start(out, steps, ckpt_async)
        time.sleep(rng.uniform(0.0, seconds))
        if proc.poll() is None:
            break
        proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    while True:
        proc = start(out, steps, ckpt_async)
        err = proc.communicate()[1]
        if proc.returncode == 0:
            return {"out": out}
        if proc.returncode != -signal.SIGKILL:
            return {"out": out, "error": err.strip().splitlines()[-1:]}


def signal_trial(root: str, steps: int, rng: random.Random, ckpt_async: bool) -> dict:
    """SIGTERM at a random moment while training: after a random step has been logged, a
    random delay of up to one step later."""
    out, target = f"{root}/term_{rng.random():.6f}", rng.randint(1, steps - 2)
    proc = start(out, steps, ckpt_async)
    while logged_steps(out) < target and proc.poll() is None:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.1))
    before = logged_steps(out)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate()[1]
    saved = checkpoint.complete_checkpoints(out)
    state = saved[-1] / "train_state.json" if saved else None
    step = json.loads(state.read_text(encoding="utf-8"))["step"] if state else None
    return {"exit": proc.returncode, "saved": step, "extra_steps": None if step is None
            else step - (before + 1), "error": err.strip().splitlines()[-1:]
            if proc.returncode else []}


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=cli.at_least(0), default=10)
    parser.add_argument("--signals", type=cli.at_least(0), default=10)
    parser.add_argument("--steps", type=cli.at_least(1), default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt_async", action="store_true",
                        help="write checkpoints in the background, as --ckpt_async=true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        straight = f"{root}/straight"
        assert start(straight, args.steps).wait() == 0
        run_seconds = time.perf_counter() - t0
        kills = [kill_trial(root, args.steps, rng, run_seconds, args.ckpt_async)
                 for _ in range(args.kills)]
        exact = [same_weights(k["out"], straight, args.steps) for k in kills
                 if "error" not in k]
        signals = [signal_trial(root, args.steps, rng, args.ckpt_async)
                   for _ in range(args.signals)]
    print(json.dumps({
        "bench": "crash_resume", "ckpt_async": args.ckpt_async,
        "run_seconds": round(run_seconds, 1),
        "kill_trials": len(kills), "resumed_bitwise": sum(exact),
        "kill_errors": [k["error"] for k in kills if "error" in k],
        "signal_trials": len(signals),
        "signal_exit_0": sum(s["exit"] == 0 for s in signals),
        "signal_extra_steps": [s["extra_steps"] for s in signals],
        "signal_errors": [s["error"] for s in signals if s["error"]]}))


if __name__ == "__main__":
    main()
