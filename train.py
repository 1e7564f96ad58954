"""train.py: the training loop, the lesson of this repository. Read it top to bottom.

    python train.py                      # Stack-100M on a GPU; `tiny` on a CPU-only machine
    python train.py --preset tiny        # ~4M parameters, minutes on a laptop CPU
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py   # many GPUs

`main(cfg)` is the whole program. `setup` builds the accelerator, data, model, optimizers
and restores the checkpoint, if any. `train` runs the loop; each pass runs, in order:
evaluate (every eval_every steps) → checkpoint (every ckpt_every steps; the log then has
report.py redraw the run report, out_dir/report.md and report.png, once more as the run
ends) → set the learning rates and the data stage from the step → one optimizer step
(forward and backward over every micro-batch, clip, step) → log. accelerate supplies the
launch (one process per rank, the rendezvous), DDP, bf16 autocast and the accumulation's
gradient sync; train.py shards the model for FSDP2 itself (`shard_model`), honours two of
the launch config's FSDP keys and refuses the rest (config.check_launch). The plumbing
(checkpoints, the log) lives in checkpoint.py and log.py.

Loss normalisation. The loss is the mean over every target token of the global batch, all
micro-batches on all ranks, as if it were one big batch. Micro-batches can hold different
numbers of targets (masked targets, ignore_index = -100, such as padding or prompt tokens
in other loaders), so a mean of per-micro-batch means would weight a token by the size of
the micro-batch it landed in. So each micro-batch returns the *sum* of its token losses,
and the target tokens of the whole global batch are counted before any backward pass.

Imports from stacklm: checkpoint, cli, config, data, hf_export, log, model, optim,
prepare and sample: it composes them.
"""

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, set_seed
from tokenizers import Tokenizer
from torch.distributed.tensor import DTensor

import checkpoint
import config
import data
import hf_export
import log
import optim
import prepare
import sample
from cli import user_errors
from config import TrainConfig
from model import Transformer, flops_per_token


@dataclass
class Run:
    """What the loop works on, made once by `setup`."""
    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizers: optim.Optimizers  # Muon (or AdamW) on the matrices, AdamW on the rest
    loader: data.MixtureLoader
    stages: list[data.Stage]  # the data stages: which sources, by weight, from which step
    manifests: dict[str, dict]  # each source's manifest.json
    step: int = 0  # optimizer steps taken, advanced by the loop
    tokens_seen: int = 0  # tokens trained on, all ranks together
    skipped_steps: int = 0  # updates skipped for a non-finite loss or grad norm, in all
    new_sources: bool = False  # a resume added sources: evaluate them before training on
    revision: str = "unknown"  # the git revision of the code that runs (log.code_revision)
    # What the log's start record says of this start (start_record), beside the above:
    hardware: log.Hardware | None = None
    plan: list[dict] = dataclasses.field(default_factory=list)  # config.data_plan's rows
    resumed_from: str | None = None  # the checkpoint this start continues
    resume_changes: list = dataclasses.field(default_factory=list)  # (knob, old, new)

    def state_dict(self) -> dict:
        """What a checkpoint's train_state.json holds (checkpoint.py writes the weights, the
        optimizers and the RNGs beside it): the counters and the loader's cursor, which a
        resume restores, and what it checks the resuming run against."""
        first = next(iter(self.manifests.values()))
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "skipped_steps": self.skipped_steps, "loader": self.loader.state_dict(),
                "world_size": self.accelerator.num_processes, "stages": self.stages,
                "tokenizer_sha256": first["tokenizer"]["sha256"],
                "revision": self.revision,  # the code that trained it
                "config": dataclasses.asdict(self.cfg)}

    def load_state_dict(self, state: dict):
        """Restore the counters and the loader's cursor from a state_dict (load_checkpoint
        checks first that it fits this run); the loader refuses changed sources."""
        saved = loader_state(state)
        self.loader.load_state_dict(saved)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.new_sources = bool(set(self.loader.sources) - set(saved["consumed"]))


