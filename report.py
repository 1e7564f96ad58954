"""report.py: the run report, drawn from out_dir/metrics.jsonl alone, and runs compared.

    python report.py out/tiny                  # out/tiny/report.md and out/tiny/report.png
    python report.py out/smollm out/anneal-a out/anneal-b --out out/compare

Every run writes its report at each checkpoint and as it ends (log.py runs this file as a
command). This command rebuilds it at any time from the folder: no checkpoint weights, no
GPU, no network, no torch. report.png holds the curves against tokens seen: train loss (raw
and smoothed), val loss (the mixture and each source), both learning rates, the gradient
norm with skipped steps, tokens/s and MFU, and the downstream tasks' acc_norm and acc
against chance when the run scored any; every panel marks the schedule's phases, the
data stages, and where the run resumed or branched. report.md shows the figure and the
run's facts: the hardware and the code of each start, the config as a diff from its
preset, the data plan, the results and the end-of-run sample.

How the log is read (log.py writes it): records come in starts, each opened by a `start`
record. A start that resumes from step S undoes everything an earlier start logged past S
(a kill -9 leaves steps no checkpoint kept), and a step logged twice counts once, its last
record. A run that continues another folder's checkpoint (an anneal branched from the
stable run) shows that folder's history up to the branch point: the folder the checkpoint
was in, or, where both were moved since, the folder of that name beside this one. A line a
kill -9 cut short is left out with one warning.

Several folders are overlaid in one figure, labelled by folder name, with a table of their
finals and of the knobs in which they differ. A run of the `tiny` preset, unmodified, is
drawn over the reference seeds of its precision kept in reference/tiny/ (bf16/ and fp32/:
auto trains tiny in bf16 on a CPU that computes it, in fp32 elsewhere), and the report says
whether its final val loss falls within their spread.

Imports from stacklm: cli (the one-line errors) and config (knob names; neither imports
torch). It reads JSON and draws with matplotlib (a bare Figure, rendered by Agg: no
display, no pyplot state).
"""

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

import config
from plumbing.cli import ArgumentParser, user_errors

REFERENCE = Path(__file__).resolve().parent / "reference" / "tiny"
# The reference seeds' folder for each precision `auto` may train tiny in (the start
# record's hardware.precision): a run is compared with the seeds of its own precision.
REFERENCE_PRECISION = {"bf16": "bf16", "no": "fp32"}
# Knobs that change nothing a run computes before its sample, only which seed it draws, or
# only which precision it trains in (mixed_precision: the seeds of that precision compare):
# a tiny run that differs from the preset in these alone is compared with the reference.
UNCHANGED_BY = {"out_dir", "resume", "seed", "wandb_mode", "wandb_project", "write_report",
                "sample_prompt", "sample_tokens", "mixed_precision"}
# Knobs never worth a row where runs are compared: each run's folder is its label.
NOT_COMPARED = {"out_dir", "resume"}


@dataclass
class RunLog:
    """One run, as its metrics.jsonl (and its parent's, up to the branch point) tells it."""
    path: Path
    starts: list[dict] = field(default_factory=list)  # each start record, in order
    ends: list[dict | None] = field(default_factory=list)  # how each start ended; None: killed
    seconds: list[float] = field(default_factory=list)  # each start's wall time, on the log's clock
    records: dict[str, dict[int, dict]] = field(default_factory=dict)  # kind -> step -> record
    branch: tuple[str, int] | None = None  # (parent folder, step) this run continues
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> dict:  # the config in effect at the end
        return self.starts[-1]["config"]

    def rows(self, kind: str) -> list[dict]:
        """This kind's records, one per step, in step order."""
        by_step = self.records.get(kind, {})
        return [by_step[step] for step in sorted(by_step)]


# ---------------------------------------------------------------------------------------
# Reading the log
# ---------------------------------------------------------------------------------------

def read_run(out_dir, seen: frozenset = frozenset()) -> RunLog:
    """The run in out_dir, from its metrics.jsonl; a ValueError when there is none."""
    path = Path(out_dir).resolve()
    if path.is_file():
        raise NotADirectoryError(f"{out_dir} is a file; report.py reads a run's out_dir, the "
                                 f"folder that holds metrics.jsonl: python report.py "
                                 f"{Path(out_dir).parent}")
    records, bad = read_lines(path / "metrics.jsonl")
    run = RunLog(path, warnings=[f"{path / 'metrics.jsonl'}: {lines_named(bad)} cannot be "
                                 f"read (cut short by a kill -9?); reported without "
                                 f"{'them' if len(bad) > 1 else 'it'}"] if bad else [])
    for record in records:
        add(run, record)
    if not run.starts:
        unread = f" ({lines_named(bad)} cannot be read)" if bad else ""
        raise ValueError(f"{path / 'metrics.jsonl'}: no start record{unread}, so not a log "
                         f"of this version of train.py (each start of a run writes one "
                         f"first); give the out_dir of a run train.py wrote")
    inherit(run, seen | {path})
    return run


