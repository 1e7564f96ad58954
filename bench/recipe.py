"""The recipe, measured: Muon + WSD against two AdamW baselines at equal tokens.

    pip install -r bench/requirements.txt      # matplotlib, for the plot only
    python bench/recipe.py                     # 12 runs, ~20 min on 2 shared CPU cores
    python bench/recipe.py --steps 3 --tokens_per_step 1024 --eval_every 1 \
        --eval_tokens 1024 --runs_dir /tmp/recipe_smoke --out /tmp/recipe_smoke/recipe  # smoke

Three arms train the `tiny` model (config.tiny(): ~4M parameters) on the built-in corpus,
each through train.main(cfg) with config overrides only. The default budget is 80 steps of
2,048 tokens (the preset's 300 x 4,096 is ~7x more than a shared 2-core box allows for ten
runs in under an hour); halving the batch keeps more optimizer steps in the same tokens.

    muon_wsd      Muon on the hidden matrices, AdamW on embedding + gains, WSD (1-sqrt decay)
    adamw_wsd     AdamW on everything, the same WSD schedule
    adamw_cosine  AdamW on everything, cosine from the end of warmup down to peak/10 (nanoGPT)

Every run has the same seed, so the same initial weights and the same data order, and the
same token budget. Each arm sweeps its peak learning rate over a small grid and the best
final validation loss of each arm is compared, so no arm loses to a badly chosen LR.

The token-efficiency ratio follows Wen et al. 2025 (arXiv 2509.02046): the tokens the best
AdamW arm needs to reach Muon's final validation loss, read off AdamW's eval curve by linear
interpolation, divided by Muon's tokens; "> budget" when AdamW never gets there. In that
case the best AdamW run is repeated at 1.5x, 2x, ... the budget until it gets there, each
with its own full schedule (Wen et al.'s method), and `token_efficiency_by_budget`
interpolates their final losses in tokens.

Outputs (bench/results/): recipe.json (the JSON line), recipe.csv (every eval point of every
run), recipe.png (needs matplotlib; skipped with a message otherwise), recipe.md (a summary
table). Run directories go to bench/results/recipe_runs.tmp (git-ignored); a finished run is
reused when the sweep is started again with the same settings, so an interrupted sweep
resumes where it stopped.
"""

import argparse
import csv
import dataclasses
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
import optim  # noqa: E402
import train  # noqa: E402
from model import Transformer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# Factors of two. With muon_adjust_lr="match_rms_adamw" a Muon update has AdamW's RMS, so
# Muon's LR lives on AdamW's scale (the preset: adamw 3e-3, muon 6e-3); 0.01-0.04, the range
# of the "original" scaling, would be 2-7x that. A 60-step pilot at 2,048 tokens/step
# (adamw_wsd 1.5e-3 / 3e-3 / 6e-3 -> val loss 6.25 / 6.43 / 6.71) showed these tiny batches
# want smaller AdamW steps than the preset's, so the AdamW grid is centred on 1.5e-3 and
# Muon, the arm under test, gets a fourth point below the preset's value.
ADAMW_GRID = (7.5e-4, 1.5e-3, 3e-3)
MUON_GRID = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
# When AdamW never reaches Muon's final loss within the budget, the best AdamW run is
# repeated with these multiples of the budget, each with its own full schedule, as Wen et
# al. do: their final losses, interpolated in tokens, say how many tokens AdamW needs.
# The ladder stops at the first multiple that gets there.
BUDGET_MULTIPLES = (1.5, 2, 3, 4)


# ---------------------------------------------------------------------------------------
# The arms: each is a function of the peak LR that returns config overrides
# ---------------------------------------------------------------------------------------

def muon_wsd(lr: float, steps: int, adamw_lr: float) -> dict:
    """Ours: Muon at `lr` on the matrices; the embedding and gains stay on AdamW at the LR
    that won the AdamW + WSD sweep, so the arms differ only in the matrices' optimizer."""
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


# (arm, the function, the grid, the config key the grid sweeps)
ARMS = [("adamw_wsd", adamw_wsd, ADAMW_GRID, "adamw_peak_lr"),
        ("muon_wsd", muon_wsd, MUON_GRID, "muon_peak_lr"),  # after adamw_wsd: needs its best
        ("adamw_cosine", adamw_cosine, ADAMW_GRID, "adamw_peak_lr")]