def main(cfg: TrainConfig) -> dict:
    """Train as `cfg` says; return the last logged metrics and the final evaluation."""
    # From here to the end, SIGTERM (a preemption) or Ctrl-C finishes the step in flight,
    # saves and exits 0; one that comes during setup stops the run after its first step.
    with checkpoint.StopFlag() as stop:
        run = setup(cfg)
        # The log: the terminal, metrics.jsonl (which the run report is drawn from) and wandb.
        # However the run ends, leaving this block records how, and writes the report.
        with make_logger(run) as logger:
            metrics = train(run, stop, logger)
            if run.step == cfg.stop_at_step:
                metrics["sample"] = sample_text(cfg, run.accelerator, run.model)
                logger.log_sample(run.step, cfg.sample_prompt, metrics["sample"])
        outcome = "finished" if run.step == cfg.stop_at_step else "stopped"
        checkpoint.record_outcome(outcome, run.step, run.accelerator.is_local_main_process)
    return metrics


def train(run: Run, stop: checkpoint.StopFlag, logger: log.MetricsLogger) -> dict:
    """The loop, from run.step to cfg.stop_at_step or to a stop request; the last logged
    metrics and evaluation. Each pass first evaluates and saves the step it has reached,
    when due, then trains one step; the last step is evaluated and saved by the same lines
    as every other, and ends the loop (nanochat's `last_step`)."""
    cfg = run.cfg
    # every source shares one tokenizer (ensure_data checks), so one byte table serves all
    token_bytes = data.token_bytes(run.stages[0].sources[0][0]).to(run.accelerator.device)
    bad_steps = 0  # consecutive steps whose update was skipped (non-finite loss or norm)
    first_step, last_ckpt, train_seconds, metrics = run.step, run.step, 0.0, {}
    while True:
        last_step = run.step == cfg.stop_at_step
        # A source new to a resumed run is evaluated at once: its curve has a before.
        if run.step % cfg.eval_every == 0 or last_step or run.new_sources:
            metrics.update(validate(run, token_bytes))
            logger.log_eval(run.step, run.tokens_seen, metrics)
        # Not the step the run started from (step 0, or the checkpoint it resumed from),
        # and never during a non-finite streak: the weights may already be the damage.
        if (run.step % cfg.ckpt_every == 0 or last_step) and run.step != first_step \
                and bad_steps == 0:
            save_checkpoint(run, logger)
            last_ckpt = run.step
        if last_step:
            return metrics

        # The learning rate is a pure function of the step (never a prepared scheduler:
        # accelerate would step it once per process), and so is the data stage.
        run.optimizers.set_lr(optim.lr_multiplier(run.step, cfg))
        run.loader.set_step(run.step)
        result = train_step(run, stop)
        train_seconds += result["seconds"]
        run.step += 1
        run.tokens_seen += cfg.global_batch_tokens

        if result["skipped"]:
            bad_steps, run.skipped_steps = bad_steps + 1, run.skipped_steps + 1
            logger.log_skipped(run.step, result["loss"], result["grad_norm"],
                               run.skipped_steps)
            if bad_steps >= cfg.max_bad_steps:
                give_up(run, bad_steps, last_ckpt)
        else:
            bad_steps = 0
        if run.step % cfg.log_every == 0 or run.step == cfg.stop_at_step:
            metrics.update(logger.log_train(run.step, result, run.optimizers.lrs(),
                                            run.tokens_seen, run.skipped_steps,
                                            train_seconds, run.loader.tokens_read()))
            logger.log_epochs(run.loader.take_new_epochs())
        if result["stop"]:  # a signal: save this step (no evaluation), and stop
            if bad_steps == 0:
                save_checkpoint(run, logger)
            run.accelerator.print(f"stop requested after step {run.step:,}; the newest "
                                  f"checkpoint is {checkpoint.newest(cfg.out_dir)}; run "
                                  f"the same command again to resume")
            return metrics