def read_lines(metrics: Path) -> tuple[list[dict], list[int]]:
    """Every record that parses, and the numbers of the lines that do not."""
    try:
        lines = metrics.read_bytes().splitlines()
    except FileNotFoundError:
        raise ValueError(f"{metrics.parent}: no metrics.jsonl, so nothing to report; give "
                         f"the out_dir of a run (train.py writes metrics.jsonl there)") from None
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        try:  # a line that is not UTF-8 (a binary file) is unreadable as one cut short is
            record = json.loads(line.decode("utf-8"), parse_constant=not_json)
        except ValueError:
            record = None
        if isinstance(record, dict) and "kind" in record and "step" in record:
            records.append(record)
        elif line.strip():
            bad.append(number)
    return records, bad


def lines_named(numbers: list[int]) -> str:
    """`line 7`, `lines 3, 9`, or past five, `lines 1, 2, 3, 4, 5 and 21 more`."""
    listed = ", ".join(map(str, numbers[:5])) + (f" and {len(numbers) - 5:,} more"
                                                 if len(numbers) > 5 else "")
    return f"line{'s' if len(numbers) > 1 else ''} {listed}"


def not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # NaN and Infinity: log.py writes null


def add(run: RunLog, record: dict):
    """File one record. A start at step S undoes what earlier starts logged past S; a step
    logged again replaces its record."""
    kind, step = record["kind"], record["step"]
    if kind == "start":
        for by_step in run.records.values():
            for undone in [s for s in by_step if s > step]:
                del by_step[undone]
        run.starts.append(record)
        run.ends.append(None)
        run.seconds.append(0.0)
    elif not run.starts:
        return  # before any start: not a log this code wrote
    if kind == "end":
        run.ends[-1] = record
    if "elapsed_s" in record:  # the log's clock starts again with each start
        run.seconds[-1] = max(run.seconds[-1], record["elapsed_s"])
    run.records.setdefault(kind, {})[step] = record


def inherit(run: RunLog, seen: frozenset):
    """A run whose first start continued another folder's checkpoint (an anneal branched
    from the stable run) takes that folder's history up to the branch point."""
    first = run.starts[0]
    source = first.get("resumed_from")
    if not source:
        return
    parent = Path(source).parent.parent  # out_dir/ckpt/step_XXXXXXX
    if not (parent / "metrics.jsonl").exists():  # both folders moved since (off a cluster)
        parent = run.path.parent / parent.name
    if parent.resolve() in seen or parent.resolve() == run.path:
        return
    step = first["step"]
    run.branch = (parent.name, step)
    try:
        history = read_run(parent, seen)
    except ValueError as e:
        run.warnings.append(f"{run.path}: the history before step {step:,} is not drawn ({e})")
        return
    run.warnings += history.warnings
    for kind, by_step in history.records.items():
        ours = run.records.setdefault(kind, {})
        ours.update({s: r for s, r in by_step.items() if s <= step and s not in ours})
    before = [k for k, start in enumerate(history.starts) if start["step"] < step]
    run.starts[:0] = [history.starts[k] for k in before]
    run.ends[:0] = [history.ends[k] for k in before]
    run.seconds[:0] = [history.seconds[k] for k in before]


# ---------------------------------------------------------------------------------------
# What the report says: the results, computed once for the markdown, the tables and tests
# ---------------------------------------------------------------------------------------

