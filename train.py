"""train.py: the training loop, the lesson of this repository. Read it top to bottom.

    python train.py                      # Stack-100M on a GPU; `tiny` on a CPU-only machine
    python train.py --preset tiny        # ~4M parameters, minutes on a laptop CPU
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py   # many GPUs

`main(cfg)` is the whole program: `setup` builds the run's parts, `train` is the loop, and a
finished run prints a sample. Each pass evaluates (every eval_every steps) and checkpoints
(every ckpt_every) the step it reached, sets the lrs and the data stage from the step, takes
one optimizer step (`train_step`) and logs; the last step is evaluated and saved by the same
lines. accelerate supplies the launch, DDP, bf16 autocast and the accumulation's gradient
sync; train.py shards for FSDP2 itself (`shard_model`).

Imports from stacklm: checkpoint, cli, config, data, downstream, launch, log, model, optim,
overrides, preflight, resume and shards: it composes them. config, data, model and optim
are the lesson beside it; the others are plumbing/, one concern a file.
"""

import dataclasses
import math
import os
import sys
import time
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tokenizers import Tokenizer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import config
import data
import optim
from config import TrainConfig
from model import Transformer, complete
from plumbing import checkpoint, downstream, launch, log, overrides, preflight, resume, shards
from plumbing.cli import is_rank0, user_errors


