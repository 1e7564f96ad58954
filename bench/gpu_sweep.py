"""What each speed and memory choice buys: Stack-100M trained variant by variant on one GPU.

    python bench/gpu_sweep.py              # one H100/H200: ~8 minutes (--budget_s=450)
    python bench/gpu_sweep.py --dry-run    # the same code at tiny shapes on the CPU, <1 min

bench/gpu_check.sh runs it last in the first lent GPU's one prepared call, with the time
the stages before it left (docs/figures.md has the call's budget, stage by stage).

Each variant builds its own model and optimizers from the same seed (train.build_model,
optim.build_optimizers, launch.make_accelerator), reads the same batches of the
built-in corpus (data/stdlib-32k, prepared if missing) and runs the trainer's own step
(train.train_step): `warmup` steps for compilation and warm-up, then `steps` timed ones
between two CUDA synchronisations. A variant that fails (out of memory, a compile error,
the time budget) reports its error in its row and the sweep goes on. It prints a table,
then one JSON line: {"variants": [{"name", "tokens_per_s", "mfu", "mfu_palm", "peak_gib",
"loss", "error", ...}]}. MFU is tokens/s × FLOP/token over the GPU's dense bf16 peak: "mfu" in the
causal convention, "mfu_palm" in PaLM's (model.flops_per_token); null where the peak is
unknown (CPUs). peak_gib is torch.cuda.max_memory_allocated, reset per variant (on a CPU,
the process's peak resident memory so far). loss is the last step's training loss: the
variants see the same batches from the same weights, so their losses differ only by
rounding, except causal_only's, whose attention also crosses documents.

Budget: a Stack-100M step (524,288 tokens) takes ~1 s on an H200 at ~45% MFU; compiling
takes ~1 minute the first time and less for later variants (inductor's cache). A variant
that would start with less than --min_variant_s left is skipped, and one that overruns
its own bound (row_bound: its compile allowance and STEP_S a step) or the budget is
stopped by an alarm, so the sweep (data preparation included) ends within about
--budget_s, and one slow row leaves the others their time.
"""

import contextlib
import dataclasses
import gc
import json
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402
import optim  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from model import flops_per_token  # noqa: E402
from plumbing import checkpoint, cli, launch, log, overrides  # noqa: E402

import cpu_speed  # noqa: E402  (the levers, beside it in bench/)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    what: str  # one line for the table
    overrides: dict = dataclasses.field(default_factory=dict)  # TrainConfig knobs
    drop_seq_ids: bool = False  # attention without document masking
    ns_dtype: torch.dtype | None = None  # Muon's Newton–Schulz precision; None: its default
    whole_compile: bool = False  # torch.compile(model) instead of per-block compilation
    undo: str | None = None  # one of cpu_speed.LEVERS, undone (the code it replaced)
    compile_s: float = 45.0  # the row's allowance for compilation, in its bound (row_bound)


# In the order the docs depend on them: the default, then the rows behind docs/scale.md's
# memory table (recomputation, the loss head's chunks), then the tuning rows. When the budget
# runs short, the last ones are skipped. compile_s is each row's allowance for compilation
# (inductor's cache serves a graph compiled before): its bound is that plus STEP_S a step.
VARIANTS = [
    Variant("default", "bf16 autocast, per-block compile, fp32 loss head, micro 32, NS bf16",
            compile_s=75),
    # Activation recomputation at the same micro-batch: what each mode costs in time (and,
    # in the peak memory column, what it saves) against the default's none.
    Variant("recompute_selective", "selective recomputation (attention and every other "
            "matmul kept)", {"activation_recompute": "selective"}, compile_s=75),
    Variant("recompute_full", "full recomputation (each block keeps its input)",
            {"activation_recompute": "full"}, compile_s=75),
    # A micro-batch (32 × 2,048) feeds 65,536 rows to the loss head; ce_chunk_size is 4,096.
    Variant("chunk1024", "loss head 1,024 rows at a time instead of 4,096: less memory",
            {"model.ce_chunk_size": 1024}),
    Variant("chunk16384", "loss head 16,384 rows at a time instead of 4,096: larger matmuls",
            {"model.ce_chunk_size": 16384}),
    Variant("head_bf16", "loss head on bf16 operands, fp32 accumulation and logsumexp",
            {"loss_head_dtype": "bf16"}),
    Variant("causal_only", "no document masking (seq_ids dropped): the mask's cost bound",
            drop_seq_ids=True, compile_s=60),
    Variant("micro16", "micro-batch 16 instead of 32, twice the accumulation, same batch",
            {"micro_batch_size": 16}, compile_s=60),
    Variant("ns_fp32", "Muon's Newton–Schulz in fp32 instead of bf16",
            ns_dtype=torch.float32),
    Variant("whole_compile", "torch.compile(model) instead of per-block compile",
            {"compile_model": "false"}, whole_compile=True, compile_s=150),
    # The CPU's speed levers that reach Stack-100M's step (its head is the chunked one), each
    # undone: a GPU must be no slower with them (bench/cpu_speed.py has the CPU's figures).
    Variant("ns_separate", "Newton–Schulz with its multiplies apart from the matmuls",
            undo="ns_matmul_add"),
]