def results(run: RunLog) -> dict:
    """The run's finals and totals. Throughput leaves out the first log interval of each
    start (compilation, warm-up) unless nothing else is left, weighting each interval by
    its time; None where the log has no such number."""
    train, evals = run.rows("train"), run.rows("eval")
    last_train = train[-1] if train else {}
    last_eval = evals[-1] if evals else {}
    tokens_per_s, mfu, warm = throughput(run)
    return {
        "step": max([r["step"] for kind in ("train", "eval") for r in run.rows(kind)],
                    default=run.starts[-1]["step"]),
        "train_step": last_train.get("step"), "train_loss": last_train.get("loss"),
        "eval_step": last_eval.get("step"), "val_loss": last_eval.get("val_loss"),
        "val_bpb": last_eval.get("val_bpb"),
        "val_loss_per_source": {k.split("/", 1)[1]: v for k, v in last_eval.items()
                                if k.startswith("val_loss/")},
        "tasks": final_accuracies(run),
        "tokens_seen": max([r["tokens_seen"] for r in train + evals], default=0),
        "wall_s": sum(run.seconds), "starts": len(run.starts),
        "tokens_per_s": tokens_per_s, "mfu": mfu, "throughput_warm": warm,
        "peak_memory_gib": max([r["memory_gib"] for r in train if r["memory_gib"] is not None],
                               default=None),
        "skipped_steps": len(run.records.get("skip", {})),
        "checkpoints": sorted(run.records.get("checkpoint", {})),
        "outcome": (run.ends[-1] or {}).get("outcome", "running, or killed"),
    }


def throughput(run: RunLog) -> tuple[float | None, float | None, bool]:
    """Mean tokens/s and MFU over the logged intervals, each weighted by its seconds; and
    whether the first interval of every start could be left out."""
    intervals = []  # (seconds, tokens/s, mfu, first of its start)
    bounds = [s["step"] for s in run.starts] + [math.inf]
    for k, start in enumerate(run.starts):
        rows = [r for r in run.rows("train") if bounds[k] < r["step"] <= bounds[k + 1]
                and r.get("tokens_per_s")]
        previous = start["step"]
        for i, r in enumerate(rows):
            tokens = (r["step"] - previous) * start["config"]["global_batch_tokens"]
            intervals.append((tokens / r["tokens_per_s"], r["tokens_per_s"], r["mfu"], i == 0))
            previous = r["step"]
    warm = [x for x in intervals if not x[3]]
    chosen = warm or intervals
    seconds = sum(x[0] for x in chosen)
    if not seconds:
        return None, None, False
    mfu = None
    if all(x[2] is not None for x in chosen):
        mfu = sum(x[0] * x[2] for x in chosen) / seconds
    return sum(x[0] * x[1] for x in chosen) / seconds, mfu, bool(warm)


def reference_verdict(run: RunLog) -> str | None:
    """For a finished run of the unmodified `tiny` preset: is its final val loss within the
    reference seeds' spread, or outside it and by how much? None for any other run."""
    start, done = run.starts[-1], results(run)
    unchanged = all(knob in UNCHANGED_BY for knob, *_ in start.get("preset_changes", []))
    if start.get("preset") != "tiny" or not unchanged or done["eval_step"] is None \
            or done["eval_step"] != run.config["stop_at_step"]:
        return None
    precision = reference_precision(run)
    seeds = reference_runs(precision)
    if not seeds:
        return None
    finals = [results(seed)["val_loss"] for seed in seeds]
    low, high, ours = min(finals), max(finals), done["val_loss"]
    spread = f"{low:.4f}–{high:.4f}, {len(seeds)} seed{'s' if len(seeds) > 1 else ''}"
    seeds_are = f"the {precision} reference seeds"
    if ours is None:
        return f"reference: the final val loss is not finite ({seeds_are}: {spread})"
    if low <= ours <= high:
        return f"reference: final val loss {ours:.4f} is within {seeds_are}' spread ({spread})"
    by = ours - high if ours > high else low - ours
    side = "above" if ours > high else "below"
    return (f"reference: final val loss {ours:.4f} is outside {seeds_are}' spread "
            f"({spread}): {by:.4f} {side} it")


def reference_precision(run: RunLog) -> str:
    """The precision a run trained in (its last start's), as the reference folders name it."""
    return REFERENCE_PRECISION.get(run.starts[-1].get("hardware", {}).get("precision"), "fp32")


def reference_runs(precision: str) -> list[RunLog]:
    """The reference seeds kept for `precision` (bf16 or fp32)."""
    folders = sorted((REFERENCE / precision).glob("seed-*"))
    return [read_run(d) for d in folders if (d / "metrics.jsonl").exists()]


# ---------------------------------------------------------------------------------------
# The figure
# ---------------------------------------------------------------------------------------