def setup(cfg: TrainConfig) -> Run:
    """Accelerator, data, model, optimizers, and the checkpoint to resume from. Every
    config and data mistake fails here, before any compute."""
    phases = config.wsd_phases(cfg)  # the config checked it when it was made
    candidates = checkpoint.resume_candidates(cfg.out_dir, cfg.resume)  # refuses overwrites
    launch_warnings = config.check_launch(os.environ, precision(cfg))  # refuses dead keys
    accelerator = make_accelerator(cfg)
    stages = [data.Stage(*stage) for stage in cfg.stages(phases.decay_start)]
    manifests = ensure_data(cfg, stages, accelerator)
    plan = config.data_plan(cfg, stages, {d: data.windows_per_epoch(m, "train", cfg.seq_len)
                                          * cfg.seq_len for d, m in manifests.items()})
    warnings = launch_warnings + config.check_epochs(cfg, plan)  # refuses past --max_epochs
    with accelerator.main_process_first():  # rank 0 hashes the shards; the rest read its record
        loader = data.MixtureLoader(stages, cfg.seq_len, cfg.micro_batch_size,
                                    accelerator.process_index, accelerator.num_processes,
                                    seed=cfg.seed)
    compiled = use_compile(cfg)
    model = build_model(cfg, compiled)
    if accelerator.distributed_type == DistributedType.FSDP:
        # Sharded before the optimizers are built, so they hold the sharded parameters;
        # accelerate.prepare keeps a model that is already an FSDP module as it is.
        model = shard_model(model, accelerator.device, accelerator.mixed_precision == "bf16",
                            config.reshard_after_forward(os.environ))
    optimizers = optim.build_optimizers(model, cfg)
    revision = log.code_revision()
    hardware = log.Hardware(accelerator.num_processes, str(accelerator.device),
                            accelerator.distributed_type.value, accelerator.mixed_precision,
                            compiled, log.device_name(accelerator.device))
    accelerator.print(banner(cfg, hardware, model, optimizers, plan, revision))
    accelerator.print("\n".join(warnings), end="\n" if warnings else "")
    model, *prepared = accelerator.prepare(model, *optimizers.named.values())
    optimizers = optim.Optimizers(dict(zip(optimizers.named, prepared, strict=True)))
    run = Run(cfg, accelerator, model, optimizers, loader, stages, manifests, revision=revision,
              hardware=hardware, plan=plan)
    resume(run, candidates)
    return run