@dataclasses.dataclass
class Run:
    """What the loop works on, made once by `setup`."""
    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizers: optim.Optimizers  # Muon (or AdamW) on the matrices, AdamW on the rest
    loader: data.MixtureLoader
    stages: list[data.Stage]  # the data stages: which sources, by weight, from which step
    manifests: dict[str, dict]  # each source's manifest.json
    eval_sources: dict[str, float]  # the sources evaluated, and their shares of val_loss
    tasks: list[downstream.Task]  # the multiple-choice tasks scored beside the val loss
    facts: log.RunFacts  # what the banner and metrics.jsonl's start record say of this start
    saver: checkpoint.Saver  # writes the checkpoints, blocking or in the background
    step: int = 0  # optimizer steps taken, advanced by the loop
    tokens_seen: int = 0  # tokens trained on, all ranks together
    skipped_steps: int = 0  # updates skipped for a non-finite loss or grad norm, in all
    new_sources: bool = False  # a resume added sources: evaluate them before training on

    def state_dict(self) -> dict:
        """train_state.json (beside the weights, optimizers and RNGs): the counters and the
        loader's cursor a resume restores, and what it checks the resuming run against."""
        first = next(iter(self.manifests.values()))
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "skipped_steps": self.skipped_steps, "loader": self.loader.state_dict(),
                "world_size": self.accelerator.num_processes, "stages": self.stages,
                "tokenizer_sha256": first["tokenizer"]["sha256"],
                "revision": self.facts.revision,  # the code that trained it
                "config": dataclasses.asdict(self.cfg)}

    def load_state_dict(self, state: dict):
        """The counters and the loader's cursor; the loader refuses changed sources."""
        self.loader.load_state_dict(state["loader"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_steps = state["skipped_steps"]
        self.new_sources = bool(set(self.loader.sources) - set(state["loader"]["consumed"]))


def main(cfg: TrainConfig, force: bool = False) -> dict:
    """Train as `cfg` says; return the last logged metrics and the final evaluation."""
    # From here on, SIGTERM (a preemption) or Ctrl-C finishes the step in flight, saves and
    # exits 0 (a second Ctrl-C quits now); in setup, after the first step (S + 1 from step S).
    with launch.StopFlag() as stop:
        run = setup(cfg, force)  # force (--force): start even past a CPU's RAM
        # The log: the terminal, metrics.jsonl (the run report's source), wandb, TensorBoard.
        # However the run ends, leaving this block records how and writes the report, once
        # `run.saver` has waited for a checkpoint still being written in the background.
        with log.MetricsLogger(cfg, run.accelerator.is_main_process, run.accelerator.device,
                               run.accelerator.num_processes, log.model_flops(cfg),
                               start_step=run.step) as logger, run.saver:
            logger.log_start(log.start_record(cfg, run.facts, run.step, run.tokens_seen))
            metrics = train(run, stop, logger)
            if run.step == cfg.stop_at_step:
                metrics["sample"] = sample_text(cfg, run.accelerator, run.model)
                logger.log_sample(run.step, cfg.sample_prompt, metrics["sample"])
        outcome = "finished" if run.step == cfg.stop_at_step else "stopped"
        launch.record_outcome(outcome, run.step, run.accelerator.is_local_main_process)
    return metrics


def train(run: Run, stop: launch.StopFlag, logger: log.MetricsLogger) -> dict:
    """The loop, from run.step to cfg.stop_at_step or a stop request; returns the last logged
    metrics. Each pass evaluates and saves the step it has reached, when due, then trains
    one step; the last step is evaluated and saved by the same lines (nanochat's `last_step`)."""
    cfg, first_step = run.cfg, run.step
    # every source shares one tokenizer (preflight checks), so one byte table serves all
    token_bytes = data.token_bytes(run.stages[0].sources[0][0]).to(run.accelerator.device)
    streak, train_seconds, metrics = 0, 0.0, {}  # streak: updates skipped in a row
    while True:
        last_step = run.step == cfg.stop_at_step
        # A source new to a resumed run is evaluated at once: its curve has a before.
        if run.step % cfg.eval_every == 0 or last_step or run.new_sources:
            metrics.update(logger.log_eval(run.step, run.tokens_seen, evaluate(run, token_bytes)))
        # Not the step the run started from (step 0, or the checkpoint it resumed from),
        # and never during a non-finite streak: the weights may already be the damage.
        if (run.step % cfg.ckpt_every == 0 or last_step) and run.step != first_step \
                and not streak:
            save_checkpoint(run, logger, blocking=last_step)  # the last step's: never async
        if last_step:
            return metrics

        # The learning rate is a pure function of the step (never a prepared scheduler:
        # accelerate would step it once per process), and so is the data stage.
        run.optimizers.set_lr(optim.lr_multiplier(run.step, cfg))
        run.loader.set_step(run.step)
        result = train_step(run, stop)
        logger.log_checkpoints(run.saver.poll())  # those written in the background, once done
        run.step += 1
        run.tokens_seen += cfg.global_batch_tokens
        train_seconds += result.seconds
        streak = count_skipped(run, result, streak, logger)  # gives up after a long streak
        if run.step % cfg.log_every == 0 or run.step == cfg.stop_at_step:
            metrics.update(logger.log_train(run, result, train_seconds))
        # A signal: save this step and stop. The last step goes round once more instead,
        # to be evaluated and saved like any run's end.
        if result.stop and run.step != cfg.stop_at_step:
            stop_here(run, logger, saved=not streak)
            return metrics


def setup(cfg: TrainConfig, force: bool = False) -> Run:
    """The run's parts, in the order they are built: the checkpoints it may continue, the
    accelerator, what preflight checked (data, tasks, the banner's facts), the loader, the
    model, the optimizers, accelerate's wrapping, and the resume. Every config and data
    mistake fails before the model is built."""
    found = resume.candidates(cfg)  # refuses an overwrite; says when there is nothing to train
    accelerator = launch.make_accelerator(cfg)
    plan = preflight.check(cfg, accelerator, force)  # every other refusal; the banner's facts
    with accelerator.main_process_first():  # rank 0 hashes the shards; the others trust it
        loader = data.MixtureLoader(plan.stages, cfg.seq_len, cfg.micro_batch_size,
                                    accelerator.process_index, accelerator.num_processes,
                                    seed=cfg.seed)
    model = build_model(cfg, plan.compile_blocks)
    bf16 = accelerator.mixed_precision == "bf16"
    if plan.sharded:  # before the optimizers are built, so they hold the sharded parameters
        model = shard_model(model, accelerator.device, bf16,
                            launch.reshard_after_forward(os.environ))
    optimizers = optim.build_optimizers(model, cfg, accelerator.mixed_precision)
    accelerator.print(log.banner(cfg, plan.facts, model, optimizers, optim.schedule_summary(cfg),
                                 log.model_flops(cfg)))
    accelerator.print("\n".join(plan.warnings), end="\n" if plan.warnings else "")
    if not plan.sharded:  # DDP (several ranks) and bf16 autocast; a sharded model needs neither
        model, *prepared = accelerator.prepare(model, *optimizers.named.values())
        optimizers = optim.Optimizers(dict(zip(optimizers.named, prepared, strict=True)))
    run = Run(cfg, accelerator, model, optimizers, loader, plan.stages, plan.manifests,
              plan.eval_sources, plan.tasks, plan.facts,
              checkpoint.Saver(accelerator, in_background=cfg.ckpt_async))
    run.facts.resumed_from = resume.resume(run, found)  # None: a fresh start
    return run


class StepResult(NamedTuple):
    """What one optimizer step reports: global numbers, the same on every rank."""
    loss: float  # ce + z, per target token of the global batch
    ce: float
    z: float
    grad_norm: float  # before clipping
    skipped: bool  # the loss or the norm was not finite: the weights were left as they were
    stop: bool  # some rank was asked to stop (SIGTERM or Ctrl-C)
    seconds: float


def train_step(run: Run, stop: launch.StopFlag) -> StepResult:
    """One optimizer step over the global batch: forward and backward on every micro-batch,
    clip, step both optimizers; a non-finite loss or norm skips the update.

    The loss is the mean over every target token of the global batch, all micro-batches on
    all ranks, as one big batch: each micro-batch returns the *sum* of its token losses, over
    the targets counted before any backward. A mean of per-micro-batch means would weight
    each token by 1 / (its micro-batch's targets): wrong wherever the counts differ."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    world = accelerator.num_processes
    accum = cfg.grad_accum_steps(world)
    t0 = time.perf_counter()
    # Every micro-batch is read first: the global token count is each one's denominator.
    # No overlap of reading with compute (nanoGPT prefetches) costs little (docs/figures.md).
    batches = [next(run.loader) for _ in range(accum)]  # accum × (B, T) per rank
    n_tokens = sum(int((b["targets"] != -100).sum()) for b in batches)
    n_tokens = accelerator.reduce(torch.tensor(n_tokens, device=accelerator.device), "sum")
    # backward() divides the loss by accum, and DDP/FSDP average the gradients over the
    # ranks: this scale undoes both, so the gradient is d(sum of token losses) / n_tokens.
    scale = accum * world / n_tokens.float()
    sums = torch.zeros(3, device=accelerator.device)  # loss, ce, z summed over tokens
    for i, batch in enumerate(batches):
        batch = to_device(batch, accelerator.device)
        # accumulate() skips DDP's all-reduce on all but the last micro-batch: gradients add
        # up locally and cross the network once a step. accelerate skips FSDP2's reduce-
        # scatter only where it chose FSDP itself (GPUs); train.py shards on any device, so
        # it tells its FSDP2 model itself.
        with accelerator.accumulate(model):
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == accum - 1)
            loss, ce, z = model(**batch, reduction="sum")
            accelerator.backward(loss * scale)
        sums += torch.stack([loss.detach().float(), ce.float(), z.float()])  # on the device

    # The norm is measured before clipping: the logged gnorm is what the step produced.
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    # The host waits for the device here (.tolist(), float()): until now it only queued
    # work. The step must wait anyway: whether to update depends on these numbers.
    loss, ce, z = (accelerator.reduce(sums, "sum") / n_tokens).tolist()
    grad_norm = float(grad_norm)
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        run.optimizers.step()
    run.optimizers.zero_grad()
    # Read last, so a signal that arrives during this step stops the run after it. Every
    # rank must stop at the same step, and a signal may reach one rank only: the flag is
    # summed over the ranks, so one rank's request stops them all.
    stop_votes = accelerator.reduce(stop.tensor(accelerator.device), "sum")
    return StepResult(loss, ce, z, grad_norm, skipped, stop_votes.item() > 0,
                      time.perf_counter() - t0)


def evaluate(run: Run, token_bytes: torch.Tensor) -> dict:
    """Every evaluated source's val loss and bits per byte (`val_loss/<data_dir>`), the
    mixture's (their mean at fixed shares, data.val_shares: comparable across a stage switch)
    and, when due, the downstream tasks' accuracies (`acc/<task>`, `acc_norm/<task>`)."""
    metrics = downstream.score(run.tasks, run.model, run.accelerator, run.cfg.micro_batch_size) \
        if downstream.due(run.cfg, run.step) else {}
    for source in run.eval_sources:
        result = val_loss(run.cfg, run.accelerator, run.model, token_bytes, source)
        metrics.update({f"{k}/{source}": v for k, v in result.items()})
    run.new_sources = False
    for key in ("val_loss", "val_bpb"):
        metrics[key] = sum(weight * metrics[f"{key}/{source}"]
                           for source, weight in run.eval_sources.items() if weight)
    return metrics


@torch.no_grad()
def val_loss(cfg: TrainConfig, accelerator, model, token_bytes, data_dir) -> dict:
    """Validation loss (cross-entropy in nats, no z-loss) and bits per byte over the first
    `eval_tokens` of data_dir's val split (all of it if smaller, or none), in a fixed order,
    summed across ranks.

    Bits per byte = total CE / ln 2 / total UTF-8 bytes of the target tokens: unlike the
    loss, it does not depend on the tokenizer, so runs with different vocabularies compare."""
    B, rank, world = cfg.micro_batch_size, accelerator.process_index, accelerator.num_processes
    loader = data.PackedShardLoader(data_dir, "val", cfg.seq_len, B, rank, world, seed=cfg.seed)
    # At most one pass over the split, so no window counts twice (a small split is not re-read
    # to fill eval_tokens or the last global micro-batch): rows past the last window are
    # padding without targets (-100), and every rank still runs each forward, as FSDP2 needs.
    n_windows = config.eval_windows(cfg, loader.windows_per_epoch)
    totals = torch.zeros(3, device=accelerator.device)  # ce nats, tokens, bytes
    model.eval()
    for first in range(0, n_windows, B * world):  # global window index of the batch's row 0
        batch = next(loader)
        padding = first + rank * B + torch.arange(B) >= n_windows  # (B,)
        batch["targets"][padding] = -100
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        ce = model(**batch, reduction="sum").ce
        targets = batch["targets"][batch["targets"] != -100]
        totals += torch.stack([ce.float(), torch.tensor(float(targets.numel()),
                              device=totals.device), token_bytes[targets].sum().float()])
    model.train()
    ce_sum, n_tokens, n_bytes = accelerator.reduce(totals, "sum").tolist()
    return {"val_loss": ce_sum / n_tokens, "val_bpb": ce_sum / math.log(2) / n_bytes}


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's (B, T) tensors on `device`, through pinned memory for a GPU (as nanoGPT):
    from there a non_blocking copy returns at once, and the host goes on queueing work."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def build_model(cfg: TrainConfig, compile_blocks: bool) -> Transformer:
    """The model, seeded so every rank starts from identical weights. Each block is compiled
    on its own (torchtitan's regional compilation): fast, and FSDP2's hooks, added later
    around each block, stay outside the compiled code, which whole-model compiling skips."""
    set_seed(cfg.seed)
    model = Transformer(cfg.model)
    model.loss_head_dtype = cfg.loss_head_dtype
    for layer, block in enumerate(model.blocks):  # recompute, then compile, then shard
        block.recompute = cfg.block_recompute(layer)
    if compile_blocks:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return model


def shard_model(model: Transformer, device: torch.device, bf16: bool,
                reshard_after_forward: bool = True) -> Transformer:
    """FSDP2 (`fully_shard`): one group per block, then the root, which holds the tied
    embedding (used at both ends of the forward: one group) and runs the loss head where
    that weight is gathered. Parameters are gathered in bf16, gradients reduce-scattered in
    fp32 (accelerate's bf16 would drop the low bits of many small per-rank contributions).
    A block's inputs are not cast: the residual arrives in bf16 from the root, and RoPE's cos
    and sin stay fp32 (bf16 angles are 2e-3 off at 2,048). reshard_after_forward False (the
    launch config's) keeps each block's weights gathered to its backward: an all-gather fewer."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    model.to(device)
    return shard_layout(model, mesh, bf16, reshard_after_forward, reshard_after_forward)


def shard_layout(model: Transformer, mesh, bf16: bool, blocks_reshard: bool,
                 root_reshard: bool) -> Transformer:
    """shard_model's groups and precision on `mesh` (integrations/torchtitan shares them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=blocks_reshard,
                    mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=root_reshard)
    return model


def save_checkpoint(run: Run, logger: log.MetricsLogger, blocking: bool = True):
    """out_dir/ckpt/step_XXXXXXX: weights, optimizers, RNGs and run.state_dict(), all a
    bitwise resume needs, written in the background with ckpt_async unless `blocking`; the
    log records each checkpoint once complete (and redraws the run report)."""
    # Never pruned: where a stage or the decay leg begins, the branch points of anneals.
    keep = {stage.first_step for stage in run.stages} | {config.wsd_phases(run.cfg).decay_start}
    logger.log_checkpoints(run.saver.save(
        run.accelerator.unwrap_model(run.model), list(run.optimizers.named.values()),
        run.state_dict(), run.cfg.out_dir, run.cfg.keep_last_ckpts, keep, blocking))


def sample_text(cfg: TrainConfig, accelerator, model) -> str:
    """A completion of cfg.sample_prompt, on every rank (FSDP needs all); seeded, with the
    training RNG state put back afterwards, so sampling never changes a resumed run."""
    source = config.parse_mixture(cfg.data_dir)[0][0]  # every source shares its tokenizer
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(source))
    with torch.random.fork_rng():  # every torch generator is put back on exit
        torch.manual_seed(cfg.seed)
        return complete(accelerator.unwrap_model(model), tokenizer, cfg.sample_prompt,
                        cfg.sample_tokens, eos_id=shards.load_manifest(source)["eos_id"])