PANELS = ("train loss", "val loss", "learning rate", "gradient norm", "tokens/s", "MFU")
ACCURACY = "downstream accuracy"  # a seventh panel, for a run that scored tasks
# Where each panel's legend covers least, fixed ("best" would search every point): losses
# and the gradient norm fall from the upper left; the learning rates hold high until the
# decay; throughput dips at the start, then holds level.
LEGEND_AT = {"train loss": "upper right", "val loss": "upper right",
             "learning rate": "lower center", "gradient norm": "upper right",
             "tokens/s": "lower right", "MFU": "lower right", ACCURACY: "upper left"}
SMOOTHING_POINTS = 40  # the smoothed train loss averages over ~1/40 of the logged points


def draw(runs: list[RunLog], reference: list[RunLog] = ()) -> Figure:
    """The panels against tokens seen, one colour per run, and the reference seeds in grey."""
    panels = PANELS + ((ACCURACY,) if any(tasks(run) for run in runs) else ())
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(13, 3.5 * rows))  # margins set by hand: a layout engine costs seconds
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.18 / rows, top=1 - 0.21 / rows,
                        hspace=0.22, wspace=0.16)
    grid = list(fig.subplots(rows, 2, sharex=True).flat)
    for ax in grid[len(panels):]:
        ax.set_visible(False)  # an odd number of panels leaves one place empty
    axes = dict(zip(panels, grid))
    for k, seed in enumerate(reference):  # one legend entry for all of them
        label = f"reference ({len(reference)} seeds)" if k == 0 else None
        curve(axes["train loss"], seed, "train", "loss", color="0.75", lw=0.8, smooth=True,
              label=label, gid="reference")
        curve(axes["val loss"], seed, "eval", "val_loss", color="0.75", lw=0.8, marker=".",
              label=label, gid="reference")
    for k, run in enumerate(runs):
        draw_run(axes, run, f"C{k}", run.name if len(runs) > 1 else "")
    finish(fig, axes, runs)
    return fig


def draw_run(axes: dict, run: RunLog, color: str, name: str):
    """One run's curves and boundaries, labelled `name` where runs are compared. A run drawn
    alone (name "") also gets its raw train loss and each source's val loss."""
    alone, prefix = not name, f"{name} " if name else ""
    if alone:
        curve(axes["train loss"], run, "train", "loss", color=color, alpha=0.35, lw=0.8,
              label="raw", gid="train loss raw")
    curve(axes["train loss"], run, "train", "loss", color=color, smooth=True,
          label=f"{prefix}smoothed", gid="train loss smoothed")
    several = len(sources(run)) > 1
    curve(axes["val loss"], run, "eval", "val_loss", color=color, marker="o", ms=3,
          label=f"{prefix}mixture" if several else name or "val loss", gid="val loss")
    for j, source in enumerate(sources(run) if alone and several else []):
        curve(axes["val loss"], run, "eval", f"val_loss/{source}", color=f"C{j + 1}", ls="--",
              lw=1, label=source, gid=f"val loss/{source}")
    for j, key in enumerate(learning_rates(run)):
        curve(axes["learning rate"], run, "train", key, color=f"C{j}" if alone else color,
              ls=("-", "--", ":")[j % 3], label=f"{prefix}{key[3:]}", gid=key)
    for panel, key, scale in (("gradient norm", "grad_norm", 1),
                              ("tokens/s", "tokens_per_s", 1), ("MFU", "mfu", 100)):
        curve(axes[panel], run, "train", key, color=color, lw=1, scale=scale,
              label=name or None, gid=key)
    skipped = [r["step"] for r in run.rows("skip")]
    if skipped:  # at the top edge: a skipped step's norm is not a number
        ax = axes["gradient norm"]
        ax.plot(tokens_at(run, skipped), [0.97] * len(skipped), "x", color="red",
                transform=ax.get_xaxis_transform(), label=f"{prefix}skipped step", gid="skipped")
    draw_accuracy(axes.get(ACCURACY), run, color if not alone else None, prefix)
    marks = boundaries(run)
    for ax in axes.values():
        mark_boundaries(ax, marks, None if alone else color, label=ax is axes["train loss"])