def train_step(run: Run, stop: checkpoint.StopFlag) -> dict:
    """One optimizer step over the global batch: forward and backward on every micro-batch,
    clip, then step both optimizers — unless the loss or gradient norm is not finite, in
    which case the update is skipped and the weights stay as they were."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    world = accelerator.num_processes
    accum = cfg.grad_accum_steps(world)
    t0 = time.perf_counter()
    # The global token count comes first: it is the denominator of every micro-batch.
    batches = [next(run.loader) for _ in range(accum)]  # accum × (B, T) per rank
    n_tokens = sum(int((b["targets"] != -100).sum()) for b in batches)
    n_tokens = accelerator.reduce(torch.tensor(n_tokens, device=accelerator.device), "sum")
    # backward() divides by accum and DDP/FSDP average over ranks: undo both, so the
    # gradient is d(sum of token losses) / n_tokens.
    scale = accum * world / n_tokens.float()
    sums = torch.zeros(3, device=accelerator.device)  # loss, ce, z summed over tokens
    for batch in batches:
        batch = to_device(batch, accelerator.device)
        with accelerator.accumulate(model):
            loss, ce, z = model(**batch, reduction="sum")
            accelerator.backward(loss * scale)
        sums += torch.stack([loss.detach().float(), ce.float(), z.float()])

    # The norm is measured before clipping: the logged gnorm is what the step produced.
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    loss, ce, z = (accelerator.reduce(sums, "sum") / n_tokens).tolist()
    grad_norm = float(grad_norm)
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        run.optimizers.step()
    run.optimizers.zero_grad()
    # Read last, so a signal that arrives during this step stops the run after it; every
    # rank must agree to stop, so the flag is summed over ranks.
    stop_votes = accelerator.reduce(stop.tensor(accelerator.device), "sum")
    return {"loss": loss, "ce": ce, "z": z, "grad_norm": grad_norm, "skipped": skipped,
            "stop": stop_votes.item() > 0, "seconds": time.perf_counter() - t0}


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's (B, T) tensors on `device`. For a GPU they are first copied into pinned
    (page-locked) host memory, as nanoGPT does: only from there does a non_blocking copy
    run asynchronously, overlapping the GPU's work on the previous micro-batch; from
    ordinary memory it waits. On a CPU there is nothing to copy."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def validate(run: Run, token_bytes: torch.Tensor) -> dict:
    """Every source's val loss and bits per byte (`val_loss/<data_dir>`), and the mixture's:
    their mean weighted by the first stage's shares, the same weights for the whole run,
    so the curve stays comparable across a stage switch."""
    metrics = {}
    for source in run.loader.sources:
        result = evaluate(run.cfg, run.accelerator, run.model, token_bytes, source)
        metrics.update({f"{k}/{source}": v for k, v in result.items()})
    run.new_sources = False
    shares = run.stages[0].sources
    for key in ("val_loss", "val_bpb"):
        metrics[key] = sum(weight * metrics[f"{key}/{source}"] for source, weight in shares)
    return metrics


@torch.no_grad()
def evaluate(cfg: TrainConfig, accelerator, model, token_bytes, data_dir) -> dict:
    """Validation loss (cross-entropy in nats, no z-loss) and bits per byte over the first
    `eval_tokens` of data_dir's val split (or all of it, if smaller), in a fixed order,
    summed across ranks.

    Bits per byte = total CE / ln 2 / total UTF-8 bytes of the target tokens: unlike the
    loss, it does not depend on the tokenizer, so runs with different vocabularies compare."""
    B, rank, world = cfg.micro_batch_size, accelerator.process_index, accelerator.num_processes
    loader = data.PackedShardLoader(data_dir, "val", cfg.seq_len, B, rank, world, seed=cfg.seed)
    # At most one pass over the split, so no window counts twice: a small val split is not
    # re-read to fill eval_tokens, nor to fill the last global micro-batch. Rows past the
    # last window are padding without targets (-100); every rank still runs each forward,
    # as FSDP2 needs all ranks in every one.
    n_windows = max(1, min(cfg.eval_tokens // cfg.seq_len, loader.windows_per_epoch))
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


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """One Accelerator for the run. The world size must be known before it exists (it sets
    the accumulation), so it is read from the launcher's environment via PartialState.
    Without CUDA, `cpu=True` makes a multi-process launch DDP over gloo (MULTI_CPU)."""
    cpu = not torch.cuda.is_available()
    if not cpu:
        # fp32 matmuls (the loss head's fp32 logits above all) run on TF32 tensor cores:
        # fp32 range and accumulation, 10-bit mantissa inputs, as nanoGPT and torchtitan do.
        torch.set_float32_matmul_precision("high")
    world_size = PartialState(cpu=cpu).num_processes
    return Accelerator(cpu=cpu, mixed_precision=precision(cfg),
                       gradient_accumulation_steps=cfg.grad_accum_steps(world_size))


def precision(cfg: TrainConfig) -> str:
    """accelerate's mixed_precision for this run: the config's, `auto` being bf16 on a GPU
    and fp32 ("no") on a CPU. It wins over the launch config's (config.check_launch warns)."""
    if cfg.mixed_precision == "auto":
        return "bf16" if torch.cuda.is_available() else "no"
    return cfg.mixed_precision


