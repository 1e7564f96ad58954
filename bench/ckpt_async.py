"""How long the loop waits for one checkpoint of Stack-100M: written while it waits (the
default) against staged and written in the background (--ckpt_async=true).

    python bench/ckpt_async.py [--rounds 3]     # ~1 minute on 2 CPU cores, 2.6 GB of RAM

The model and both optimizers hold Stack-100M's state: 101.35M fp32 weights, Muon's
momentum and AdamW's two moments, after one step on random gradients (the optimizers' state
exists only once they have stepped). Each round writes one checkpoint each way into a
scratch folder, interleaved, through plumbing/checkpoint.py's Saver as the loop calls it:
"blocked_s" is the time save() keeps the loop (every byte written, or the staged copy
made), "write_s" the time until the checkpoint is complete (renamed step_XXXXXXX). The
medians of the rounds; "share_of_a_step" is blocked_s over one step of Stack-100M at
--tokens_per_s (README's target on one H200: 560k tokens/s, 524,288 tokens a step), and
"share_of_training" that over the ckpt_every steps between checkpoints. On a GPU the staged
copy is a device-to-host copy, which this CPU does not measure. One JSON line.
"""

import json
import os
import statistics
import sys
import tempfile
import time

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from model import Transformer, count_params  # noqa: E402
from optim import build_optimizers  # noqa: E402
from plumbing import checkpoint, cli, log  # noqa: E402


def stepped_state(cfg):
    """Stack-100M's model and optimizers after one step on random gradients."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizers = build_optimizers(model, cfg, "bf16")  # Newton–Schulz in bf16: seconds
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers.step()
    return model, list(optimizers.named.values())


def one_save(saver, model, optimizers, out_dir: str, step: int) -> tuple[float, float]:
    """(seconds save() blocked, seconds until the checkpoint was complete)."""
    t0 = time.perf_counter()
    saver.save(model, optimizers, {"step": step}, out_dir, keep_last=1, blocking=False)
    blocked = time.perf_counter() - t0
    saver.wait()
    return blocked, time.perf_counter() - t0


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=cli.at_least(1), default=3)
    parser.add_argument("--tokens_per_s", type=cli.positive_number, default=560_000)
    parser.add_argument("--preset", choices=sorted(config.PRESETS), default="stack100m",
                        help="whose model and optimizer state to write (tiny: a smoke run)")
    args = parser.parse_args()
    cfg = config.PRESETS[args.preset]()
    model, optimizers = stepped_state(cfg)
    accelerator = Accelerator(cpu=True)
    savers = {"blocking": checkpoint.Saver(accelerator, in_background=False),
              "async": checkpoint.Saver(accelerator, in_background=True)}
    times = {name: [] for name in savers}
    with tempfile.TemporaryDirectory() as root:
        for step in range(1, args.rounds + 1):
            for name, saver in savers.items():
                times[name].append(one_save(saver, model, optimizers, f"{root}/{name}", step))
        size = sum(f.stat().st_size for f in checkpoint.step_path(f"{root}/async", step).iterdir())
    step_s = cfg.global_batch_tokens / args.tokens_per_s
    result = {"bench": "ckpt_async", "device": log.device_name(torch.device("cpu")),
              "preset": args.preset, "params": count_params(model), "checkpoint_bytes": size,
              "rounds": args.rounds, "step_s_at_tokens_per_s": round(step_s, 3)}
    for name, runs in times.items():
        blocked = statistics.median(b for b, _ in runs)
        result[name] = {"blocked_s": round(blocked, 3),
                        "write_s": round(statistics.median(w for _, w in runs), 3),
                        "share_of_a_step": round(blocked / step_s, 3),
                        "share_of_training": round(blocked / (step_s * cfg.ckpt_every), 5)}
    blocked = result["async"]["blocked_s"] / result["blocking"]["blocked_s"]
    result["blocked_ratio"] = round(blocked, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