def draw_accuracy(ax, run: RunLog, color: str | None, prefix: str):
    """Each task's acc_norm (solid) and acc (dashed), and its chance (dotted), in one colour
    per task; runs compared share their run's colour and tell tasks apart by marker. Chance
    belongs to the task, not the run: runs compared draw it once, in grey."""
    finals = final_accuracies(run)
    for j, task in enumerate(tasks(run) if ax is not None else []):
        c, marker = color or f"C{j}", "os^vD"[j % 5] if color else "o"
        curve(ax, run, "eval", f"acc_norm/{task}", color=c, marker=marker, ms=3,
              label=f"{prefix}{task} acc_norm", gid=f"acc_norm/{task}")
        curve(ax, run, "eval", f"acc/{task}", color=c, ls="--", lw=1,
              label=f"{prefix}{task} acc", gid=f"acc/{task}")
        if not any(line.get_gid() == f"chance/{task}" for line in ax.lines):
            ax.axhline(finals[task]["chance"], color="0.5" if color else c,
                       ls=":", lw=1, label=f"{task} chance", gid=f"chance/{task}")


def tasks(run: RunLog) -> list[str]:
    """The downstream tasks the run scored, in the order of its last scoring."""
    scored = [r for r in run.rows("eval") if any(k.startswith("acc/") for k in r)]
    return [k.split("/", 1)[1] for k in scored[-1] if k.startswith("acc/")] if scored else []


def final_accuracies(run: RunLog) -> dict[str, dict]:
    """task -> the last scoring's step, acc, acc_norm and chance."""
    out = {}
    for record in run.rows("eval"):
        for task in (k.split("/", 1)[1] for k in record if k.startswith("acc/")):
            out[task] = {"step": record["step"], **{m: record.get(f"{m}/{task}")
                                                   for m in ("acc", "acc_norm", "chance")}}
    return out


def curve(ax, run: RunLog, kind: str, key: str, smooth: bool = False, scale: float = 1,
          **style):
    """One series against tokens seen; a missing or non-finite value is a gap."""
    rows = [r for r in run.rows(kind) if key in r]
    x = np.array([r["tokens_seen"] for r in rows], dtype=float)
    y = np.array([np.nan if r[key] is None else r[key] for r in rows], dtype=float) * scale
    if np.isfinite(y).any():
        ax.plot(x, ema(y) if smooth else y, **style)


def ema(y: np.ndarray) -> np.ndarray:
    """A debiased exponential moving average (TensorBoard's smoothing) over ~1/40 of the
    points; a gap stays a gap and does not reset the average."""
    beta = 1 - 1 / max(2.0, len(y) / SMOOTHING_POINTS)
    out, average, weight = np.full_like(y, np.nan), 0.0, 0.0
    for i, value in enumerate(y):
        if np.isfinite(value):
            average, weight = beta * average + (1 - beta) * value, beta * weight + (1 - beta)
            out[i] = average / weight
    return out


def learning_rates(run: RunLog) -> list[str]:
    """The lr_<optimizer> keys of the run's last log line."""
    return [k for k in (run.rows("train")[-1:] or [{}])[0] if k.startswith("lr_")]


def sources(run: RunLog) -> list[str]:
    """The sources the run evaluates, in the order of its last evaluation."""
    last = run.rows("eval")[-1:] or [{}]
    return [k.split("/", 1)[1] for k in last[0] if k.startswith("val_loss/")]


def boundaries(run: RunLog) -> list[tuple[str, int, float]]:
    """(what, step, tokens seen) for each line every panel marks: the end of warmup, the
    start of the decay leg, each data stage after the first, each resume and the branch
    point; only those the run has reached."""
    start, phases = run.starts[-1], run.starts[-1]["phases"]
    marks = [("warmup end", phases["warmup_steps"]), ("decay start", phases["decay_start"])]
    marks += [("data stage", s) for s in sorted({row["start"] for row in start["plan"]}) if s]
    if run.branch:
        marks.append((f"branched from {run.branch[0]}", run.branch[1]))
    marks += [("resume", s["step"]) for s in run.starts[1:]
              if s["step"] and (not run.branch or s["step"] != run.branch[1])]
    reached = results(run)["step"]
    marks = [(what, step) for what, step in marks if 0 < step <= reached]
    tokens = tokens_at(run, [step for _, step in marks])
    return [(what, step, x) for (what, step), x in zip(marks, tokens)]


# (colour, line style) of each boundary. The decay start, the line a WSD reader looks for,
# is black dash-dot: no curve is black or dash-dot (the curves take the colour cycle C0, C1,
# …, grey and red, in solid, dashed and dotted lines), so it never reads as a learning rate.
BOUNDARY_STYLE = {"warmup end": ("tab:green", "--"), "decay start": ("black", "-."),
                  "data stage": ("tab:purple", "-."), "resume": ("0.5", ":")}