# A Stack-100M step's allowance in a row's bound: ~1 s on an H200, ~1.2 s on an H100.
STEP_S = 2.0


def row_bound(variant: Variant, steps: int, warmup: int) -> float:
    """The seconds a row may run before its alarm stops it: compilation, then its steps."""
    return variant.compile_s + (steps + warmup) * STEP_S


class WithoutDocumentIds:
    """The loader's batches without seq_ids: attention is then plain causal (SDPA)."""

    def __init__(self, loader):
        self.loader = loader

    def __next__(self):
        batch = next(self.loader)
        batch.pop("seq_ids")
        return batch


class BudgetExceeded(BaseException):
    """Raised by the alarm when a variant runs past the sweep's time budget. Not an
    Exception, so that no `except Exception` inside torch.compile swallows it."""


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    if args.dry_run:
        # One thread: on a busy 2-core CI runner, torch's spinning thread pool made these
        # small steps 5-20x slower than a single thread.
        torch.set_num_threads(1)
    base, steps, warmup = base_config(args)
    prepare.ensure_builtin([base.data_dir], base.model.vocab_size)  # prepares it if missing
    chosen = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
    rows = []
    for variant in chosen:
        left = args.budget_s - (time.perf_counter() - start)
        if left < args.min_variant_s:
            row = failed_row(variant, overrides.apply_overrides(base, variant.overrides),
                             f"skipped: {left:.0f} s of --budget_s left", 0.0)
        else:
            row = run_variant(variant, base, steps, warmup, args, left)
        rows.append(row)
        print(f"[{variant.name}] {row['seconds']:.0f} s "
              f"({time.perf_counter() - start:.0f} s elapsed)"
              + (f": {row['error']}" if row["error"] else ""), flush=True)
    print(table(rows, chosen))
    print(json.dumps({"bench": "gpu_sweep", "device": device_name(), "steps": steps,
                      "warmup": warmup, "global_batch_tokens": base.global_batch_tokens,
                      "seq_len": base.seq_len, "variants": rows}))


def parse_args(argv):
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny model on the CPU, a few steps: checks the code, not speed")
    parser.add_argument("--steps", type=cli.at_least(1),
                        help="timed steps per variant (default 30; dry run 1)")
    parser.add_argument("--warmup", type=cli.at_least(0), help="untimed steps first, compilation "
                        "included (default 3; dry run 1)")
    parser.add_argument("--budget_s", type=float, default=450.0,
                        help="wall-clock seconds for all variants together (default 450)")
    parser.add_argument("--min_variant_s", type=float, default=None,
                        help="skip a variant that would start with less time left (default "
                             "60; dry run 0)")
    parser.add_argument("--variants", type=lambda s: s.split(","),
                        help=f"comma-separated subset of {','.join(v.name for v in VARIANTS)}")
    args = parser.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.warmup or 0) < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    unknown = set(args.variants or []) - {v.name for v in VARIANTS}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from "
                     f"{[v.name for v in VARIANTS]}")
    if args.min_variant_s is None:
        args.min_variant_s = 0.0 if args.dry_run else 60.0
    return args


def base_config(args) -> tuple[config.TrainConfig, int, int]:
    """Stack-100M as the reference run trains it, or (dry run) a one-layer, 64-wide `tiny`
    at a shape whose micro-batches are 32 and 16 sequences as on the GPU, on the CPU, with
    the chunked loss head Stack-100M runs (in chunks of 256 of a micro-batch's 512 rows)."""
    if args.dry_run:
        cfg = overrides.apply_overrides(config.tiny(), {
            "seq_len": 16, "micro_batch_size": 32, "global_batch_tokens": 1024,
            "mixed_precision": "no", "compile_model": "false", "model.ce_chunk_size": 256,
            "model.n_layers": 1, "model.d_model": 64, "model.intermediate": 176})
        steps, warmup = args.steps or 1, 1 if args.warmup is None else args.warmup
    else:
        cfg = config.stack100m()
        steps, warmup = args.steps or 30, 3 if args.warmup is None else args.warmup
    # A short linear warmup then the peak: every variant sees the same learning rates.
    total = steps + warmup
    cfg = overrides.apply_overrides(cfg, {"total_steps": total, "stop_at_step": total,
                                       "warmup_steps": max(1, total // 4),
                                       "decay_fraction": 0.0, "resume": "none"})
    return cfg, steps, warmup


def run_variant(variant: Variant, base, steps: int, warmup: int, args, left: float) -> dict:
    """Build, train and measure one variant; any failure becomes the row's error."""
    t0 = time.perf_counter()
    cfg = overrides.apply_overrides(base, variant.overrides)
    free_memory()
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, min(left, row_bound(variant, steps, warmup)))
        try:
            with cpu_speed.LEVERS[variant.undo]() if variant.undo else contextlib.nullcontext():
                return measure(variant, cfg, steps, warmup, args.dry_run, t0)
        finally:  # disarmed inside the try, so a late alarm is still caught below
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, BudgetExceeded) as e:  # OOM, compile errors, the budget alarm
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        return failed_row(variant, cfg, message[:300], time.perf_counter() - t0)
    finally:
        signal.signal(signal.SIGALRM, previous)
        free_memory()


