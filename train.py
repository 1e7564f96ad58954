"""train.py: the training loop, readable top to bottom.

    python train.py                      # Stack-100M on a GPU; `tiny` on a CPU-only machine
    python train.py --preset tiny        # ~4M parameters, minutes on a laptop CPU
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py   # many GPUs

`main(cfg)` is the whole program: set up (accelerator, data, model, optimizers, resume),
then the loop — forward → backward → clip → step → schedule → log → eval → checkpoint —
then the end of the run. accelerate supplies DDP / FSDP2, bf16 autocast and gradient
accumulation; everything else is written out here.

Loss normalisation. Each micro-batch returns the *sum* of its per-token losses. Before the
backward passes of a step, the number of target tokens in the whole global batch (every
micro-batch on every rank) is counted, and each summed loss is scaled so that the gradient
is d(sum of all token losses)/(global token count) — the same gradient one big batch gives,
whatever the split into ranks and micro-batches (not a mean of per-micro-batch means, which
over-weights short micro-batches). The logged loss is normalised the same way.
"""

import dataclasses
import json
import math
import random
import resource
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, set_seed
from tokenizers import Tokenizer
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import config
import data
import optim
import sample
from config import TrainConfig
from model import Stack100M, flops_per_token

# DCP warns that it "assumes the intent is to save in a single process" when no process
# group exists: that is exactly our single-process case.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")

# Dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity). MFU is reported
# against these; unknown devices and CPUs show MFU as n/a rather than a made-up number.
PEAK_FLOPS = {
    "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "GH200": 989e12,
    "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12,
}


def peak_flops(device_name: str) -> float | None:
    """Peak FLOP/s of one device, matched by name (longest key first), or None."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_FLOPS[key]
    return None


# ---------------------------------------------------------------------------------------
# Set-up
# ---------------------------------------------------------------------------------------

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
    precision = {"auto": "no" if cpu else "bf16", "bf16": "bf16", "no": "no"}
    return Accelerator(cpu=cpu, mixed_precision=precision[cfg.mixed_precision],
                       gradient_accumulation_steps=cfg.grad_accum_steps(world_size))


def ensure_data(cfg: TrainConfig, accelerator: Accelerator) -> dict:
    """The manifest of cfg.data_dir, preparing the built-in corpus first if it is missing.
    Every data mistake is caught here, before the model is built."""
    builtin = cfg.data_dir == data.builtin_data_dir(cfg.model.vocab_size)
    with accelerator.main_process_first():
        if builtin and not (Path(cfg.data_dir) / "manifest.json").exists() \
                and accelerator.is_main_process:
            print(f"data: {cfg.data_dir} is missing; preparing the built-in corpus (the "
                  f"Python standard library) with a {cfg.model.vocab_size:,}-token vocabulary")
            data.prepare(out_dir=cfg.data_dir, vocab_size=cfg.model.vocab_size)
    manifest = data.load_manifest(cfg.data_dir)
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(f"{cfg.data_dir}: the tokenizer has {manifest['vocab_size']:,} ids "
                         f"but model.vocab_size={cfg.model.vocab_size:,}; set "
                         f"--model.vocab_size={manifest['vocab_size']} or re-prepare the data")
    return manifest


def build_model(cfg: TrainConfig, compile_model: bool) -> Stack100M:
    """The model, seeded so every rank starts from identical weights. Activation
    checkpointing is set first, then each block is compiled on its own (regional
    compilation, torchtitan's recipe): it compiles fast, and FSDP2's hooks, added later
    around each compiled block, stay outside the compiled code — whole-model compilation
    would skip them."""
    set_seed(cfg.seed)
    model = Stack100M(cfg.model)
    model.set_activation_checkpointing(config.checkpointing_every(cfg.activation_checkpointing))
    if compile_model:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return model


def shard_model(model: Stack100M, device: torch.device, bf16: bool) -> Stack100M:
    """FSDP2 (`fully_shard`): one group per block, then the root group, which holds the
    tied embedding and the final norm — the embedding is used at both ends of the forward,
    so it must live in one group, and the loss head runs inside the root's forward where
    that weight is gathered. Parameters are gathered in bf16 for compute, and gradients are
    reduce-scattered in fp32 (accelerate's bf16 default would sum them in bf16, dropping
    the low bits of many small per-rank contributions)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                  reduce_dtype=torch.float32)
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def use_compile(cfg: TrainConfig) -> bool:
    return cfg.compile_model == "true" or (cfg.compile_model == "auto"
                                           and torch.cuda.is_available())


