"""What scoring the downstream tasks costs against training, at each preset's default
cadence; one JSON line.

    python bench/downstream_cost.py                     # tiny measured, stack100m bounded
    python bench/downstream_cost.py --steps 10 --rounds 3

tiny, measured here: the preset's own setup (its default task, nextline with TINY_ITEMS
items, scored at each evaluation, every eval_every steps), then `rounds` rounds of `steps`
optimizer steps and one scoring, interleaved so that load from other work on the machine
falls on both alike. share = scoring seconds / (eval_every × seconds per step). Goal <= 10%.

stack100m, an upper bound by arithmetic (no GPU here): its default task list is empty (its
data is the user's, and so are its task files), and its default cadence scores
downstream_items items per task at each evaluation. For the four tasks README names,
hellaswag (4 choices), arc_easy and arc_challenge (up to 5) and piqa (2), that is at most
items × 16 sequences, each at most one row of seq_len, rounded up to whole global
micro-batches on 8 ranks. A forward costs a third of a trained token (2 of the 6 FLOPs per
parameter, model.flops_per_token) at equal utilisation: share <= forward tokens / 3 /
(eval_every × global_batch_tokens). Goal <= 2%. Real items are far shorter than a row
(a HellaSwag item is ~100 tokens), which leaves room for a forward's lower utilisation.
"""

import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import train  # noqa: E402
from plumbing import cli, downstream, launch, overrides  # noqa: E402

SUITE_CHOICES = {"hellaswag": 4, "arc_easy": 5, "arc_challenge": 5, "piqa": 2}
RANKS = 8  # the reference run's launch (accelerate_configs/fsdp2.yaml)


def stack100m_bound(cfg: config.TrainConfig) -> dict:
    sequences = cfg.downstream_items * sum(SUITE_CHOICES.values())
    per_forward = cfg.micro_batch_size * RANKS
    rows = math.ceil(sequences / per_forward) * per_forward
    every = cfg.downstream_every or cfg.eval_every
    forward_tokens = rows * cfg.seq_len
    interval_tokens = every * cfg.global_batch_tokens
    return {"items_per_task": cfg.downstream_items, "choices": SUITE_CHOICES,
            "rows": rows, "seq_len": cfg.seq_len, "forward_tokens": forward_tokens,
            "steps_between": every, "interval_tokens": interval_tokens,
            "share_bound": forward_tokens / 3 / interval_tokens, "goal": 0.02}


def tiny_share(cfg: config.TrainConfig, step_s: float, score_s: float) -> dict:
    every = cfg.downstream_every or cfg.eval_every
    return {"step_s": step_s, "score_s": score_s, "steps_between": every,
            "share": score_s / (every * step_s), "goal": 0.10}


def measure_tiny(steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as out, launch.StopFlag() as stop:
        cfg = overrides.apply_overrides(config.tiny(), {"out_dir": out, "write_report": False,
                                                     "resume": "none"})
        run = train.setup(cfg)
        train.train_step(run, stop)  # warm-up, not timed
        step_s = score_s = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                train.train_step(run, stop)
            step_s += (time.perf_counter() - t0) / steps / rounds
            t0 = time.perf_counter()
            downstream.score(run.tasks, run.model, run.accelerator, cfg.micro_batch_size)
            score_s += (time.perf_counter() - t0) / rounds
        result = tiny_share(cfg, step_s, score_s)
        result.update(rounds=rounds, steps_per_round=steps,
                      forward_tokens=sum(t.forward_tokens for t in run.tasks),
                      items={t.name: len(t.items) for t in run.tasks})
        return result


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=cli.at_least(1), default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=cli.at_least(1), default=3,
                        help="rounds of steps, then a scoring")
    args = parser.parse_args()
    print(json.dumps({"tiny": measure_tiny(args.steps, args.rounds),
                      "stack100m": stack100m_bound(config.stack100m())}))


if __name__ == "__main__":
    main()