def mark_boundaries(ax, marks: list, color: str | None, label: bool):
    """Vertical lines at `boundaries`, each with gid "boundary:<what>:<step>". The schedule's
    and the data's lines keep their own colours; a resume or a branch point, which belongs
    to one run, takes the run's `color` where runs are compared. Where `label`, each is
    named once in the panel's legend."""
    named = set(ax.get_legend_handles_labels()[1])
    for what, step, x in marks:
        kind = what if what in BOUNDARY_STYLE else "resume"  # a branch point draws as one
        line_color, style = BOUNDARY_STYLE[kind]
        if kind == "resume":
            line_color = color or line_color
        ax.axvline(x, color=line_color, ls=style, lw=0.9, alpha=0.8,
                   label=what if label and what not in named else None,
                   gid=f"boundary:{what}:{step}")
        named.add(what)


def tokens_at(run: RunLog, steps: list[int]) -> list[float]:
    """Tokens seen at each step: read off the log where it has the step, and between or past
    logged steps at the global batch of the start in effect."""
    known = {s["step"]: s["tokens_seen"] for s in run.starts}
    known.update({r["step"]: r["tokens_seen"] for kind in ("train", "eval")
                  for r in run.rows(kind)})
    at = sorted(known)
    batch = run.config["global_batch_tokens"]
    out = []
    for step in steps:
        below = max((s for s in at if s <= step), default=None)
        out.append(float(known[below] + (step - below) * batch) if below is not None
                   else float(step * batch))
    return out


def finish(fig: Figure, axes: dict, runs: list[RunLog]):
    """Titles, units, legends and the tokens axis."""
    units = {"train loss": "nats/token", "val loss": "nats/token", "tokens/s": "all ranks",
             "MFU": "% of peak, causal FLOPs", "learning rate": "", "gradient norm": "before clip",
             ACCURACY: "acc_norm —, acc --, chance ···"}
    for title, ax in axes.items():
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel(units[title], fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc=LEGEND_AT[title])
    if not any(line.get_gid() == "mfu" for line in axes["MFU"].lines):
        axes["MFU"].text(0.5, 0.5, "MFU n/a: no peak FLOP/s known for this device",
                         ha="center", va="center", transform=axes["MFU"].transAxes)
    for ax in (axes["tokens/s"], axes["MFU"], axes.get(ACCURACY)):
        if ax is None:
            continue
        ax.set_xlabel("tokens seen")
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides them above an empty place
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: count(x)))
    head = runs[0] if len(runs) == 1 else None
    fig.suptitle(title_of(head) if head else " vs ".join(run.name for run in runs))


def title_of(run: RunLog) -> str:
    done, start = results(run), run.starts[-1]
    return (f"{run.name}: preset {start.get('preset')}, {done['outcome']} at step "
            f"{done['step']:,} of {run.config['stop_at_step']:,}, code {start['revision'][:12]}")