def alarm(signum, frame):
    raise BudgetExceeded("the variant ran past its bound or --budget_s")


def measure(variant: Variant, cfg, steps: int, warmup: int, dry_run: bool, t0: float) -> dict:
    accelerator = launch.make_accelerator(cfg)
    model = train.build_model(cfg, launch.use_compile(cfg)[0])
    optimizers = optim.build_optimizers(model, cfg, accelerator.mixed_precision)
    if variant.ns_dtype is not None:
        optimizers.named["muon"].ns_dtype = variant.ns_dtype
    if variant.whole_compile:  # on the CPU dry run, tracing only: inductor takes minutes
        model = torch.compile(model, backend="eager" if dry_run else "inductor")
    model, *prepared = accelerator.prepare(model, *optimizers.named.values())
    optimizers = optim.Optimizers(dict(zip(optimizers.named, prepared, strict=True)))
    loader = data.PackedShardLoader(cfg.data_dir, "train", cfg.seq_len, cfg.micro_batch_size,
                                    seed=cfg.seed)
    run = train.Run(cfg=cfg, accelerator=accelerator, model=model, optimizers=optimizers,
                    loader=WithoutDocumentIds(loader) if variant.drop_seq_ids else loader,
                    stages=[], manifests={}, eval_sources={}, tasks=[], facts=None,
                    saver=checkpoint.Saver(accelerator, in_background=False))
    try:
        with launch.StopFlag() as stop:
            for step in range(warmup + steps):
                if step == warmup:
                    synchronize()
                    timed_from = time.perf_counter()
                run.optimizers.set_lr(optim.lr_multiplier(step, cfg))
                result = train.train_step(run, stop)
            synchronize()
        seconds = time.perf_counter() - timed_from
    finally:
        accelerator.free_memory()
    tokens_per_s = steps * cfg.global_batch_tokens / seconds
    peak = log.peak_flops(device_name())
    mfu = {c: flops_per_token(cfg.model, cfg.seq_len, c) * tokens_per_s / peak if peak else None
           for c in ("causal", "palm")}
    return {"name": variant.name, "micro_batch_size": cfg.micro_batch_size,
            "ce_chunk_size": cfg.model.ce_chunk_size, "tokens_per_s": round(tokens_per_s, 1),
            "mfu": mfu["causal"], "mfu_palm": mfu["palm"],
            "peak_gib": round(log.memory_gib(accelerator.device), 3),
            "loss": result.loss, "step_s": round(seconds / steps, 4),
            "seconds": round(time.perf_counter() - t0, 1), "error": None}


def failed_row(variant: Variant, cfg, error: str, seconds: float) -> dict:
    return {"name": variant.name, "micro_batch_size": cfg.micro_batch_size,
            "ce_chunk_size": cfg.model.ce_chunk_size, "tokens_per_s": None, "mfu": None,
            "mfu_palm": None, "peak_gib": None, "loss": None, "step_s": None,
            "seconds": round(seconds, 1), "error": error}


def table(rows: list[dict], variants: list[Variant]) -> str:
    """One line per variant; speed relative to the first row that ran."""
    base = next((r["tokens_per_s"] for r in rows if r["tokens_per_s"]), None)
    header = (f"{'variant':<14} {'tok/s':>10} {'vs 1st':>7} {'MFU':>6} {'palm':>6} "
              f"{'GiB':>7} {'loss':>8}  what")
    lines = [header]
    for row, variant in zip(rows, variants, strict=True):
        if row["error"]:
            lines.append(f"{row['name']:<14} {row['error']}")
            continue
        lines.append(f"{row['name']:<14} {row['tokens_per_s']:>10,.0f} "
                     f"{row['tokens_per_s'] / base:>7.3f} {percent(row['mfu'])} "
                     f"{percent(row['mfu_palm'])} {row['peak_gib']:>7.2f} {row['loss']:>8.4f}  "
                     f"{variant.what}")
    return "\n".join(lines)


def percent(x: float | None) -> str:
    return f"{x:6.1%}" if x is not None else f"{'n/a':>6}"


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory():
    """Drop the previous variant's compiled code, tensors and memory peak."""
    torch.compiler.reset()  # else a new micro-batch shape recompiles as dynamic shapes
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
