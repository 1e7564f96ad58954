"""How far each of bench/cpu_speed.py's levers moves what `tiny` computes: the train loss
at step 40, over three seeds, with every lever and with each one undone (the code it
replaced), beside the reference seeds' (reference/tiny: with every lever since 8454423).

    python bench/lever_losses.py          # 6 runs × 3 seeds of 40 steps: ~15 minutes on 2 cores

Each run is `tiny` itself (its batches, schedule and precision: auto's, bf16 where the CPU
computes it), stopped at step 40, without the in-loop task (the loss does not depend on
it). One JSON line: "loss_at_40" by configuration and seed, and for each configuration its
largest difference from "all" and from the reference.
"""

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import cpu_speed  # noqa: E402
import train  # noqa: E402
from plumbing import cli, overrides  # noqa: E402

REFERENCE = Path(__file__).resolve().parent.parent / "reference" / "tiny"
STEP = 40


def loss_at(metrics: Path, step: int) -> float:
    lines = metrics.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return next(r["loss"] for r in records if r["kind"] == "train" and r["step"] == step)


def run(seed: int, out_dir: str, undo=None) -> float:
    """tiny with `seed` to step STEP, with `undo` (a lever's patch) in force."""
    cfg = overrides.apply_overrides(config.tiny(), {
        "seed": seed, "stop_at_step": STEP, "out_dir": out_dir, "downstream": "",
        "write_report": False, "sample_tokens": 1})
    with undo or contextlib.nullcontext():
        train.main(cfg)
    return loss_at(Path(out_dir) / "metrics.jsonl", STEP)


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=cli.at_least(0), nargs="+", default=[1337, 1338, 1339])
    args = parser.parse_args()
    runs = {"all": None, **{f"without_{n}": undo for n, undo in cpu_speed.LEVERS.items()}}
    losses = {name: {} for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, undo in runs.items():
                out = os.path.join(tmp, f"{name}-{seed}")
                losses[name][seed] = run(seed, out, undo() if undo else None)
    reference = {seed: loss_at(REFERENCE / f"seed-{seed}" / "metrics.jsonl", STEP)
                 for seed in args.seeds if (REFERENCE / f"seed-{seed}").is_dir()}
    print(json.dumps({
        "bench": "lever_losses", "step": STEP, "loss_at_40": losses, "reference": reference,
        "vs_all": {n: max(abs(v[s] - losses["all"][s]) for s in v) for n, v in losses.items()},
        "vs_reference": {n: max(abs(v[s] - reference[s]) for s in reference)
                         for n, v in losses.items()} if reference else None}))


if __name__ == "__main__":
    main()