def count(n: float) -> str:
    """1234567 -> 1.23M; tokens and steps in the units people say them."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


# ---------------------------------------------------------------------------------------
# The markdown
# ---------------------------------------------------------------------------------------

def markdown(run: RunLog, verdict: str | None) -> str:
    """report.md: the figure, the results, each start, the config's diff from its preset,
    the data plan and the sample."""
    done, start = results(run), run.starts[-1]
    lines = [f"# Run report: {run.name}", "", "![curves](report.png)", "",
             f"{title_of(run)}.", ""]
    if verdict:
        lines += [verdict[0].upper() + verdict[1:] + ".", ""]
    lines += ["## Results", "", "| | |", "|---|---|", *results_rows(run, done), "",
              "## Starts", "", "Each start of the run: where it began, the code and hardware "
              "it ran on, the knobs a resume changed, and how it ended.", "",
              "| step | started | code | hardware | changed on resume | ended |",
              "|---|---|---|---|---|---|", *start_rows(run), "",
              f"## Config: the differences from the preset {start.get('preset')}", ""]
    changes = start.get("preset_changes", [])
    lines += (["| knob | preset | this run |", "|---|---|---|",
               *(f"| {k} | {cell(a)} | {cell(b)} |" for k, a, b in changes)]
              if changes else ["None: the preset as it is."])
    lines += ["", "## Data plan", "", "| from step | source | weight | tokens available "
              "(one epoch) | tokens planned | epochs |", "|---|---|---|---|---|---|"]
    lines += [f"| {row['start']:,} | {row['source']} | {row['weight']:g} | "
              f"{row['available']:,} | {row['planned']:,} | "
              f"{row['planned'] / row['available']:.2f} |" for row in start["plan"]]
    sample = run.rows("sample")
    if sample:
        text = sample[-1]["text"]  # the prompt and its continuation
        fence = "`" * max(3, 1 + max((len(r) for r in text.split("\n") if set(r) == {"`"}),
                                     default=0))
        lines += ["", f"## Sample at step {sample[-1]['step']:,}", "", f"{fence}text", text,
                  fence]
    return "\n".join(lines + run_warnings(run)) + "\n"


def results_rows(run: RunLog, done: dict) -> list[str]:
    """The results table's rows: each number as the log has it, to the digits shown."""
    per_source = ", ".join(f"{name} {number(v)}" for name, v in done["val_loss_per_source"].items())
    warm = "" if done["throughput_warm"] else " (no interval but the first: warm-up included)"
    checkpoints = done["checkpoints"]
    rows = [
        ("outcome", f"{done['outcome']} at step {done['step']:,} of "
                    f"{run.config['stop_at_step']:,}"),
        (f"train loss, step {done['train_step'] or 0:,}", number(done["train_loss"])),
        (f"val loss, step {done['eval_step'] or 0:,}", number(done["val_loss"])
         + (f" (the mixture; {per_source})" if len(done["val_loss_per_source"]) > 1 else "")),
        ("val bits per byte", number(done["val_bpb"])),
        *((f"{task} acc_norm / acc, step {a['step']:,}", f"{number(a['acc_norm'])} / "
           f"{number(a['acc'])} (chance {number(a['chance'])})")
          for task, a in done["tasks"].items()),
        ("tokens seen", f"{done['tokens_seen']:,}"),
        ("wall time", f"{duration(done['wall_s'])} over {done['starts']} start"
                      f"{'s' if done['starts'] > 1 else ''} (training, evaluation and "
                      f"checkpoints; setup not counted)"),
        ("tokens/s", (f"{done['tokens_per_s']:,.0f}" if done["tokens_per_s"] else "n/a")
         + ", mean over the log intervals, the first of each start left out" + warm),
        ("MFU", f"{done['mfu']:.1%} (causal FLOPs)" if done["mfu"] is not None
         else "n/a (no peak FLOP/s known for this device)"),
        ("peak memory", f"{done['peak_memory_gib']:.2f} GiB" if done["peak_memory_gib"]
         is not None else "n/a"),
        ("skipped steps", f"{done['skipped_steps']:,}"),
        ("checkpoints written", f"{len(checkpoints)}" + (
            f" (steps {', '.join(f'{s:,}' for s in checkpoints)})" if checkpoints else "")),
    ]
    return [f"| {name} | {value} |" for name, value in rows]


def start_rows(run: RunLog) -> list[str]:
    rows = []
    for start, end in zip(run.starts, run.ends):
        hw = start["hardware"]
        mode = "one process" if hw["distributed"] == "NO" else hw["distributed"]  # accelerate's
        hardware = (f"{hw['world']} × {hw.get('device_name') or hw['device']} ({mode}, "
                    f"precision {hw['precision']}, torch {hw.get('torch', '?')})")
        changed = ", ".join(f"{k} {cell(a)} → {cell(b)}" for k, a, b in start["resume_changes"])
        if start.get("resumed_from") and not changed:
            changed = "none"
        ended = (f"{end['outcome']} at step {end['step']:,}" + (f": {end['error']}"
                 if end.get("error") else "")) if end else "no end record (killed?)"
        cells = [f"{start['step']:,}", start["time"], start["revision"][:12], hardware,
                 changed or "—", ended]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def run_warnings(run: RunLog) -> list[str]:
    return ["", "## Warnings", "", *(f"- {w}" for w in run.warnings)] if run.warnings else []


def number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def cell(value) -> str:
    """A config value in a table cell."""
    return json.dumps(value).replace("|", "\\|")


def duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s"