def ensure_data(cfg: TrainConfig, stages: list, accelerator: Accelerator) -> dict[str, dict]:
    """The manifest of every source of every stage, preparing the built-in corpus first if
    it is missing. Every data mistake is caught here, before the model is built: a missing
    source, a tokenizer larger than the model's vocabulary, sources with different
    tokenizers (a mixture's tokens must mean one thing)."""
    sources = list(dict.fromkeys(d for stage in stages for d, _ in stage.sources))
    builtin = prepare.builtin_data_dir(cfg.model.vocab_size)
    with accelerator.main_process_first():
        if builtin in sources and not (Path(builtin) / "manifest.json").exists() \
                and accelerator.is_main_process:
            print(f"data: {builtin} is missing; preparing the built-in corpus (the Python "
                  f"standard library) with a {cfg.model.vocab_size:,}-token vocabulary")
            prepare.prepare(out_dir=builtin, vocab_size=cfg.model.vocab_size)
    manifests = {d: data.load_manifest(d) for d in sources}
    first, first_sha = sources[0], manifests[sources[0]]["tokenizer"]["sha256"]
    for d, manifest in manifests.items():
        if manifest["tokenizer"]["sha256"] != first_sha:
            raise ValueError(f"{first} and {d} were prepared with different tokenizers; a "
                             f"mixture needs one: prepare {d} again with `python prepare.py "
                             f"--tokenizer {first}/tokenizer.json`")
        if manifest["vocab_size"] > cfg.model.vocab_size:
            raise ValueError(f"{d}: the tokenizer has {manifest['vocab_size']:,} ids but "
                             f"model.vocab_size={cfg.model.vocab_size:,}; set --model.vocab_size="
                             f"{manifest['vocab_size']} or re-prepare the data")
    return manifests


def use_compile(cfg: TrainConfig) -> bool:
    return cfg.compile_model == "true" or (cfg.compile_model == "auto"
                                           and torch.cuda.is_available())


def build_model(cfg: TrainConfig, compile_model: bool) -> Transformer:
    """The model, seeded so every rank starts from identical weights. Activation
    recomputation is set first, then each block is compiled on its own (regional
    compilation, torchtitan's recipe): it compiles fast, and FSDP2's hooks, added later
    around each compiled block, stay outside the compiled code — whole-model compilation
    would skip them."""
    set_seed(cfg.seed)
    model = Transformer(cfg.model)
    model.recompute_every, model.loss_head_dtype = cfg.recompute_every, cfg.loss_head_dtype
    if compile_model:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return model


def shard_model(model: Transformer, device: torch.device, bf16: bool,
                reshard_after_forward: bool = True) -> Transformer:
    """FSDP2 (`fully_shard`): one group per block, then the root group, which holds the
    tied embedding and the final norm — the embedding is used at both ends of the forward,
    so it must live in one group, and the loss head runs inside the root's forward where
    that weight is gathered. Parameters are gathered in bf16 for compute, and gradients are
    reduce-scattered in fp32 (accelerate's bf16 default would sum them in bf16, dropping
    the low bits of many small per-rank contributions). `reshard_after_forward` (the launch
    config's fsdp_reshard_after_forward) False keeps each block's gathered weights from
    its forward to its backward: one all-gather fewer per block, a block's weights more
    memory each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                  reduce_dtype=torch.float32)
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def banner(cfg: TrainConfig, hardware: log.Hardware, model, optimizers, plan,
           revision: str) -> str:
    """The start-up summary log.py prints: parameters, FLOPs, batch, schedule, memory."""
    muon = optimizers.named.get("muon")
    n_muon = sum(p.numel() for g in muon.param_groups for p in g["params"]) if muon else 0
    n_params = sum(p.numel() for p in model.parameters())
    return log.banner(cfg, hardware, n_params, n_muon, optimizers.summary(),
                         optim.schedule_summary(cfg), model_flops(cfg), plan, revision)


def model_flops(cfg: TrainConfig) -> dict[str, float]:  # FLOP/token in both conventions
    return {c: flops_per_token(cfg.model, cfg.seq_len, c) for c in ("causal", "palm")}


def make_logger(run: Run) -> log.MetricsLogger:
    """The log, opened with this start's record."""
    logger = log.MetricsLogger(run.cfg, run.accelerator.is_main_process,
                               run.accelerator.device, run.accelerator.num_processes,
                               model_flops(run.cfg), start_step=run.step)
    logger.log_start(start_record(run))
    return logger