# Bytes saved for backward per token per block, per unit of d_model, for Stack-shaped
# blocks (intermediate = 2.75·d_model, 4 query heads per kv head), as counted by
# torch.autograd.graph.saved_tensors_hooks on d_model=512 blocks (tests/test_train.py
# recounts them). bf16 autocast keeps the norms' fp32 intermediates: not half of fp32.
ACTIVATION_BYTES_PER_D = {True: 66, False: 91}  # bf16: yes/no


def memory_estimate(cfg: TrainConfig, n_params: int, n_muon: int, world: int,
                    sharded: bool, bf16: bool) -> dict[str, float]:
    """A start-up estimate of peak memory per rank, in GiB, to set beside the measured peak
    in the log. fp32 master weights and gradients (4 bytes each), Muon's momentum (4) and
    AdamW's two moments (8), divided by the rank count under FSDP2; the activations of the
    blocks that are not checkpointed (a checkpointed block keeps only its input, and one
    block at a time is recomputed); one chunk of fp32 logits and their gradient."""
    m = cfg.model
    shard = world if sharded else 1
    tokens = cfg.micro_batch_size * cfg.seq_len
    block = tokens * ACTIVATION_BYTES_PER_D[bf16] * m.d_model
    every = config.checkpointing_every(cfg.activation_checkpointing)
    checkpointed = m.n_layers // every if every else 0
    block_input = tokens * m.d_model * (2 if bf16 else 4)
    activations = (m.n_layers - checkpointed) * block + checkpointed * block_input \
        + (block if checkpointed else 0)
    gib = 2**30
    budget = {"weights+grads": 8 * n_params / shard / gib,
              "optimizer": (4 * n_muon + 8 * (n_params - n_muon)) / shard / gib,
              "activations": activations / gib,
              "loss_head": 2 * min(m.ce_chunk_size, tokens) * m.vocab_size * 4 / gib}
    budget["total"] = sum(budget.values())
    return budget


