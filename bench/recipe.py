"""The recipe, measured: Muon + WSD against AdamW + WSD at the `tiny` preset's budget, over seeds.

    python bench/recipe.py                     # 31 runs, 2 h on 2 CPU cores
    python bench/recipe.py --steps 8 --tokens_per_step 1024 --eval_every 4 --log_every 2 \
        --eval_tokens 1024 --seeds 1 2 --runs_dir /tmp/recipe_smoke \
        --out /tmp/recipe_smoke/recipe                                # smoke: 1 min

Every run trains the `tiny` model (config.tiny(): ~4M parameters) on the built-in corpus
through train.main(cfg), with config overrides only. The budget is the preset's own: 300
steps x 4,096 tokens = 1.2M tokens, 10% warmup, 20% decay.

    muon_wsd      Muon on the hidden matrices, AdamW on embedding + gains, WSD (1-sqrt decay)
    adamw_wsd     AdamW on everything, the same WSD schedule
    adamw_cosine  (with --arms) AdamW, cosine from the end of warmup down to peak/10 (nanoGPT)

The measurement, in three stages:

1. **Learning rate.** Each arm sweeps its peak LR over a grid of factors of two with the
   first seed; while the best LR sits at an edge of the grid, the grid grows by one factor
   of two on that side (at most MAX_GROW times). Muon's embedding and gains use the LR that
   won the AdamW sweep, so the arms differ only in the matrices' optimizer.
2. **Seeds.** Each arm's best LR is run again with the other seeds. A seed sets the initial
   weights and the order of the training windows; the validation tokens are the same for
   all. The final validation losses give each arm's mean and sample standard deviation.
3. **Tokens.** How many tokens AdamW needs to match Muon, in Wen et al.'s way (arXiv
   2509.02046): compare final losses of separately scheduled runs, never points inside one
   run, whose loss drops in its decay. For each seed, AdamW's final loss at a budget B is
   the target; Muon is re-run (same seed, its own full schedule) at shorter budgets
   MUON_FRACTIONS x B until one ends above the target; Muon's final losses against its
   budgets, interpolated linearly, give the tokens T Muon needs for AdamW's loss.
   The ratio B / T is "AdamW needs B/T x Muon's tokens", one per seed. It is measured at
   each --ratio_budgets multiple of the preset's budget (1: the full budget, with the
   sweep's runs; smaller ones re-run AdamW there at the same LR), which says whether the
   gap grows or shrinks with the budget.

Outputs (bench/results/): recipe.json (the JSON line), recipe.csv (every eval point of every
run), recipe.png, recipe.md (a summary
for docs/recipe.md). Run directories go to bench/results/recipe_runs.tmp (git-ignored); a
finished run is reused when the sweep is started again with the same settings, so an
interrupted sweep resumes where it stopped.
"""

import csv
import dataclasses
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import train  # noqa: E402
from model import Transformer  # noqa: E402
from plumbing import cli, overrides  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# Factors of two around the earlier best values (80 steps x 2,048 tokens: adamw 1.5e-3,
# muon 3e-3) and the preset's (adamw 3e-3, muon 6e-3). With muon_adjust_lr="match_rms_adamw"
# a Muon update has AdamW's RMS, so Muon's LR lives on AdamW's scale.
ADAMW_GRID = (1.5e-3, 3e-3, 6e-3)
MUON_GRID = (3e-3, 6e-3, 1.2e-2)
MAX_GROW = 2  # grid extensions per arm when the best LR is at an edge
# Muon's shorter budgets, as fractions of AdamW's, tried in this order until Muon ends above
# AdamW's final loss: a ratio of up to 4 is measured by interpolation, not extrapolation.
MUON_FRACTIONS = (0.75, 0.5, 0.35, 0.25)


# ---------------------------------------------------------------------------------------
# The arms: each is a function of the peak LR that returns config overrides
# ---------------------------------------------------------------------------------------

def muon_wsd(lr: float, steps: int, adamw_lr: float) -> dict:
    """Ours: Muon at `lr` on the matrices; the embedding and gains stay on AdamW at the LR
    that won the AdamW + WSD sweep."""
    return {"matrix_optimizer": "muon", "muon_peak_lr": lr, "adamw_peak_lr": adamw_lr}


