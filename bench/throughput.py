"""Training-step throughput of the full loop versus a bare loop, side by side in one process.

The full loop is `train.main` (loader, token counting, reductions, logging every `warmup`
steps, metrics file); its tokens/s is taken from the wall-clock time between its log lines
after a warm-up, so all of the loop's own overhead counts. The bare loop runs the same
prepared model and optimizers on one fixed batch: forward, backward, clip, step, nothing else. The ratio
loop/bare is the share of speed the loop keeps (goal: >= 0.95).

    python bench/throughput.py                       # tiny preset, this machine
    python bench/throughput.py --preset stack100m --steps 40 --warmup 10   # on a GPU

Prints one JSON line.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402
import optim  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from plumbing import cli, launch, overrides  # noqa: E402


def loop_tokens_per_s(cfg, warmup: int) -> float:
    """Tokens/s of train.main between its log line at step `warmup` and its last one."""
    train.main(cfg)
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = {r["step"]: r for r in map(json.loads, lines) if "tokens_per_s" in r}
    first, last = records[warmup], records[max(records)]
    return (last["tokens_seen"] - first["tokens_seen"]) / (last["elapsed_s"] - first["elapsed_s"])


def bare_tokens_per_s(cfg, steps: int, warmup: int) -> float:
    accelerator = launch.make_accelerator(cfg)
    model = train.build_model(cfg, launch.use_compile(cfg)[0])
    optimizers = optim.build_optimizers(model, cfg, accelerator.mixed_precision)
    model, *prepared = accelerator.prepare(model, *optimizers.named.values())
    optimizers = optim.Optimizers(dict(zip(optimizers.named, prepared, strict=True)))
    loader = data.PackedShardLoader(cfg.data_dir, "train", cfg.seq_len, cfg.micro_batch_size)
    batch = {k: v.to(accelerator.device) for k, v in next(loader).items()}
    accum = cfg.grad_accum_steps(1)
    for step in range(warmup + steps):
        if step == warmup:
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        for _ in range(accum):
            with accelerator.accumulate(model):
                loss = model(**batch, reduction="sum").loss
                accelerator.backward(loss / cfg.global_batch_tokens)
        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizers.step()
        optimizers.zero_grad()
        float(loss)  # the loop reads its loss every step too
    return steps * cfg.global_batch_tokens / (time.perf_counter() - start)


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(config.PRESETS))
    parser.add_argument("--steps", type=cli.at_least(1), default=20, help="measured steps")
    parser.add_argument("--warmup", type=cli.at_least(0), default=5, help="steps before measuring")
    parser.add_argument("--rounds", type=cli.at_least(1), default=2,
                        help="bare/loop pairs, interleaved so drift hits both alike")
    args = parser.parse_args()
    total = args.warmup + args.steps
    loop, bare = [], []
    with tempfile.TemporaryDirectory() as out:
        cfg = overrides.apply_overrides(config.PRESETS[args.preset](), {
            "total_steps": total, "stop_at_step": total, "warmup_steps": 1,
            "decay_fraction": 0.0, "log_every": args.warmup, "eval_every": 10**9,
            "ckpt_every": 10**9, "resume": "none", "sample_tokens": 1})
        prepare.ensure_builtin([cfg.data_dir], cfg.model.vocab_size)
        for round_ in range(args.rounds):
            bare.append(bare_tokens_per_s(cfg, args.steps, args.warmup))
            run_cfg = overrides.apply_overrides(cfg, {"out_dir": f"{out}/{round_}"})
            loop.append(loop_tokens_per_s(run_cfg, args.warmup))
    loop_median, bare_median = statistics.median(loop), statistics.median(bare)
    print(json.dumps({"bench": "throughput", "preset": args.preset,
                      "device": str(launch.make_accelerator(cfg).device),
                      "loop_tokens_per_s": round(loop_median, 1),
                      "bare_tokens_per_s": round(bare_median, 1),
                      "ratio": round(loop_median / bare_median, 4),
                      "rounds": args.rounds, "measured_steps": args.steps}))


if __name__ == "__main__":
    main()