def banner(cfg, accelerator, model, muon, adamw, loader, compiled) -> str:
    """Everything a practitioner checks before trusting a run, with units."""
    world = accelerator.num_processes
    n_params = sum(p.numel() for p in model.parameters())
    n_muon = sum(p.numel() for g in muon.param_groups for p in g["params"])
    budget = memory_estimate(cfg, n_params, n_muon, world,
                             accelerator.distributed_type == DistributedType.FSDP,
                             accelerator.mixed_precision == "bf16")
    split = optim.schedule_split(cfg)
    run_tokens = cfg.stop_at_step * cfg.global_batch_tokens
    epochs = run_tokens / loader.tokens_per_epoch
    lines = [
        f"model: {n_params / 1e6:.2f}M parameters ({optim.optimizer_summary(muon, adamw)})",
        f"FLOP/token: {flops_per_token(cfg.model, cfg.seq_len, 'causal'):.3e} causal, "
        f"{flops_per_token(cfg.model, cfg.seq_len, 'palm'):.3e} palm (seq {cfg.seq_len:,})",
        f"batch: {cfg.batch_summary(world)}",
        f"schedule: {optim.format_split(split)} (decay starts at step {split.decay_start:,}, "
        f"{cfg.decay_shape}); this run stops at step {cfg.stop_at_step:,} of "
        f"{cfg.total_steps:,}",
        f"data: {cfg.data_dir}, {loader.tokens_per_epoch:,} train tokens/epoch; this run "
        f"reads {run_tokens:,} tokens = {epochs:.2f} epochs",
        f"hardware: {world} × {accelerator.device} ({accelerator.distributed_type.value}), "
        f"precision {accelerator.mixed_precision}, compile {compiled}, activation "
        f"checkpointing {cfg.activation_checkpointing}",
        "memory estimate per rank: " + " + ".join(
            f"{k} {v:.2f}" for k, v in budget.items() if k != "total")
        + f" = {budget['total']:.2f} GiB (the log's mem column is the measured peak)",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def main(cfg: TrainConfig) -> dict:
    """Train as `cfg` says; return the last logged metrics and the final evaluation."""
    run = setup(cfg)
    accelerator = run.accelerator
    token_bytes = data.token_bytes(cfg.data_dir).to(accelerator.device)
    bad_steps, last_eval, last_ckpt, train_seconds, metrics = 0, None, run.step, 0.0, {}
    with StopFlag() as stop, MetricsLogger(cfg, accelerator, start_step=run.step) as logger:
        while run.step < cfg.stop_at_step:
            if run.step % cfg.eval_every == 0 and last_eval != run.step:
                metrics.update(evaluate(cfg, accelerator, run.model, token_bytes))
                logger.log_eval(run.step, metrics)
                last_eval = run.step

            # The learning rate is a pure function of the step (never a prepared scheduler:
            # accelerate would step it once per process).
            multiplier = optim.lr_multiplier(run.step, cfg)
            for opt in (run.muon, run.adamw):
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * multiplier
            result = train_step(run, stop)
            train_seconds += result["seconds"]
            run.step += 1
            run.tokens_seen += cfg.global_batch_tokens

            if result["skipped"]:
                bad_steps += 1
                logger.count_bad_step(run.step - 1, result["loss"], result["grad_norm"])
                if bad_steps >= cfg.max_bad_steps:
                    raise RuntimeError(
                        f"{bad_steps} consecutive non-finite steps (last at step {run.step - 1}): "
                        f"stopping. The last good checkpoint in {ckpt_root(cfg)} is intact; "
                        f"lower the learning rates or grad_clip and resume from it")
            else:
                bad_steps = 0
            if run.step % cfg.log_every == 0 or run.step == cfg.stop_at_step:
                lrs = (run.muon.param_groups[0]["lr"], run.adamw.param_groups[0]["lr"])
                metrics.update(logger.log_train(run.step, result, lrs, run.tokens_seen,
                                                train_seconds))
            if run.step % cfg.ckpt_every == 0 or result["stop"]:
                save_checkpoint(run)
                last_ckpt = run.step
            if result["stop"]:
                accelerator.print(f"stop requested: saved step {run.step:,} in "
                                  f"{ckpt_root(cfg)}; run the same command again to resume")
                return metrics

        if last_eval != run.step:
            metrics.update(evaluate(cfg, accelerator, run.model, token_bytes))
            logger.log_eval(run.step, metrics)
        if last_ckpt != run.step:
            save_checkpoint(run)
    metrics["sample"] = sample_text(cfg, accelerator, run.model)
    accelerator.print(f"sample ({cfg.sample_prompt!r} →):\n{metrics['sample']}")
    return metrics


@dataclass
class Run:
    """What the loop works on, made once by `setup`."""
    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module
    muon: torch.optim.Optimizer
    adamw: torch.optim.Optimizer
    loader: data.PackedShardLoader
    manifest: dict
    step: int = 0  # optimizer steps taken, advanced by the loop
    tokens_seen: int = 0


def setup(cfg: TrainConfig) -> Run:
    """Accelerator, data, model, optimizers, and the checkpoint to resume from. Every
    config and data mistake fails here, before any compute."""
    optim.check_schedule(cfg)
    accelerator = make_accelerator(cfg)
    manifest = ensure_data(cfg, accelerator)
    loader = data.PackedShardLoader(cfg.data_dir, "train", cfg.seq_len, cfg.micro_batch_size,
                                    accelerator.process_index, accelerator.num_processes,
                                    seed=cfg.seed)
    compiled = use_compile(cfg)
    model = build_model(cfg, compiled)
    if accelerator.distributed_type == DistributedType.FSDP:
        # Sharded before the optimizers are built, so they hold the sharded parameters;
        # accelerate.prepare keeps a model that is already an FSDP module as it is.
        model = shard_model(model, accelerator.device, accelerator.mixed_precision == "bf16")
    muon, adamw = optim.build_optimizers(model, cfg)
    accelerator.print(banner(cfg, accelerator, model, muon, adamw, loader, compiled))
    model, muon, adamw = accelerator.prepare(model, muon, adamw)
    run = Run(cfg, accelerator, model, muon, adamw, loader, manifest)
    ckpt = find_checkpoint(cfg)
    if ckpt is not None:
        load_checkpoint(run, ckpt)
        accelerator.print(f"resumed from {ckpt} at step {run.step:,}")
    return run


def train_step(run: Run, stop: "StopFlag") -> dict:
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
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        with accelerator.accumulate(model):
            _, loss, ce, z = model(**batch, reduction="sum", return_parts=True)
            accelerator.backward(loss * scale)
        sums += torch.stack([loss.detach().float(), ce.float(), z.float()])

    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    # One reduction carries the losses and the stop request: every rank must agree to stop.
    stats = accelerator.reduce(torch.cat([sums, stop.tensor(accelerator.device)]), "sum")
    loss, ce, z = (stats[:3] / n_tokens).tolist()
    grad_norm = float(grad_norm)
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        run.muon.step()
        run.adamw.step()
    run.muon.zero_grad(set_to_none=True)
    run.adamw.zero_grad(set_to_none=True)
    return {"loss": loss, "ce": ce, "z": z, "grad_norm": grad_norm, "skipped": skipped,
            "stop": stats[3].item() > 0, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------
# Evaluation and sampling
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(cfg: TrainConfig, accelerator, model, token_bytes) -> dict:
    """Validation loss (cross-entropy in nats, no z-loss) and bits per byte over the first
    `eval_tokens` of the val split (or all of it, if smaller), in a fixed order, summed
    across ranks.

    Bits per byte = total CE / ln 2 / total UTF-8 bytes of the target tokens: unlike the
    loss, it does not depend on the tokenizer, so runs with different vocabularies compare."""
    world = accelerator.num_processes
    loader = data.PackedShardLoader(cfg.data_dir, "val", cfg.seq_len, cfg.micro_batch_size,
                                    accelerator.process_index, world, seed=cfg.seed)
    # At most one pass over the split: a small val split is not re-read to fill eval_tokens.
    tokens = min(cfg.eval_tokens, loader.tokens_per_epoch)
    n_batches = max(1, tokens // (cfg.micro_batch_size * cfg.seq_len * world))
    totals = torch.zeros(3, device=accelerator.device)  # ce nats, tokens, bytes
    model.eval()
    for _ in range(n_batches):
        batch = {k: v.to(accelerator.device) for k, v in next(loader).items()}
        _, _, ce, _ = model(**batch, reduction="sum", return_parts=True)
        targets = batch["targets"][batch["targets"] != -100]
        totals += torch.stack([ce.float(), torch.tensor(float(targets.numel()),
                              device=totals.device), token_bytes[targets].sum().float()])
    model.train()
    ce_sum, n_tokens, n_bytes = accelerator.reduce(totals, "sum").tolist()
    return {"val_loss": ce_sum / n_tokens, "val_bpb": ce_sum / math.log(2) / n_bytes}


def sample_text(cfg: TrainConfig, accelerator, model) -> str:
    """A short completion of cfg.sample_prompt, as sample.py makes them. Every rank runs it
    (under FSDP each forward needs all ranks); the seed is fixed and the training RNG state
    is put back afterwards, so sampling never changes a resumed run."""
    tokenizer = Tokenizer.from_file(data.tokenizer_path(cfg.data_dir))
    rng = torch.get_rng_state()
    torch.manual_seed(cfg.seed)
    text = sample.complete(accelerator.unwrap_model(model), tokenizer, cfg.sample_prompt,
                           cfg.sample_tokens, temperature=0.8, top_k=50)
    torch.set_rng_state(rng)
    return text


# ---------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------

class StopFlag:
    """SIGTERM (a scheduler's preemption) or Ctrl-C asks the loop to finish its step, save
    and exit 0; a second Ctrl-C interrupts at once. The old handlers come back on exit."""

    def __init__(self):
        self.requested, self.previous = False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals need it
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor([float(self.requested)], device=device)


class MetricsLogger:
    """One line per log step to the terminal (above a tqdm bar), metrics.jsonl and wandb,
    from the main process only. Every value it gets is already global."""

    def __init__(self, cfg: TrainConfig, accelerator, start_step: int):
        self.cfg, self.main, self.device = cfg, accelerator.is_main_process, accelerator.device
        self.world, self.bad_steps = accelerator.num_processes, 0
        self.flops_causal = flops_per_token(cfg.model, cfg.seq_len, "causal")
        self.flops_palm = flops_per_token(cfg.model, cfg.seq_len, "palm")
        cuda = accelerator.device.type == "cuda"
        self.peak = peak_flops(torch.cuda.get_device_name(accelerator.device) if cuda else "cpu")
        self.start = time.perf_counter()
        self.last_step, self.last_seconds = start_step, 0.0
        self.bar = tqdm(total=cfg.stop_at_step, initial=start_step, disable=not self.main,
                        dynamic_ncols=True, desc="train")
        self.jsonl = self.wandb = None
        if self.main:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(cfg.out_dir) / "metrics.jsonl", "a")
            if cfg.wandb_mode != "disabled":
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode,
                                        dir=cfg.out_dir, config=dataclasses.asdict(cfg))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
        if self.main:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()

    def _print(self, line: str):
        if self.main:  # tqdm.write prints even for a disabled bar
            self.bar.write(line)

    def _write(self, record: dict):
        if self.main:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            if self.wandb is not None:
                self.wandb.log(record, step=record["step"])

    def log_train(self, step: int, result: dict, lrs: tuple[float, float], tokens_seen: int,
                  train_seconds: float) -> dict:
        """Throughput over the steps since the last line, on training time only (evaluation
        and checkpoints excluded). TFLOP/s and MFU follow from tokens/s by construction:
        tflops = flops_per_token × tokens/s and mfu = tflops / (peak × ranks)."""
        steps = step - self.last_step
        seconds = max(train_seconds - self.last_seconds, 1e-9)
        tokens_per_s = steps * self.cfg.global_batch_tokens / seconds
        tflops = self.flops_causal * tokens_per_s / 1e12
        tflops_palm = self.flops_palm * tokens_per_s / 1e12
        peak_tflops = self.peak * self.world / 1e12 if self.peak else None
        record = {
            "step": step, "loss": result["loss"], "ce": result["ce"], "z": result["z"],
            "grad_norm": result["grad_norm"], "lr_muon": lrs[0], "lr_adamw": lrs[1],
            "tokens_seen": tokens_seen,
            "tokens_per_s": tokens_per_s, "tflops": tflops, "tflops_palm": tflops_palm,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "mfu_palm": tflops_palm / peak_tflops if peak_tflops else None,
            "memory_gib": memory_gib(self.device), "bad_steps": self.bad_steps,
            "elapsed_s": time.perf_counter() - self.start,
            "eta_s": (self.cfg.stop_at_step - step) * seconds / steps,
        }
        self.last_step, self.last_seconds = step, train_seconds
        mfu = f"{record['mfu']:.1%} ({record['mfu_palm']:.1%} palm)" if peak_tflops else "n/a"
        self._print(
            f"step {step:>6,} | loss {record['loss']:.4f} (ce {record['ce']:.4f} "
            f"z {record['z']:.2e}) | gnorm {record['grad_norm']:.3f} | lr "
            f"{record['lr_adamw']:.2e}/{record['lr_muon']:.2e} | {tokens_per_s:,.0f} tok/s | "
            f"{tflops:.2f} TFLOP/s | MFU {mfu} | mem {record['memory_gib']:.2f} GiB | "
            f"{fmt_time(record['elapsed_s'])} elapsed, ETA {fmt_time(record['eta_s'])}")
        self.bar.update(steps)
        self._write(record)
        return record

    def log_eval(self, step: int, metrics: dict):
        self._print(f"eval {step:>6,} | val_loss {metrics['val_loss']:.4f} | "
                       f"val_bpb {metrics['val_bpb']:.4f}")
        self._write({"step": step, "val_loss": metrics["val_loss"],
                     "val_bpb": metrics["val_bpb"]})

    def count_bad_step(self, step: int, loss: float, grad_norm: float):
        self.bad_steps += 1
        self._print(f"step {step:>6,} | non-finite loss {loss} or grad norm {grad_norm}: "
                       f"update skipped ({self.bad_steps} skipped so far)")
        self._write({"step": step, "skipped": True, "loss": loss, "grad_norm": grad_norm})


def memory_gib(device: torch.device) -> float:
    """Peak CUDA memory allocated, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def fmt_time(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


# ---------------------------------------------------------------------------------------
# Checkpoints: out_dir/ckpt/step_XXXXXXX/ = a DCP folder (model + both optimizers, sharded
# under FSDP2 and reloadable on any rank count) + train_state.json + rng_rank<r>.pt
# ---------------------------------------------------------------------------------------

def ckpt_root(cfg: TrainConfig) -> Path:
    return Path(cfg.out_dir) / "ckpt"


def find_checkpoint(cfg: TrainConfig) -> Path | None:
    """cfg.resume: "none", a checkpoint path, or "auto" = the newest complete checkpoint in
    out_dir/ckpt (complete ones are renamed into place last, so a partial one never counts)."""
    if cfg.resume == "none":
        return None
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if not (path / "train_state.json").exists():
            raise FileNotFoundError(f"resume={cfg.resume}: no train_state.json there; point "
                                    f"it at an out_dir/ckpt/step_XXXXXXX folder")
        return path
    done = sorted(ckpt_root(cfg).glob("step_[0-9]*[0-9]"))
    done = [p for p in done if (p / "train_state.json").exists()]
    return done[-1] if done else None


def _raw(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save_checkpoint(run: Run):
    """Write run.step's checkpoint into step_XXXXXXX.tmp and rename it once every rank is
    done: a crash mid-write leaves the previous checkpoint as the newest complete one.
    Non-finite weights are never written over a good checkpoint."""
    cfg, accelerator, step = run.cfg, run.accelerator, run.step
    unwrapped = accelerator.unwrap_model(run.model)
    # Each rank checks the values it holds (its shards under FSDP2); the sum covers all.
    mine = [p.to_local() if isinstance(p, DTensor) else p for p in unwrapped.parameters()]
    finite = all(bool(torch.isfinite(t).all()) for t in mine)
    finite_ranks = accelerator.reduce(torch.tensor(float(finite), device=accelerator.device))
    if finite_ranks.item() < accelerator.num_processes:
        raise RuntimeError(f"step {step}: the weights hold non-finite values; refusing to "
                           f"write a checkpoint over the last good one in {ckpt_root(cfg)}")
    final = ckpt_root(cfg) / f"step_{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write_weights_and_optimizers(unwrapped, [_raw(run.muon), _raw(run.adamw)], tmp)
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        state = {"step": step, "tokens_seen": run.tokens_seen, "loader": run.loader.state_dict(),
                 "world_size": accelerator.num_processes,
                 "tokenizer_sha256": run.manifest["tokenizer"]["sha256"],
                 "config": dataclasses.asdict(cfg)}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(ckpt_root(cfg).glob("step_[0-9]*[0-9]"))[:-cfg.keep_last_ckpts]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_checkpoint(run: Run, path: Path):
    """Restore weights, both optimizers, the data cursor, the step and this rank's RNG. The
    rank count may differ from the saving run's: DCP reshards, and the loader's cursor
    counts global windows."""
    state = json.loads((path / "train_state.json").read_text())
    if state["tokenizer_sha256"] != run.manifest["tokenizer"]["sha256"]:
        raise ValueError(f"{path} was trained with a different tokenizer than "
                         f"{run.cfg.data_dir}; resume with the original data_dir or start "
                         f"a new out_dir")
    read_weights_and_optimizers(run.accelerator.unwrap_model(run.model),
                                [_raw(run.muon), _raw(run.adamw)], path)
    run.loader.load_state_dict(state["loader"])
    rng_file = path / f"rng_rank{run.accelerator.process_index}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        set_rng_state(torch.load(rng_file, weights_only=True))
    run.step, run.tokens_seen = state["step"], state["tokens_seen"]


def write_weights_and_optimizers(model, optimizers: list, path: Path):
    """Every rank writes its shards (all of them when not sharded) into one DCP folder.
    get_state_dict names optimizer state by parameter name, so the two optimizers merge
    into one dict and the folder reshards onto any rank count."""
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def read_weights_and_optimizers(model, optimizers: list, path: Path):
    model_sd, optim_sd = get_state_dict(model, optimizers)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path))  # fills sd in place, resharding as needed
    set_state_dict(model, optimizers, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def rng_state() -> dict:
    """Every RNG of this rank, as plain lists and tensors so a weights_only load reads it."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": list(random.getstate()[1]),
            "numpy": [keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate((3, tuple(state["python"]), None))
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def export(cfg: TrainConfig) -> Path:
    """out_dir/export/{model.pt, config.json, tokenizer.json} from the newest checkpoint:
    one consolidated file sample.py loads, whatever the rank count that trained it."""
    ckpt = find_checkpoint(dataclasses.replace(cfg, resume="auto"))
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_root(cfg)} to export; train first")
    model = Stack100M(cfg.model)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt))  # reads only the model part
    out = Path(cfg.out_dir) / "export"
    tmp = out.with_name("export.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(sd["model"], tmp / "model.pt")
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg.model), indent=1))
    shutil.copy(data.tokenizer_path(cfg.data_dir), tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"exported {ckpt} to {out}; try: python sample.py --export {out}")
    return out


def cli(argv=None):
    """Bare `python train.py` trains Stack-100M where a GPU is present, else `tiny`."""
    default = "stack100m" if torch.cuda.is_available() else "tiny"
    try:
        cfg, args = config.parse_args(argv, default_preset=default)
    except ValueError as e:
        sys.exit(f"config error: {e}")
    if args.preset is None and default == "tiny":
        print("no CUDA GPU found: running the `tiny` preset on the CPU "
              "(pass --preset stack100m to insist)")
    if args.export:
        export(cfg)
        return
    main(cfg)


if __name__ == "__main__":
    cli()