def adamw_wsd(lr: float, steps: int, adamw_lr: float | None = None) -> dict:
    """One AdamW at `lr` for the whole model, the same WSD schedule as ours."""
    return {"matrix_optimizer": "adamw", "adamw_peak_lr": lr}


def adamw_cosine(lr: float, steps: int, adamw_lr: float | None = None) -> dict:
    """The nanoGPT baseline: cosine from the end of warmup to the last step, down to
    min_lr = lr/10. An explicit decay_start/decay_steps lays the cosine over the whole run."""
    warmup = warmup_steps(steps)
    return {"matrix_optimizer": "adamw", "adamw_peak_lr": lr, "decay_shape": "cosine",
            "decay_start": warmup, "decay_steps": steps - warmup, "final_frac": 0.1}


# name -> (the function, its LR grid, the config key the grid sweeps). adamw_wsd comes
# first: Muon's run needs its best LR.
ARMS = {"adamw_wsd": (adamw_wsd, ADAMW_GRID, "adamw_peak_lr"),
        "muon_wsd": (muon_wsd, MUON_GRID, "muon_peak_lr"),
        "adamw_cosine": (adamw_cosine, ADAMW_GRID, "adamw_peak_lr")}


def warmup_steps(steps: int) -> int:
    """10% warmup, the tiny preset's proportion (30 of 300 steps)."""
    return max(1, round(0.1 * steps))


# ---------------------------------------------------------------------------------------
# One run, through train.main
# ---------------------------------------------------------------------------------------

def run_config(args, arm: str, lr: float, adamw_lr: float | None, seed: int,
               steps: int) -> config.TrainConfig:
    """The tiny preset with this run's budget, seed, logging and evaluation, then the arm's
    own overrides. The decay stays the preset's 20% of the run, whatever its length. No
    checkpoints mid-run (main still writes one at the end) and a fresh start every time."""
    tiny = config.tiny()
    make, _, _ = ARMS[arm]
    name = f"{arm}_lr{lr:g}_seed{seed}" + ("" if steps == args.steps else f"_steps{steps}")
    shared = {"out_dir": str(Path(args.runs_dir) / name), "total_steps": steps,
              "stop_at_step": steps, "global_batch_tokens": args.tokens_per_step,
              "micro_batch_size": args.tokens_per_step // tiny.seq_len,  # no accumulation
              "warmup_steps": warmup_steps(steps), "eval_every": args.eval_every,
              "eval_tokens": args.eval_tokens, "log_every": args.log_every,
              "ckpt_every": steps, "keep_last_ckpts": 1, "resume": "none",
              "sample_tokens": 8, "seed": seed}
    return overrides.apply_overrides(tiny, {**shared, **make(lr, steps, adamw_lr)})