def start_record(run: Run) -> dict:
    """What metrics.jsonl records of each start, so that report.py can describe the whole
    run from out_dir alone (old checkpoints are pruned): where it starts, the config and
    how it differs from its nearest preset, the code, the hardware, the data plan, the
    schedule's phases, and what a resume continued and changed."""
    cfg = run.cfg
    preset, preset_changes = config.nearest_preset(cfg)
    return {"step": run.step, "tokens_seen": run.tokens_seen,
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "preset": preset, "preset_changes": preset_changes,
            "config": dataclasses.asdict(cfg), "revision": run.revision,
            "hardware": dataclasses.asdict(run.hardware), "plan": run.plan,
            "phases": config.wsd_phases(cfg)._asdict(),
            "resumed_from": run.resumed_from, "resume_changes": run.resume_changes}


def save_checkpoint(run: Run, logger: log.MetricsLogger):
    """out_dir/ckpt/step_XXXXXXX: weights, optimizers, RNGs and run.state_dict(), all a
    bitwise resume needs; then the log records it (and redraws the run report)."""
    t0 = time.perf_counter()
    # Never pruned: the checkpoints where a stage begins and where the decay leg begins, the
    # branch points of anneals (WSD's point).
    keep = {stage.start for stage in run.stages} | {config.wsd_phases(run.cfg).decay_start}
    checkpoint.save(run.accelerator, run.accelerator.unwrap_model(run.model),
                    list(run.optimizers.named.values()), run.state_dict(), run.cfg.out_dir,
                    run.cfg.keep_last_ckpts, keep)
    logger.log_checkpoint(run.step, time.perf_counter() - t0)


def resume(run: Run, candidates: list[Path]):
    """Continue from the first of `candidates` that can be read (checkpoint.resume_candidates
    lists them). A damaged one is renamed .damaged, kept for a person to look at, and the
    one before it is tried; a file that is unsafe to read stops the run. Every rank must
    take the same decision, and a damaged shard or RNG file may show on one rank only, so
    each rank's verdict is summed over the ranks first."""
    accelerator = run.accelerator
    for path in candidates:
        error = None
        try:
            load_checkpoint(run, path)
        except (checkpoint.DamagedCheckpointError, checkpoint.UnsafeCheckpointError) as e:
            error = e
        unsafe = isinstance(error, checkpoint.UnsafeCheckpointError)
        votes = torch.tensor([error is not None and not unsafe, unsafe], dtype=torch.float32,
                             device=accelerator.device)
        n_damaged, n_unsafe = accelerator.reduce(votes, "sum").tolist()
        if n_unsafe:
            raise error if unsafe else checkpoint.UnsafeCheckpointError(
                f"{path}: another rank refused a file of it as unsafe (see its error)")
        if not n_damaged:
            accelerator.print(f"resumed from {path} at step {run.step:,}")
            return
        reason = error or f"{path}: a file another rank reads is damaged"
        if run.cfg.resume != "auto":
            raise ValueError(f"resume={run.cfg.resume} cannot be read: {reason}")
        accelerator.wait_for_everyone()  # every rank is done reading it
        if accelerator.is_main_process:
            kept = checkpoint.set_aside(path, "damaged")
            print(f"warning: skipping damaged checkpoint {reason}; kept as {kept}")
        accelerator.wait_for_everyone()
    if candidates:
        raise ValueError(f"no checkpoint in {checkpoint.ckpt_root(run.cfg.out_dir)} can be "
                         f"read (see the warnings above; each is kept as .damaged); "
                         f"--resume=none starts afresh")