def comparison(runs: list[RunLog]) -> str:
    """report.md of several runs: the overlay, their finals, and the knobs that differ."""
    lines = [f"# Runs compared: {', '.join(run.name for run in runs)}", "",
             "![curves](report.png)", ""]
    lines += [f"{run.name} continues {run.branch[0]} from its step {run.branch[1]:,}: up to "
              f"there they are the same run." for run in runs if run.branch]
    scored = list(dict.fromkeys(task for run in runs for task in tasks(run)))
    lines += ["", "## Finals", "", "| run | outcome | step | tokens seen | train loss | "
              "val loss | val bpb | tokens/s | MFU | wall time |"
              + "".join(f" {task} acc_norm / acc |" for task in scored),
              "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(scored)]
    for run in runs:
        done = results(run)
        lines.append(f"| {run.name} | {done['outcome']} | {done['step']:,} | "
                     f"{done['tokens_seen']:,} | {number(done['train_loss'])} | "
                     f"{number(done['val_loss'])} | {number(done['val_bpb'])} | "
                     + (f"{done['tokens_per_s']:,.0f}" if done["tokens_per_s"] else "n/a")
                     + f" | {'n/a' if done['mfu'] is None else format(done['mfu'], '.1%')} | "
                     f"{duration(done['wall_s'])} |"
                     + "".join(f" {number(done['tasks'][t]['acc_norm'])} / "
                               f"{number(done['tasks'][t]['acc'])} |" if t in done["tasks"]
                               else " n/a |" for t in scored))
    differing = knob_differences(runs)
    lines += ["", "## Knobs that differ", ""]
    lines += (["| knob | " + " | ".join(run.name for run in runs) + " |",
               "|---|" + "---|" * len(runs),
               *(f"| {knob} | " + " | ".join(cell(v) for v in values) + " |"
                 for knob, values in differing.items())]
              if differing else ["None (out_dir and resume aside)."])
    return "\n".join(lines + [w for run in runs for w in run_warnings(run)]) + "\n"


def knob_differences(runs: list[RunLog]) -> dict[str, list]:
    """knob -> each run's value, for the knobs the runs' final configs do not share."""
    flat = [config.flat(run.config) for run in runs]
    knobs = sorted(set().union(*flat) - NOT_COMPARED)
    # A knob one config lacks (a log older than the knob) differs even from a null.
    return {k: [c.get(k) for c in flat] for k in knobs
            if len({json.dumps((k in c, c.get(k))) for c in flat}) > 1}


# ---------------------------------------------------------------------------------------
# Writing, and the command
# ---------------------------------------------------------------------------------------

def write(folders: list, out: Path | None = None) -> tuple[Path, str | None, list[str]]:
    """report.md and report.png of one run (into its folder unless `out` says) or of
    several compared (into `out`); the folder written, the reference verdict of a single
    run (reference_verdict), and the warnings of the logs read."""
    runs = [read_run(folder) for folder in folders]
    out = Path(out or folders[0])
    verdict = reference_verdict(runs[0]) if len(runs) == 1 else None
    if len(runs) == 1:
        reference = reference_runs(reference_precision(runs[0])) if verdict else []
        figure, text = draw(runs, reference), markdown(runs[0], verdict)
    else:
        figure, text = draw(runs), comparison(runs)
    out.mkdir(parents=True, exist_ok=True)
    # Each file appears whole or not at all, even with a second writer at work (a restart
    # whose report overlaps the one before).
    tmp = f".tmp-{os.getpid()}"
    figure.savefig(out / f"report.png{tmp}", format="png", dpi=100)
    (out / f"report.md{tmp}").write_text(text, encoding="utf-8")
    os.replace(out / f"report.png{tmp}", out / "report.png")
    os.replace(out / f"report.md{tmp}", out / "report.md")
    return out, verdict, [w for run in runs for w in run.warnings]


def cli(argv=None):
    parser = ArgumentParser(
        description="Write report.md and report.png from a run's out_dir (its metrics.jsonl "
                    "alone), or compare several runs in one figure and table.")
    parser.add_argument("folders", nargs="+", metavar="OUT_DIR", help="a run's out_dir")
    parser.add_argument("--out", metavar="DIR", help="where to write; required to compare "
                        "several runs (default for one run: its own folder)")
    parser.add_argument("--quiet", action="store_true",
                        help="print nothing but errors (report.md lists the warnings)")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its message")
    args = parser.parse_args(argv)
    with user_errors(args.debug):
        if len(args.folders) > 1 and not args.out:
            raise ValueError(f"comparing {len(args.folders)} runs needs --out DIR, a folder "
                             f"for the comparison's report.md and report.png")
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise NotADirectoryError(f"--out {args.out} is a file; give a folder for "
                                     f"report.md and report.png (made if missing)")
        out, verdict, warnings = write(args.folders, args.out)
        if args.quiet:
            return
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(f"report: {out / 'report.md'} and {out / 'report.png'}")
        if verdict:
            print(verdict)


if __name__ == "__main__":
    cli()