def warmup_steps(steps: int) -> int:
    """10% warmup, the tiny preset's proportion (30 of 300 steps)."""
    return max(1, round(0.1 * steps))


# ---------------------------------------------------------------------------------------
# One run, through train.main
# ---------------------------------------------------------------------------------------

def run_config(args, steps: int, arm_overrides: dict, run_dir: Path) -> config.TrainConfig:
    """The tiny preset with the shared budget, logging and evaluation, then the arm's own
    overrides. No checkpoints mid-run (main still writes one at the end), a fresh start
    every time, and the same seed for every run."""
    tiny = config.tiny()
    shared = {"out_dir": str(run_dir), "total_steps": steps, "stop_at_step": steps,
              "global_batch_tokens": args.tokens_per_step,
              "micro_batch_size": args.tokens_per_step // tiny.seq_len,  # no accumulation
              "warmup_steps": warmup_steps(steps), "eval_every": args.eval_every,
              "eval_tokens": args.eval_tokens, "log_every": args.log_every,
              "ckpt_every": steps, "keep_last_ckpts": 1, "resume": "none",
              "sample_tokens": 8, "seed": args.seed}
    return config.apply_overrides(tiny, {**shared, **arm_overrides})


def train_once(cfg: config.TrainConfig) -> dict:
    """Run train.main(cfg), or reuse a finished run with exactly this config. Returns the
    run's records from metrics.jsonl, split into eval and train, plus the load average."""
    run_dir = Path(cfg.out_dir)
    done = run_dir / "done.json"
    wanted = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    if not (done.exists() and json.loads(done.read_text())["config"] == wanted):
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start it empty
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        train.main(cfg)
        finished(run_dir, cfg)
        done.write_text(json.dumps({"config": wanted, "wall_s": time.perf_counter() - start,
                                    "load_before": load_before,
                                    "load_after": os.getloadavg()[0]}))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {"eval": [r for r in records if "val_loss" in r],
            "train": [r for r in records if "tokens_per_s" in r],
            **json.loads(done.read_text())}


def finished(run_dir: Path, cfg: config.TrainConfig):
    """main() also returns when SIGTERM/Ctrl-C stops a run early (it saves and exits
    cleanly); such a run must not be mistaken for a finished one and reused."""
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    last_eval = max((r["step"] for r in records if "val_loss" in r), default=-1)
    if last_eval != cfg.stop_at_step:
        sys.exit(f"recipe: {run_dir} stopped at step {last_eval}, before {cfg.stop_at_step}; "
                 f"the sweep stops too (run it again to redo that run)")


# ---------------------------------------------------------------------------------------
# Reading the curves
# ---------------------------------------------------------------------------------------

def curve(cfg: config.TrainConfig, run: dict, key: str) -> list[dict]:
    """The eval points of one run with tokens and the realized LRs at that step."""
    points = []
    for r in run["eval"]:
        multiplier = optim.lr_multiplier(min(r["step"], cfg.total_steps - 1), cfg)
        points.append({"step": r["step"], "tokens": r["step"] * cfg.global_batch_tokens,
                       "val_loss": r["val_loss"], "val_bpb": r["val_bpb"],
                       "lr_swept": getattr(cfg, key) * multiplier,
                       "lr_adamw": cfg.adamw_peak_lr * multiplier})
    return points


def tokens_to_reach(points: list[dict], target: float) -> float | None:
    """The first point where the curve gets down to `target`, linearly interpolated in
    tokens between the two evals around it; None if it never does."""
    for before, after in zip(points, points[1:]):
        if after["val_loss"] <= target:
            if before["val_loss"] <= target:
                return before["tokens"]
            t = (before["val_loss"] - target) / (before["val_loss"] - after["val_loss"])
            return before["tokens"] + t * (after["tokens"] - before["tokens"])
    return None