def train_once(cfg: config.TrainConfig) -> dict:
    """Run train.main(cfg), or reuse a finished run with exactly this config. Returns its
    config, final and eval curve, and the run's records split into eval and train."""
    run_dir = Path(cfg.out_dir)
    done = run_dir / "done.json"
    wanted = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    if not (done.exists() and json.loads(done.read_text(encoding="utf-8"))["config"] == wanted):
        print(f"recipe: training {run_dir.name}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start it empty
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        train.main(cfg)
        finished(run_dir, cfg)
        done.write_text(json.dumps({"config": wanted, "wall_s": time.perf_counter() - start,
                                    "load_before": load_before,
                                    "load_after": os.getloadavg()[0]}), encoding="utf-8")
    records = read_metrics(run_dir)
    evals = [r for r in records if "val_loss" in r]
    return {"name": run_dir.name, "cfg": cfg,
            "tokens": cfg.stop_at_step * cfg.global_batch_tokens,
            "final": evals[-1]["val_loss"], "final_bpb": evals[-1]["val_bpb"],
            "points": [{"step": r["step"], "tokens": r["step"] * cfg.global_batch_tokens,
                        "val_loss": r["val_loss"], "val_bpb": r["val_bpb"]} for r in evals],
            "train": [r for r in records if "tokens_per_s" in r],
            **json.loads(done.read_text(encoding="utf-8"))}


def finished(run_dir: Path, cfg: config.TrainConfig):
    """main() also returns when SIGTERM/Ctrl-C stops a run early (it saves and exits
    cleanly); such a run must not be mistaken for a finished one and reused."""
    last_eval = max((r["step"] for r in read_metrics(run_dir) if "val_loss" in r), default=-1)
    if last_eval != cfg.stop_at_step:
        sys.exit(f"recipe: {run_dir} stopped at step {last_eval}, before {cfg.stop_at_step}; "
                 f"the sweep stops too (run it again to redo that run)")


def read_metrics(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


# ---------------------------------------------------------------------------------------
# The three stages
# ---------------------------------------------------------------------------------------

def lr_sweep(args, arm: str, adamw_lr: float | None) -> dict[float, dict]:
    """Stage 1: the arm at every LR of its grid with the first seed, the grid grown by a
    factor of two on the side of an edge that wins. Returns {lr: run}, LRs ascending."""
    _, grid, _ = ARMS[arm]
    runs = {}
    lrs = list(grid)
    for _ in range(MAX_GROW + 1):
        for lr in lrs:
            if lr not in runs:
                runs[lr] = train_once(run_config(args, arm, lr, adamw_lr, args.seeds[0],
                                                 args.steps))
        best = best_lr(runs)
        if best == lrs[0]:
            lrs.insert(0, best / 2)
        elif best == lrs[-1]:
            lrs.append(best * 2)
        else:
            break
    return dict(sorted(runs.items()))


def best_lr(runs: dict[float, dict]) -> float:
    return min(runs, key=lambda lr: runs[lr]["final"])


def tokens_to_reach(points: list[dict], target: float) -> float | None:
    """The first point where the losses (tokens ascending) get down to `target`, linearly
    interpolated in tokens between the two points around it; None if they never do."""
    if points and points[0]["val_loss"] <= target:
        return points[0]["tokens"]
    for before, after in itertools.pairwise(points):
        if after["val_loss"] <= target:
            t = (before["val_loss"] - target) / (before["val_loss"] - after["val_loss"])
            return before["tokens"] + t * (after["tokens"] - before["tokens"])
    return None


def token_ratio(args, muon_lr: float, adamw_lr: float, seed: int, muon_full: dict,
                adamw: dict) -> dict:
    """Stage 3 for one seed and AdamW's budget: Muon's shorter runs until one ends above
    AdamW's final loss, then the tokens Muon needs for that loss and the ratio. If Muon at
    the same budget does not reach it either, there is nothing to interpolate: None."""
    target, steps = adamw["final"], adamw["cfg"].stop_at_step
    runs = [muon_full]  # Muon at AdamW's budget
    for fraction in MUON_FRACTIONS:
        if runs[-1]["final"] > target:
            break
        cfg = run_config(args, "muon_wsd", muon_lr, adamw_lr, seed,
                         max(1, round(fraction * steps)))
        runs.append(train_once(cfg))
    finals = sorted(({"tokens": r["tokens"], "val_loss": r["final"]} for r in runs),
                    key=lambda p: p["tokens"])
    needed = tokens_to_reach(finals, target) if finals[0]["val_loss"] > target else None
    return {"seed": seed, "adamw_tokens": adamw["tokens"], "adamw_final": target,
            "muon_finals": finals, "muon_tokens_needed": needed,
            "ratio": adamw["tokens"] / needed if needed else None, "runs": [adamw, *runs]}


def measure(args) -> dict:
    """All three stages. Returns {"sweeps": {arm: {lr: run}}, "seeds": {arm: [run per
    seed]}, "ratios": {budget multiple: [token_ratio per seed]}}."""
    sweeps, seeds, adamw_lr = {}, {}, None
    for arm in args.arms:
        sweeps[arm] = lr_sweep(args, arm, adamw_lr)
        if arm == "adamw_wsd":
            adamw_lr = best_lr(sweeps[arm])
    for arm in args.arms:  # stage 2
        lr = best_lr(sweeps[arm])
        seeds[arm] = [sweeps[arm][lr]] + [
            train_once(run_config(args, arm, lr, adamw_lr, seed, args.steps))
            for seed in args.seeds[1:]]
    muon_lr = best_lr(sweeps["muon_wsd"])
    ratios = {}
    for multiple in args.ratio_budgets:  # stage 3
        steps = round(multiple * args.steps)
        ratios[multiple] = []
        for i, seed in enumerate(args.seeds):
            if steps == args.steps:
                adamw, muon = seeds["adamw_wsd"][i], seeds["muon_wsd"][i]
            else:
                adamw = train_once(run_config(args, "adamw_wsd", adamw_lr, None, seed, steps))
                muon = train_once(run_config(args, "muon_wsd", muon_lr, adamw_lr, seed, steps))
            ratios[multiple].append(token_ratio(args, muon_lr, adamw_lr, seed, muon, adamw))
    return {"sweeps": sweeps, "seeds": seeds, "ratios": ratios}


# ---------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------

def mean_sd(values: list[float]) -> dict:
    """Mean and sample standard deviation (n-1), with n, as the JSON and README give them."""
    return {"mean": round(statistics.mean(values), 4),
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else None,
            "n": len(values)}


def seconds_per_step(runs: list[dict]) -> float | None:
    """Median training seconds per optimizer step over every logged interval of these runs
    (train.py's tokens_per_s excludes eval and checkpoint time); the first interval holds
    one-off start-up costs, so it is dropped. On a shared machine the median resists the
    moments another job took the cores."""
    steps_per_s = [r["tokens_per_s"] / run["cfg"].global_batch_tokens
                   for run in runs for r in run["train"][1:]]
    return 1 / statistics.median(steps_per_s) if steps_per_s else None


def summarize(args, measured: dict) -> dict:
    """The JSON line: per arm the LR sweep, the best LR and the final val loss over seeds;
    per budget the token ratio over seeds; the cost of a Muon step."""
    sweeps, seeds = measured["sweeps"], measured["seeds"]
    arms = {}
    for arm, runs in sweeps.items():
        best = best_lr(runs)
        arms[arm] = {"lr_key": ARMS[arm][2], "best_lr": best,
                     "best_at_grid_edge": best in (min(runs), max(runs)),
                     "sweep_val_loss": {f"{lr:g}": round(r["final"], 4)
                                        for lr, r in runs.items()},
                     "val_loss": mean_sd([r["final"] for r in seeds[arm]]),
                     "val_bpb": mean_sd([r["final_bpb"] for r in seeds[arm]]),
                     "val_loss_by_seed": [round(r["final"], 4) for r in seeds[arm]]}
    arms["muon_wsd"]["adamw_peak_lr"] = seeds["muon_wsd"][0]["cfg"].adamw_peak_lr
    gaps = [a["final"] - m["final"] for a, m in zip(seeds["adamw_wsd"], seeds["muon_wsd"],
                                                     strict=True)]
    ratios = {}
    for multiple, per_seed in measured["ratios"].items():
        found = [r["ratio"] for r in per_seed if r["ratio"] is not None]
        ratios[f"{multiple:g}x"] = {
            "adamw_tokens": per_seed[0]["adamw_tokens"],
            "ratio": mean_sd(found) if found else None,
            "ratio_by_seed": [round(r["ratio"], 3) if r["ratio"] else None for r in per_seed],
            "adamw_final": mean_sd([r["adamw_final"] for r in per_seed]),
            "adamw_final_by_seed": [round(r["adamw_final"], 4) for r in per_seed],
            "muon_finals_by_seed": [{f"{p['tokens']}": round(p["val_loss"], 4)
                                     for p in r["muon_finals"]} for r in per_seed]}
    every_run = all_runs(measured)
    loads = [r[k] for r in every_run for k in ("load_before", "load_after")]
    muon_s = seconds_per_step(seeds["muon_wsd"])
    adamw_s = seconds_per_step(seeds["adamw_wsd"])
    cfg = seeds["muon_wsd"][0]["cfg"]
    return {
        "bench": "recipe", "preset": "tiny",
        "params": sum(p.numel() for p in Transformer(cfg.model).parameters()),
        "steps": args.steps, "tokens_per_step": args.tokens_per_step,
        "token_budget": args.steps * args.tokens_per_step, "seeds": args.seeds,
        "eval_every": args.eval_every, "eval_tokens": args.eval_tokens,
        "arms": arms, "final_gap_adamw_minus_muon": mean_sd(gaps),
        "token_ratio": ratios,
        "muon_step_s": muon_s and round(muon_s, 4), "adamw_step_s": adamw_s and round(adamw_s, 4),
        "muon_step_overhead": round(muon_s / adamw_s - 1, 3) if muon_s and adamw_s else None,
        "runs": len(every_run), "wall_s": round(sum(r["wall_s"] for r in every_run)),
        "load_avg_min_max": [round(min(loads), 2), round(max(loads), 2)],
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }


def all_runs(measured: dict) -> list[dict]:
    """Every distinct run of the measurement (the stages share some), each once."""
    runs = [*(r for arm in measured["sweeps"].values() for r in arm.values()),
            *(r for arm in measured["seeds"].values() for r in arm)]
    for per_seed in measured["ratios"].values():
        runs += [r for ratio in per_seed for r in ratio["runs"]]
    return list({r["cfg"].out_dir: r for r in runs}.values())


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------

def write_csv(measured: dict, path: Path):
    """Long format: one row per eval point of every run, named as its run directory."""
    fields = ["run", "matrix_optimizer", "matrix_peak_lr", "adamw_peak_lr", "seed", "steps",
              "step", "tokens", "val_loss", "val_bpb"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for run in all_runs(measured):
            cfg = run["cfg"]
            matrix_lr = cfg.muon_peak_lr if cfg.matrix_optimizer == "muon" else cfg.adamw_peak_lr
            for p in run["points"]:
                writer.writerow({"run": run["name"], "matrix_optimizer": cfg.matrix_optimizer,
                                 "matrix_peak_lr": matrix_lr, "adamw_peak_lr": cfg.adamw_peak_lr,
                                 "seed": cfg.seed, "steps": cfg.stop_at_step, **p})


COLORS = {"muon_wsd": "tab:red", "adamw_wsd": "tab:blue", "adamw_cosine": "tab:green"}


def write_plot(measured: dict, summary: dict, path: Path):
    """Left: validation loss against tokens at each arm's best LR, mean and ±1 sd over the
    seeds. Middle: the LR sweep. Right: final losses against budget, per seed, where the
    token ratio is read."""
    import matplotlib
    matplotlib.use("Agg")  # no display on a training box
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (ax_seeds, ax_sweep, ax_budget) = plt.subplots(1, 3, figsize=(18, 4.8))
    for arm, runs in measured["seeds"].items():
        a = summary["arms"][arm]
        plot_seed_band(ax_seeds, runs, COLORS[arm],
                       f"{arm} {a['lr_key']}={a['best_lr']:g}: {a['val_loss']['mean']:.3f} "
                       f"± {a['val_loss']['sd']:.3f}")
        sweep = measured["sweeps"][arm]
        ax_sweep.plot(list(sweep), [r["final"] for r in sweep.values()], color=COLORS[arm],
                      marker="o", label=f"{arm} ({a['lr_key']})")
    final = min(r["final"] for runs in measured["seeds"].values() for r in runs)
    ax_seeds.set_ylim(final - 0.1, final + 1.5)  # the early, steep part says little
    ax_seeds.set(xlabel="training tokens (M)", ylabel="validation loss (nats/token)",
                 title=f"best LR per arm: mean ± 1 sd over {len(summary['seeds'])} seeds")
    ax_sweep.set_xscale("log")
    ax_sweep.set_xticks(sorted({lr for sweep in measured["sweeps"].values() for lr in sweep}))
    ax_sweep.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_sweep.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_sweep.set(xlabel="peak learning rate", ylabel="final validation loss",
                 title=f"LR sweep, seed {summary['seeds'][0]}")
    plot_budgets(ax_budget, measured["ratios"], summary["token_ratio"])
    for ax in (ax_seeds, ax_sweep, ax_budget):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_seed_band(ax, runs: list[dict], color: str, label: str):
    """Mean eval curve of same-schedule runs with a ±1 sd band, each seed as a thin line."""
    tokens = [p["tokens"] / 1e6 for p in runs[0]["points"]]
    by_point = list(zip(*([p["val_loss"] for p in r["points"]] for r in runs), strict=True))
    mean = [statistics.mean(v) for v in by_point]
    sd = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in by_point]
    for r in runs:
        ax.plot(tokens, [p["val_loss"] for p in r["points"]], color=color, lw=0.5, alpha=0.4)
    ax.plot(tokens, mean, color=color, lw=2, marker="o", ms=3, label=label)
    ax.fill_between(tokens, [m - s for m, s in zip(mean, sd, strict=True)],
                    [m + s for m, s in zip(mean, sd, strict=True)],
                    color=color, alpha=0.2)


def plot_budgets(ax, ratios: dict, summary_ratios: dict):
    """Per seed, Muon's final loss against its budget (a line through its separately
    scheduled runs) and AdamW's final loss at its budget (a square and a dotted level):
    where Muon's line crosses the level is the tokens Muon needs."""
    for multiple, per_seed in ratios.items():
        r = summary_ratios[f"{multiple:g}x"]["ratio"]
        text = f"{r['mean']:.2f}× ± {r['sd'] or 0:.2f}" if r else "not reached"
        for i, seed_ratio in enumerate(per_seed):
            first = i == 0
            ax.plot([p["tokens"] / 1e6 for p in seed_ratio["muon_finals"]],
                    [p["val_loss"] for p in seed_ratio["muon_finals"]], color=COLORS["muon_wsd"],
                    marker="o", ms=3, lw=0.8,
                    label="muon_wsd final loss by budget (one line per seed)"
                    if first and multiple == max(ratios) else None)
            ax.plot([seed_ratio["adamw_tokens"] / 1e6], [seed_ratio["adamw_final"]], "s",
                    color=COLORS["adamw_wsd"],
                    label=f"adamw_wsd at {seed_ratio['adamw_tokens'] / 1e6:.2f}M tokens: "
                          f"AdamW needs {text} Muon's tokens" if first else None)
            ax.axhline(seed_ratio["adamw_final"], color=COLORS["adamw_wsd"], ls=":", lw=0.6)
    ax.set(xlabel="training tokens of the run (M)", ylabel="final validation loss",
           title="separately scheduled runs: tokens to equal loss")


def write_markdown(summary: dict, command: str, path: Path):
    """A few lines and a table, ready to paste into docs/recipe.md."""
    seeds = summary["seeds"]
    rows = [table_row(arm, a) for arm, a in summary["arms"].items()]
    edges = [arm for arm, a in summary["arms"].items() if a["best_at_grid_edge"]]
    lines = [
        (f"`{command}`: the `tiny` model ({summary['params'] / 1e6:.2f}M parameters), "
         f"{summary['steps']} steps × {summary['tokens_per_step']:,} tokens = "
         f"{summary['token_budget'] / 1e6:.2f}M tokens per full run, seeds "
         f"{', '.join(map(str, seeds))}; each arm's LR from a sweep with seed {seeds[0]}; "
         f"validation on {summary['eval_tokens']:,} tokens every {summary['eval_every']} "
         f"steps. Mean ± sample sd over the seeds."),
        "",
        f"| arm | best peak LR | final val loss | val bpb | per seed | LR sweep, seed {seeds[0]} |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        (f"- AdamW's final loss minus Muon's, paired by seed: "
         f"{fmt(summary['final_gap_adamw_minus_muon'])} nats/token."),
        *(ratio_line(budget, r) for budget, r in summary["token_ratio"].items()),
        (f"- {summary['runs']} runs, {summary['wall_s'] / 60:.0f} min of training on "
         f"{summary['cpu_count']} CPU cores (1-min load average "
         f"{summary['load_avg_min_max'][0]}–{summary['load_avg_min_max'][1]} around the runs)."),
    ]
    if summary["muon_step_s"] and summary["adamw_step_s"]:
        lines.append(f"- Step time on this CPU, medians of the logged intervals (indicative on "
                     f"shared cores): Muon {summary['muon_step_s']:.3f} s, AdamW "
                     f"{summary['adamw_step_s']:.3f} s ({summary['muon_step_overhead']:+.1%}).")
    if edges:
        lines.append(f"- The best LR sits at the edge of its grid for: {', '.join(edges)}.")
    lines += ["", ("![validation loss over seeds, LR sweep, and tokens to equal loss]"
                   "(bench/results/recipe.png)")]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def table_row(arm: str, a: dict) -> str:
    by_seed = ", ".join(f"{v:.4f}" for v in a["val_loss_by_seed"])
    sweep = ", ".join(f"{lr}: {v:.4f}" for lr, v in a["sweep_val_loss"].items())
    return (f"| {arm} | {a['lr_key']}={a['best_lr']:g} | {fmt(a['val_loss'])} | "
            f"{fmt(a['val_bpb'])} | {by_seed} | {sweep} |")


def ratio_line(budget: str, r: dict) -> str:
    """One bullet: the token ratio at one AdamW budget, with its seeds."""
    tokens = f"{r['adamw_tokens'] / 1e6:.2f}M"
    if r["ratio"] is None:
        return f"- At {tokens} tokens ({budget}) no Muon run was above AdamW's loss: no ratio."
    by_seed = ", ".join("–" if v is None else f"{v:.2f}" for v in r["ratio_by_seed"])
    return (f"- AdamW with {tokens} tokens ({budget} the full budget) reaches "
            f"{r['adamw_final']['mean']:.4f}; Muon reaches the same loss "
            f"with fewer tokens: AdamW needs **{r['ratio']['mean']:.2f}× ± "
            f"{r['ratio']['sd'] or 0:.2f}** Muon's tokens (per seed {by_seed}).")


def fmt(stat: dict) -> str:
    return f"{stat['mean']:.4f} ± {stat['sd']:.4f}" if stat["sd"] is not None else \
        f"{stat['mean']:.4f}"


def main():
    args = parse_args()
    measured = measure(args)
    summary = summarize(args, measured)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(measured, out.with_suffix(".csv"))
    write_plot(measured, summary, out.with_suffix(".png"))
    command = "python bench/recipe.py " + " ".join(sys.argv[1:])
    write_markdown(summary, command.strip(), out.with_suffix(".md"))
    line = json.dumps(summary)
    out.with_suffix(".json").write_text(line + "\n", encoding="utf-8")
    print(line)


def parse_args(argv=None):
    tiny = config.tiny()
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=cli.at_least(1), default=tiny.total_steps,
                        help="optimizer steps of a full-budget run (the preset's)")
    parser.add_argument("--tokens_per_step", type=cli.at_least(1), default=tiny.global_batch_tokens,
                        help="global batch in tokens (the preset's)")
    parser.add_argument("--eval_every", type=cli.at_least(1), default=50)
    parser.add_argument("--eval_tokens", type=cli.at_least(1), default=65_536,
                        help="val tokens per evaluation (README's figures: 65,536, 256 of "
                             "the 262 windows)")
    parser.add_argument("--log_every", type=cli.at_least(1), default=tiny.log_every)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    parser.add_argument("--arms", nargs="+", default=["adamw_wsd", "muon_wsd"],
                        choices=list(ARMS), help="adamw_wsd and muon_wsd are always measured")
    parser.add_argument("--ratio_budgets", type=float, nargs="+", default=[1.0, 0.25],
                        help="AdamW budgets, as multiples of --steps, at which to measure "
                             "the token ratio")
    parser.add_argument("--runs_dir", default=str(RESULTS / "recipe_runs.tmp"))
    parser.add_argument("--out", default=str(RESULTS / "recipe"),
                        help="output prefix: writes <out>.json/.csv/.png/.md")
    args = parser.parse_args(argv)
    # stage 3 compares these two; adamw_wsd first, since Muon's runs need its best LR
    args.arms = ["adamw_wsd", "muon_wsd"] + [a for a in args.arms
                                             if a not in ("adamw_wsd", "muon_wsd")]
    return args


if __name__ == "__main__":
    main()