def load_checkpoint(run: Run, path: Path):
    """Restore weights, both optimizers, RNGs, the data cursor, the step and the counters,
    after checking that the checkpoint fits this run. The rank count may differ from the
    saving run's: DCP reshards, and the loader's cursor counts global windows. The knobs
    this run was given win over the checkpoint's, except those that cannot change; data
    stages may be added or edited only where they have not begun."""
    state = checkpoint.read_train_state(path)
    saved_stages = state.get("stages") or [[0, [[state["config"]["data_dir"], 1.0]]]]
    for line in config.check_stages(saved_stages, run.stages, state["step"]):
        run.accelerator.print(line)
    run.resume_changes = config.resume_changes(run.cfg, state["config"])
    for name, old, new in run.resume_changes:
        run.accelerator.print(f"resume: {name} {old} → {new}")
    run.load_state_dict(state)  # the loader refuses changed sources: before any I/O
    checkpoint.load(run.accelerator, run.accelerator.unwrap_model(run.model),
                    list(run.optimizers.named.values()), path)
    run.resumed_from = str(Path(path).resolve())


def loader_state(state: dict) -> dict:
    """The loader's state in a checkpoint; one written before mixtures (one source, one
    cursor) becomes a mixture of one: its data_dir read `cursor` windows in stage 0."""
    saved = state["loader"]
    if "stage_start" in saved:
        return saved
    source = state["config"]["data_dir"]
    fingerprints = {source: state["data_sha256"]} if "data_sha256" in state else {}
    return {"seq_len": saved["seq_len"], "seed": saved["seed"], "stage_start": 0,
            "cursor": saved["cursor"], "offsets": {source: 0},
            "consumed": {source: saved["cursor"]}, "fingerprints": fingerprints}


def sample_text(cfg: TrainConfig, accelerator, model) -> str:
    """A short completion of cfg.sample_prompt, as sample.py makes them. Every rank runs it
    (under FSDP each forward needs all ranks); the seed is fixed and the training RNG state
    is put back afterwards, so sampling never changes a resumed run."""
    first_source = config.parse_mixture(cfg.data_dir)[0][0]  # every source has its tokenizer
    tokenizer = Tokenizer.from_file(data.tokenizer_path(first_source))
    with torch.random.fork_rng():  # every torch generator is put back on exit
        torch.manual_seed(cfg.seed)
        return sample.complete(accelerator.unwrap_model(model), tokenizer, cfg.sample_prompt,
                               cfg.sample_tokens, sample.TEMPERATURE, sample.TOP_K)


def export(cfg: TrainConfig, given=frozenset(), fmt: str = "stacklm") -> Path:
    """out_dir/export/ from the checkpoint cfg.resume names (auto: the newest), for
    sample.py. The model's shape and the tokenizer are the checkpoint's own, never this
    command line's: a model knob in `given` (the knobs the command line set) that differs
    is refused, and the tokenizer must be the one the checkpoint recorded. It is read from
    the checkpoint's data_dir, or from --data_dir if given (the data moved)."""
    ckpt = checkpoint.find(cfg.out_dir, cfg.resume)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoint.ckpt_root(cfg.out_dir)} to "
                                f"export (resume={cfg.resume}); train first, or pass "
                                f"--resume=PATH to a checkpoint folder")
    state = checkpoint.read_train_state(ckpt)
    model_cfg = config.saved_model(state["config"], cfg, given)
    spec = cfg.data_dir if "data_dir" in given else state["config"]["data_dir"]
    data_dir = config.parse_mixture(spec)[0][0]  # a mixture's sources share one tokenizer
    provenance = {"checkpoint": str(ckpt), "step": state["step"],
                  "trained_by": state.get("revision", "unknown"),
                  "exported_by": log.code_revision()}
    tokenizer = trained_tokenizer(ckpt, state, data_dir)
    if fmt == "hf":  # a transformers folder (hf_export.py says which class reads it)
        weights = checkpoint.read_model(ckpt, Transformer(model_cfg))
        out = hf_export.write(Path(cfg.out_dir) / "export-hf", weights, model_cfg, tokenizer,
                              data.load_manifest(data_dir)["eos_id"], provenance["trained_by"])
        print(f"exported {ckpt} to {out} as {hf_export.architecture(model_cfg)}; load it with "
              f"transformers' AutoModelForCausalLM.from_pretrained({str(out)!r}"
              f"{', trust_remote_code=True' if hf_export.needs_remote_code(model_cfg) else ''})")
        return out
    out = checkpoint.export(ckpt, Transformer(model_cfg), dataclasses.asdict(model_cfg),
                            tokenizer, cfg.out_dir, provenance)
    print(f"exported {ckpt} to {out}; try: python sample.py --export {out}")
    return out