def seconds_per_step(cfg: config.TrainConfig, runs: list[dict]) -> tuple[float, float]:
    """Median and fastest training seconds per optimizer step over every logged interval of
    these runs (train.py's tokens_per_s excludes eval and checkpoint time). The first
    interval holds one-off start-up costs, so it is dropped. On a shared machine the median
    resists the moments another job took the cores; the fastest interval is the closest to
    the cost on idle cores."""
    rates = [r["tokens_per_s"] for run in runs for r in run["train"][1:]]
    return (cfg.global_batch_tokens / statistics.median(rates),
            cfg.global_batch_tokens / max(rates))


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------

def sweep(args) -> dict:
    """Every arm at every LR of its grid. Returns {arm: [{"lr", "cfg", "run", "points"}]}."""
    results, best_adamw_lr = {}, None
    for arm, make, grid, key in ARMS:
        results[arm] = []
        for lr in grid:
            run_dir = Path(args.runs_dir) / f"{arm}_lr{lr:g}"
            cfg = run_config(args, args.steps, make(lr, args.steps, best_adamw_lr), run_dir)
            results[arm].append(run_entry(cfg, lr, key))
        if arm == "adamw_wsd":
            best_adamw_lr = best_of(results[arm])["lr"]
    return results


def run_entry(cfg: config.TrainConfig, lr: float, key: str) -> dict:
    """Train (or reuse) one run and keep what the outputs need: its config and eval curve."""
    optim.check_schedule(cfg)
    print(f"recipe: {key}={lr:g} -> {cfg.out_dir}", flush=True)
    run = train_once(cfg)
    return {"lr": lr, "key": key, "cfg": cfg, "run": run, "points": curve(cfg, run, key)}


def longer_adamw(args, results: dict) -> tuple[str, list[dict]]:
    """The best AdamW arm at its best LR, re-run at BUDGET_MULTIPLES of the budget, but only
    if it falls short of Muon's final loss (otherwise its own curve answers the question).
    Stops at the first multiple that reaches Muon's loss: the longer ones cannot change the
    interpolation. Returns the arm and its runs, budget 1x (the sweep's) first."""
    arm = min(("adamw_wsd", "adamw_cosine"), key=lambda a: final_loss(best_of(results[a])))
    base = best_of(results[arm])
    entries = [dict(base, multiple=1)]
    target = final_loss(best_of(results["muon_wsd"]))
    make = {"adamw_wsd": adamw_wsd, "adamw_cosine": adamw_cosine}[arm]
    for multiple in BUDGET_MULTIPLES:
        if final_loss(entries[-1]) <= target:
            break
        steps = round(args.steps * multiple)
        run_dir = Path(args.runs_dir) / f"{arm}_lr{base['lr']:g}_x{multiple:g}"
        cfg = run_config(args, steps, make(base["lr"], steps), run_dir)
        entries.append(dict(run_entry(cfg, base["lr"], base["key"]), multiple=multiple))
    return arm, entries


def final_loss(entry: dict) -> float:
    return entry["points"][-1]["val_loss"]


def best_of(entries: list[dict]) -> dict:
    return min(entries, key=final_loss)