def count_skipped(run: Run, result: StepResult, streak: int, logger: log.MetricsLogger) -> int:
    """The updates skipped in a row, this step's included; each is logged, and max_bad_steps
    in a row stop the run (checkpoint.give_up)."""
    if not result.skipped:
        return 0
    run.skipped_steps += 1
    logger.log_skipped(run.step, result.loss, result.grad_norm, run.skipped_steps)
    if streak + 1 >= run.cfg.max_bad_steps:
        checkpoint.give_up(run.cfg, run.step, streak + 1, run.optimizers.lrs(),
                           run.accelerator.is_main_process)
    return streak + 1


def stop_here(run: Run, logger: log.MetricsLogger, saved: bool):
    """A stop request (SIGTERM, Ctrl-C): save this step, unless a non-finite streak makes the
    weights suspect, and say how to go on."""
    if saved:
        save_checkpoint(run, logger)
    run.accelerator.print(f"stop requested after step {run.step:,}; run the same command to "
                          f"resume from {checkpoint.newest(run.cfg.out_dir)}")


# What a user can fix is one line (cli.user_errors); anything else keeps its traceback.
USER_ERRORS = (ValueError, OSError, checkpoint.TrainingDiverged)


def cli(argv=None):
    """`python train.py [--preset P] [--config RUN.TOML] [--key=value ...]`; bare: Stack-100M
    on a GPU, else `tiny`. A user error is one line and exit status 2 (`--debug`: traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    default = "stack100m" if torch.cuda.is_available() else "tiny"
    with launch.leaving_process_group(), \
            user_errors("--debug" in argv, USER_ERRORS, launch.StopFlag.QUIT):
        cfg, args = overrides.parse_args(argv, default_preset=default)
        if args.preset is None and default == "tiny" and is_rank0():
            print("no CUDA GPU found: running the `tiny` preset (pass --preset stack100m to "
                  "insist)")
        main(cfg, args.force)


if __name__ == "__main__":
    cli()