def trained_tokenizer(ckpt: Path, state: dict, data_dir: str) -> str:
    """data_dir's tokenizer file, after checking it is the one checkpoint `ckpt` was
    trained with: a directory re-prepared at the same path must not slip another in.
    Checkpoints record its sha256; older ones only the data's whole fingerprint."""
    path = data.tokenizer_path(data_dir)  # the file matches data_dir's own manifest
    manifest = data.load_manifest(data_dir)
    if "tokenizer_sha256" in state:
        same = manifest["tokenizer"]["sha256"] == state["tokenizer_sha256"]
    else:
        same = data.fingerprint(manifest) == state.get("data_sha256")
    if not same:
        raise ValueError(f"{path} is not the tokenizer {ckpt} was trained with ({data_dir} "
                         f"was prepared again since); restore that data directory, or pass "
                         f"--data_dir= a copy that holds the original tokenizer")
    return path


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stayed non-finite for max_bad_steps steps in a row."""


def give_up(run: Run, bad_steps: int, last_ckpt: int):
    """Stop a run whose loss stayed non-finite. A checkpoint written just before the streak
    holds the weights that gave its first loss: set it aside (renamed .diverged)."""
    cfg, first_bad = run.cfg, run.step - bad_steps + 1
    suspect = checkpoint.step_path(cfg.out_dir, last_ckpt)
    if last_ckpt == first_bad - 1 and suspect.exists() and run.accelerator.is_main_process:
        checkpoint.set_aside(suspect, "diverged")
    rates = " ".join(f"{name} {lr:.2e}" for name, lr in run.optimizers.lrs().items())
    raise TrainingDiverged(
        f"{bad_steps} consecutive non-finite steps (the last at step {run.step}, lr {rates}): "
        f"stopping; the newest checkpoint from before them is {checkpoint.newest(cfg.out_dir)}. "
        f"Lower --muon_peak_lr={cfg.muon_peak_lr:g} and --adamw_peak_lr={cfg.adamw_peak_lr:g} "
        f"(or --grad_clip={cfg.grad_clip:g}) and run again: it resumes from there")


# What a user can fix: a bad value, a missing or unreadable file, a run that diverged. These
# print one line; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, TrainingDiverged)


def cli(argv=None):
    """`python train.py [--preset P] [--config RUN.TOML] [--key=value ...] [--export]`; bare,
    it trains Stack-100M where a GPU is present, else `tiny`. A user error prints one line
    (`--debug` shows the traceback) and exits with status 2; under a launcher only rank 0
    prints it."""
    argv = sys.argv[1:] if argv is None else argv
    default = "stack100m" if torch.cuda.is_available() else "tiny"
    with user_errors("--debug" in argv, USER_ERRORS):
        cfg, args = config.parse_args(argv, default_preset=default)
        if args.preset is None and default == "tiny":
            print("no CUDA GPU found: running the `tiny` preset on the CPU "
                  "(pass --preset stack100m to insist)")
        if args.export:
            export(cfg, args.given, args.format)
        else:
            main(cfg)


if __name__ == "__main__":
    cli()