def summarize(results: dict, longer: tuple[str, list[dict]]) -> dict:
    """The JSON line: per arm the best LR and its final loss/bpb, the token-efficiency
    ratio against the best AdamW arm, and Muon's extra seconds per step."""
    best = {arm: best_of(entries) for arm, entries in results.items()}
    cfg = best["muon_wsd"]["cfg"]
    budget = cfg.stop_at_step * cfg.global_batch_tokens
    muon_final = best["muon_wsd"]["points"][-1]
    adamw_arm = longer[0]  # the AdamW arm with the lower final loss
    needed = tokens_to_reach(best[adamw_arm]["points"], muon_final["val_loss"])
    ratio = round(needed / budget, 3) if needed is not None else "> budget"
    # The other direction, always finite when Muon wins: how early Muon's curve reaches
    # AdamW's final loss. A WSD curve drops steeply in its decay, so read it with care.
    muon_needs = tokens_to_reach(best["muon_wsd"]["points"],
                                 best[adamw_arm]["points"][-1]["val_loss"])
    # Wen et al.'s reading: final losses of separately scheduled AdamW runs against budget
    finals = [{"tokens": e["cfg"].stop_at_step * e["cfg"].global_batch_tokens,
               "val_loss": final_loss(e)} for e in longer[1]]
    by_budget = tokens_to_reach(finals, muon_final["val_loss"])
    if by_budget is not None:
        ratio_by_budget = round(by_budget / budget, 3)
    else:
        ratio_by_budget = f"> {finals[-1]['tokens'] / budget:g}x budget"
    muon_s, muon_fastest = seconds_per_step(cfg, [e["run"] for e in results["muon_wsd"]])
    adamw_s, adamw_fastest = seconds_per_step(cfg, [e["run"] for a in ("adamw_wsd", "adamw_cosine")
                                     for e in results[a]])
    arms = {}
    for arm, entries in results.items():
        grid = [e["lr"] for e in entries]
        final = best[arm]["points"][-1]
        arms[arm] = {"best_lr": best[arm]["lr"], "lr_key": best[arm]["key"],
                     "val_loss": round(final["val_loss"], 4),
                     "val_bpb": round(final["val_bpb"], 4),
                     "best_at_grid_edge": best[arm]["lr"] in (min(grid), max(grid)),
                     "sweep_val_loss": {f"{e['lr']:g}": round(e["points"][-1]["val_loss"], 4)
                                        for e in entries}}
    arms["muon_wsd"]["adamw_peak_lr"] = best["muon_wsd"]["cfg"].adamw_peak_lr
    loads = [e["run"][k] for e in [*sum(results.values(), []), *longer[1][1:]]
             for k in ("load_before", "load_after")]
    n_params = sum(p.numel() for p in Transformer(cfg.model).parameters())
    return {
        "bench": "recipe", "preset": "tiny", "params": n_params, "steps": cfg.stop_at_step,
        "tokens_per_step": cfg.global_batch_tokens, "token_budget": budget,
        "eval_every": cfg.eval_every, "eval_tokens": cfg.eval_tokens, "seed": cfg.seed,
        "arms": arms, "adamw_reference_arm": adamw_arm,
        "token_efficiency": ratio,
        "token_efficiency_by_budget": ratio_by_budget,
        "adamw_budget_runs": {f"{e['multiple']:g}x": round(final_loss(e), 4)
                              for e in longer[1]},
        "adamw_tokens_to_muon_final": round(needed) if needed is not None else None,
        "muon_tokens_to_adamw_final": round(muon_needs) if muon_needs is not None else None,
        "muon_step_s": round(muon_s, 4), "adamw_step_s": round(adamw_s, 4),
        "muon_extra_step_s": round(muon_s - adamw_s, 4),
        "muon_step_overhead": round(muon_s / adamw_s - 1, 3),
        "muon_step_s_fastest": round(muon_fastest, 4),
        "adamw_step_s_fastest": round(adamw_fastest, 4),
        # the runs' own wall time, so that regenerating outputs from cached runs keeps it
        "wall_s": round(sum(e["run"]["wall_s"] for es in results.values() for e in es)
                        + sum(e["run"]["wall_s"] for e in longer[1][1:])),
        "load_avg_min_max": [round(min(loads), 2), round(max(loads), 2)],
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------

def write_csv(results: dict, longer: tuple[str, list[dict]], path: Path):
    """Long format: one row per eval point of every run; `best` marks each arm's winner.
    The longer AdamW runs are arms of their own, e.g. `adamw_wsd_x2` (twice the budget)."""
    fields = ["arm", "lr_key", "peak_lr", "best", "step", "tokens", "val_loss", "val_bpb",
              "lr_swept", "lr_adamw"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for arm, entries in results.items():
            winner = best_of(entries)
            for e in entries:
                for p in e["points"]:
                    writer.writerow({"arm": arm, "lr_key": e["key"], "peak_lr": e["lr"],
                                     "best": e is winner, **p})
        for e in longer[1][1:]:
            for p in e["points"]:
                writer.writerow({"arm": f"{longer[0]}_x{e['multiple']:g}", "lr_key": e["key"],
                                 "peak_lr": e["lr"], "best": False, **p})


COLORS = {"muon_wsd": "tab:red", "adamw_wsd": "tab:blue", "adamw_cosine": "tab:green"}


def write_plot(results: dict, longer: tuple[str, list[dict]], path: Path) -> bool:
    """Left: validation loss against tokens, every run (each arm's best bold). Middle: the
    realized learning rate of each arm's best run, from optim.lr_multiplier at every step.
    Right: the best AdamW run at 1x and longer budgets against Muon's final loss."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a training box
        import matplotlib.pyplot as plt
    except ImportError:
        print("recipe: matplotlib is not installed; skipping the plot "
              "(pip install -r bench/requirements.txt)")
        return False
    fig, (ax_loss, ax_lr, ax_budget) = plt.subplots(1, 3, figsize=(18, 4.8))
    for arm, entries in results.items():
        winner = best_of(entries)
        for e in entries:
            tokens = [p["tokens"] / 1e6 for p in e["points"]]
            losses = [p["val_loss"] for p in e["points"]]
            is_best = e is winner
            ax_loss.plot(tokens, losses, color=COLORS[arm], lw=2 if is_best else 0.8,
                         alpha=1 if is_best else 0.35, marker="o" if is_best else None, ms=3,
                         label=f"{arm} {e['key']}={e['lr']:g}" + (" (best)" if is_best else ""))
        cfg = winner["cfg"]
        steps = range(cfg.stop_at_step)
        tokens = [(s + 1) * cfg.global_batch_tokens / 1e6 for s in steps]
        peak = getattr(cfg, winner["key"])
        ax_lr.plot(tokens, [peak * optim.lr_multiplier(s, cfg) for s in steps],
                   color=COLORS[arm], label=f"{arm}: {winner['key']} (peak {peak:g})")
        if arm == "muon_wsd":  # its embedding and gains follow AdamW's peak
            ax_lr.plot(tokens, [cfg.adamw_peak_lr * optim.lr_multiplier(s, cfg) for s in steps],
                       color=COLORS[arm], ls="--",
                       label=f"{arm}: adamw_peak_lr on embedding+gains ({cfg.adamw_peak_lr:g})")
    final = min(e["points"][-1]["val_loss"] for es in results.values() for e in es)
    ax_loss.set_ylim(final - 0.1, final + 1.5)  # the early, steep part says little
    ax_loss.set(xlabel="training tokens (M)", ylabel="validation loss (nats/token)",
                title="tiny model: validation loss, same seed, data and budget")
    ax_lr.set(xlabel="training tokens (M)", ylabel="learning rate",
              title="realized LR of each arm's best run")
    plot_budgets(ax_budget, best_of(results["muon_wsd"]), longer)
    for ax in (ax_loss, ax_lr, ax_budget):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_budgets(ax, muon: dict, longer: tuple[str, list[dict]]):
    """Each longer AdamW run's eval curve (thin) and its final loss (dots): where the dots
    cross Muon's final loss is the token-efficiency ratio by budget."""
    arm, entries = longer
    for e in entries:
        ax.plot([p["tokens"] / 1e6 for p in e["points"]], [p["val_loss"] for p in e["points"]],
                color=COLORS[arm], lw=0.8, alpha=0.5)
    multiples = ", ".join(f"{e['multiple']:g}" for e in entries)
    ax.plot([e["points"][-1]["tokens"] / 1e6 for e in entries],
            [final_loss(e) for e in entries], color=COLORS[arm], marker="o",
            label=f"{arm} {entries[0]['key']}={entries[0]['lr']:g}: final loss at "
                  f"{multiples}x budget")
    ax.plot([p["tokens"] / 1e6 for p in muon["points"]], [p["val_loss"] for p in muon["points"]],
            color=COLORS["muon_wsd"], lw=2, label=f"muon_wsd muon_peak_lr={muon['lr']:g}")
    ax.axhline(final_loss(muon), color=COLORS["muon_wsd"], ls=":", label="Muon's final loss")
    ax.set_ylim(final_loss(muon) - 0.3, final_loss(muon) + 1.2)
    ax.set(xlabel="training tokens (M)", ylabel="validation loss (nats/token)",
           title="AdamW with more tokens vs Muon's final loss")


def write_markdown(summary: dict, command: str, path: Path, plotted: bool):
    """A few lines and a table, ready to paste into README.md."""
    arms = summary["arms"]
    rows = [f"| {arm} | {a['lr_key']}={a['best_lr']:g} | {a['val_loss']:.4f} | "
            f"{a['val_bpb']:.4f} | " + ", ".join(f"{lr}: {v:.4f}" for lr, v in
                                                 a["sweep_val_loss"].items()) + " |"
            for arm, a in arms.items()]
    ratio = summary["token_efficiency"]
    ratio_text = f"{ratio}×" if isinstance(ratio, float) else f"{ratio} (AdamW never reaches it)"
    edges = [arm for arm, a in arms.items() if a["best_at_grid_edge"]]
    lines = [
        f"**The recipe, measured** (`{command}`): the `tiny` model "
        f"({summary['params'] / 1e6:.2f}M parameters), {summary['steps']} steps × "
        f"{summary['tokens_per_step']:,} tokens = {summary['token_budget'] / 1e6:.2f}M tokens "
        f"per run, same seed and data order, best of a 3-4-point LR sweep per arm; validation on "
        f"{summary['eval_tokens']:,} tokens every {summary['eval_every']} steps.",
        "",
        "| arm | best peak LR | val loss | val bpb | sweep (final val loss) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"- Token efficiency (tokens {summary['adamw_reference_arm']} needs to reach Muon's "
        f"final val loss ÷ Muon's tokens): **{ratio_text}**; Wen et al. 2025 report ~1.4× at "
        f"0.1B parameters. Muon's curve reaches the AdamW arm's final loss after "
        f"{fmt_tokens(summary['muon_tokens_to_adamw_final'])} tokens. Both are read off one "
        f"WSD/cosine curve each, whose last stretch is the LR decay, so the crossing tokens "
        f"are not those of a separately scheduled shorter run.",
        f"- Separately scheduled runs of {summary['adamw_reference_arm']} at its best LR with "
        f"more tokens reach final val losses " + ", ".join(
            f"{v:.4f} ({k})" for k, v in summary["adamw_budget_runs"].items())
        + f" of the budget: AdamW needs **{budget_text(summary)}** Muon's tokens to match "
        f"Muon's {arms['muon_wsd']['val_loss']:.4f}.",
        f"- Muon's step time on this CPU: {summary['muon_step_s']:.3f} s against AdamW's "
        f"{summary['adamw_step_s']:.3f} s, {summary['muon_extra_step_s'] * 1e3:+.0f} ms "
        f"({summary['muon_step_overhead']:+.1%}; medians over the logged intervals of the "
        f"same runs; fastest intervals {summary['muon_step_s_fastest']:.3f} s against "
        f"{summary['adamw_step_s_fastest']:.3f} s).",
        f"- Training wall time {summary['wall_s'] / 60:.0f} min on {summary['cpu_count']} CPU "
        f"cores shared with other work (1-min load average {summary['load_avg_min_max'][0]}–"
        f"{summary['load_avg_min_max'][1]} around the runs), so times are indicative.",
    ]
    if edges:
        lines.append(f"- The best LR sits at the edge of its grid for: {', '.join(edges)}.")
    if plotted:
        lines += ["", "![validation loss and learning rate against tokens](bench/results/"
                      "recipe.png)"]
    path.write_text("\n".join(lines) + "\n")


def budget_text(summary: dict) -> str:
    ratio = summary["token_efficiency_by_budget"]
    return f"{ratio:.2f}×" if isinstance(ratio, float) else ratio.replace("x budget", "×")


def fmt_tokens(n) -> str:
    return "never (within the budget)" if n is None else f"{n / 1e6:.2f}M"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    parser.add_argument("--tokens_per_step", type=int, default=2048,
                        help="global batch in tokens (the tiny preset's is 4096)")
    parser.add_argument("--eval_every", type=int, default=8)
    parser.add_argument("--eval_tokens", type=int, default=6144)
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--runs_dir", default=str(RESULTS / "recipe_runs.tmp"))
    parser.add_argument("--out", default=str(RESULTS / "recipe"),
                        help="output prefix: writes <out>.json/.csv/.png/.md")
    args = parser.parse_args()
    results = sweep(args)
    longer = longer_adamw(args, results)
    summary = summarize(results, longer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(results, longer, out.with_suffix(".csv"))
    plotted = write_plot(results, longer, out.with_suffix(".png"))
    command = "python bench/recipe.py " + " ".join(sys.argv[1:])
    write_markdown(summary, command.strip(), out.with_suffix(".md"), plotted)
    line = json.dumps(summary)
    out.with_suffix(".json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
