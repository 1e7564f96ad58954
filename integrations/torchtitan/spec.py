"""Stack-100M as a torchtitan 0.2.2 TrainSpec: torchtitan's trainer, stacklm's parts.

    torchrun --nproc_per_node=8 -m torchtitan.train \
        --job.config_file configs/torchtitan/stack100m.toml

The TOML names this module twice: `[job] custom_config_module` (its `JobConfig` adds the
`[stacklm]` section, Muon's knobs) and `[experimental] custom_import` (importing it
registers the TrainSpec "stacklm"; on a machine without an accelerator it first applies
cpu.py's shim). The run is described once, as a stacklm `TrainConfig` (`train_config`,
docs/crosswalk.md made executable), so config.py's checks refuse what train.py would, and
every hook below reads its knobs from there.

torchtitan's hooks, and what answers each:
- model_args[flavor]: `StackArgs`, a `StackConfig` per flavor ("100M" is Stack-100M, "tiny"
  the `--preset tiny` model for CPUs, "debugmodel" the tests' two-layer model).
  `get_nparams_and_flops` gives torchtitan's MFU model.flops_per_token (PaLM's count).
- model_cls: `StackTransformer`, model.Transformer whose forward stops before the head;
  `init_weights` fills every rank's shard from the seed alone.
- parallelize_fn: `parallelize`, train.shard_layout, FSDP2's groups, on torchtitan's mesh.
- build_optimizers_fn: `StackOptimizers`, optim.build_optimizers' Muon + AdamW pair as an
  OptimizersContainer whose state_dict DCP can reshard (keyed by parameter name).
- build_lr_schedulers_fn: `StackSchedules`, optim.lr_multiplier (WSD), a LambdaLR per optimizer.
- build_dataloader_fn: `StackLoader`, data.MixtureLoader's batches with their state.
- build_loss_fn: the fused CE + z-loss (the chunked head; the plain one at ce_chunk_size 0).
- build_metrics_processor_fn: torchtitan's log, plus metrics.jsonl in the dump folder.

Imports from stacklm: config, data, model, optim, loss (the chunked head) and train (the
FSDP2 layout). They are imported here, in these lines, and nowhere else in
integrations/torchtitan.
"""

import dataclasses
import functools
import json
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from integrations.torchtitan import cpu

if not torch.accelerator.is_available():
    cpu.apply()  # before torchtitan picks a device: see cpu.py

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.protocols.model import BaseModelArgs  # noqa: E402
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec  # noqa: E402

# stacklm's parts, all of them: the one place to repoint when they move.
import config  # noqa: E402
import data  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from loss import fused_ce_z_loss  # noqa: E402
from model import Transformer, count_params, flops_per_token, plain_head_loss  # noqa: E402

FLAVORS = {
    "100M": config.StackConfig(),  # Stack-100M: the defaults
    "tiny": config.tiny_model(),  # `python train.py --preset tiny`'s model, for CPUs
    # tests/conftest.py's micro_config model: milliseconds a step
    "debugmodel": config.StackConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4,
                                     n_kv_heads=2, intermediate=176, max_seq_len=64,
                                     nope_every=2, ce_chunk_size=96),
}


# ---------------------------------------------------------------------------------------
# The TOML's [stacklm] section, and the run it describes
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Stacklm:
    """What torchtitan's JobConfig has no key for (`[stacklm]` in the TOML)."""
    muon_peak_lr: float = config.TrainConfig.muon_peak_lr
    """Muon's peak lr, on AdamW's scale with match_rms_adamw (optimizer.lr is AdamW's)"""
    muon_momentum: float = config.TrainConfig.muon_momentum
    """Muon's momentum (Nesterov)"""
    muon_adjust_lr: str = config.TrainConfig.muon_adjust_lr
    """Muon's per-matrix lr scale: match_rms_adamw | original"""


@dataclasses.dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by `[job] custom_config_module`."""
    stacklm: Stacklm = dataclasses.field(default_factory=Stacklm)


def train_config(job) -> config.TrainConfig:
    """The stacklm run the TOML describes, key by key (`knobs`), checked by config.py as
    `python train.py` checks its own: the same refusals, with the same messages."""
    refuse_unsupported(job)
    if job.debug.seed is None:
        raise ValueError("[debug] seed is unset: stacklm's initial weights and data order come "
                         "from a seed; set seed = 1337 under [debug] (the chapter's "
                         "training.seed)")
    if job.optimizer.name.lower() not in ("muon", "adamw"):
        raise ValueError(f"optimizer.name={job.optimizer.name!r}: the stacklm spec builds "
                         f"'Muon' (Muon on the hidden matrices, AdamW on the rest) or 'AdamW'")
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        run = config.TrainConfig(**knobs(job, world))
        run.grad_accum_steps(world)  # the global batch must split over these ranks
    except ValueError as error:  # config.py names stacklm's knobs: say where they live here
        raise ValueError(f"{error} (docs/crosswalk.md maps stacklm's names to these "
                         f"TOML keys)") from None
    return run


def knobs(job, world: int) -> dict:
    """TrainConfig's knobs from torchtitan's keys: docs/crosswalk.md, row by row. torchtitan
    counts the global batch in sequences (-1: one micro-batch per rank), stacklm in tokens."""
    training, schedule, optimizer = job.training, job.lr_scheduler, job.optimizer
    stack = job.stacklm
    total_steps = schedule.total_steps or training.steps
    sequences = training.global_batch_size
    if sequences < 0:
        sequences = training.local_batch_size * world
    decay = {"decay_fraction": schedule.decay_ratio}  # both round(ratio · total) steps
    if schedule.decay_ratio is None:  # torchtitan then decays from the end of warmup
        decay = {"decay_steps": total_steps - schedule.warmup_steps}
    return dict(
        model=FLAVORS[job.model.flavor], data_dir=training.dataset_path,
        out_dir=job.job.dump_folder, seq_len=training.seq_len,
        micro_batch_size=training.local_batch_size,
        global_batch_tokens=sequences * training.seq_len, total_steps=total_steps,
        stop_at_step=training.steps, warmup_steps=schedule.warmup_steps, **decay,
        decay_shape=schedule.decay_type, final_frac=schedule.min_lr_factor,
        adamw_peak_lr=optimizer.lr, muon_peak_lr=stack.muon_peak_lr,
        muon_momentum=stack.muon_momentum, muon_adjust_lr=stack.muon_adjust_lr,
        matrix_optimizer=optimizer.name.lower(), weight_decay=optimizer.weight_decay,
        betas=(optimizer.beta1, optimizer.beta2), grad_clip=training.max_norm,
        seed=job.debug.seed, activation_recompute=recompute(job.activation_checkpoint),
        compile_model="true" if job.compile.enable else "false",
        mixed_precision="bf16" if training.mixed_precision_param == "bfloat16" else "no",
        log_every=job.metrics.log_freq, ckpt_every=job.checkpoint.interval,
        keep_last_ckpts=job.checkpoint.keep_latest_k)


def recompute(checkpointing) -> str:
    """torchtitan's [activation_checkpoint] as stacklm's activation_recompute."""
    if checkpointing.mode in ("none", "full"):
        return checkpointing.mode
    option = checkpointing.selective_ac_option
    if checkpointing.mode == "selective" and (option == "op" or option.isdigit()):
        return "selective" if option == "op" else f"every-{option}"  # "2": every 2nd block
    raise ValueError(f"activation_checkpoint mode={checkpointing.mode!r} "
                     f"selective_ac_option={option!r}: stacklm recomputes none, full, selective "
                     f"with 'op', or every N-th block (selective with 'N')")


def refuse_unsupported(job):
    """Keys torchtitan honours with its own parts and this spec would silently ignore."""
    parallelism = job.parallelism
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        if getattr(parallelism, key) != 1:
            raise ValueError(f"parallelism.{key}={getattr(parallelism, key)}: the stacklm spec "
                             f"shards with FSDP2 alone (Muon takes Shard(0) on a 1-D mesh); "
                             f"set it to 1")
    if job.optimizer.eps != 1e-8 or job.optimizer.early_step_in_backward:
        raise ValueError("optimizer.eps and optimizer.early_step_in_backward: stacklm's AdamW "
                         "uses eps 1e-8 and steps after the backward; leave both at their "
                         "defaults")
    if job.validation.enable or job.model.converters or job.checkpoint.initial_load_in_hf:
        raise ValueError("validation.enable, model.converters and checkpoint."
                         "initial_load_in_hf: the stacklm spec has no validator, converters or "
                         "state-dict adapter (train.py evaluates its own val loss, and "
                         "--init_from reads transformers folders); turn them off")


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class StackArgs(BaseModelArgs):
    """A flavor: the model's shape, and (once torchtitan has read the TOML) the run."""
    model: config.StackConfig = dataclasses.field(default_factory=config.StackConfig)
    run: config.TrainConfig | None = None

    def update_from_config(self, job_config, **kwargs):
        self.run = train_config(job_config)

    def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per token in torchtitan's MFU convention: PaLM's
        6·N_matmul + 12·L·H·D·T (model.flops_per_token explains both conventions)."""
        return count_params(model), int(flops_per_token(self.model, seq_len, "palm"))


class Hidden(NamedTuple):
    """What the model's forward hands torchtitan's loss: the final-norm hidden states
    (B, T, C) and the head's weight (the tied embedding, (V, C))."""
    states: torch.Tensor
    head: torch.Tensor


class StackTransformer(Transformer):
    """model.Transformer, as torchtitan builds it: on the meta device, sharded, then filled
    by `init_weights`. Its forward returns the hidden states and the head's weight, and
    torchtitan's loss function (`build_loss_fn`) runs the head, as its protocol splits a
    step: pred = model(inputs, **extras); loss = loss_fn(pred, labels)."""

    def __init__(self, args: StackArgs):
        super().__init__(args.model)
        self.run = args.run  # the hooks built after the model read the run from it

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        """torchtitan calls this on every rank once the (sharded) model has storage.
        stacklm's weights are a function of the seed alone: train.build_model seeds torch
        and builds the whole model on the CPU. Do the same, and keep this rank's rows: the
        same weights as `python train.py` with this seed, on any number of ranks. (The
        constructor calls it too, on the meta device, where there is nothing to fill.)"""
        if self.embed.weight.is_meta:
            return
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(self.run.seed)
            whole = Transformer(self.cfg)
        for name, param in self.named_parameters():
            value = whole.get_parameter(name).to(param.device, param.dtype)
            if isinstance(param, DTensor):  # this rank's rows, cut here: no communication
                value = distribute_tensor(value, param.device_mesh, param.placements,
                                          src_data_rank=None)
            param.copy_(value)

    def forward(self, input_ids, position_ids=None, seq_ids=None) -> Hidden:
        # A view, not the parameter itself: FSDP2 hooks every tensor a forward returns, and
        # a hook on the parameter would stay on it for every later step.
        return Hidden(self.hidden_states(input_ids, position_ids, seq_ids),
                      self.embed.weight.view_as(self.embed.weight))


def parallelize(model: StackTransformer, parallel_dims, job_config) -> StackTransformer:
    """train.build_model's recomputation and compilation, then train.shard_model's FSDP2
    layout (one group per block, then the root with the tied embedding) on torchtitan's
    mesh. torchtitan's loss is already divided by the global token count, so FSDP2 sums
    the gradients and divides by nothing (torchtitan's own models do the same)."""
    run = model.run
    for layer, block in enumerate(model.blocks):
        block.recompute = run.block_recompute(layer)
    if run.compile_model == "true":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    if not parallel_dims.fsdp_enabled:
        return model
    mesh = parallel_dims.get_mesh("fsdp")
    # The root stays gathered after its forward: the head, in torchtitan's loss, runs on the
    # tied embedding after the forward has returned.
    train.shard_layout(model, mesh, job_config.training.mixed_precision_param == "bfloat16",
                       blocks_reshard=job_config.parallelism.fsdp_reshard_after_forward != "never",
                       root_reshard=False)
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    for module in [*model.blocks, model]:
        module.set_gradient_divide_factor(1.0)
        if gloo:  # gloo has no PREMUL_SUM, FSDP2's op for a factor: sum, then divide by 1
            module.set_force_sum_reduction_for_comms(True)
    return model


# ---------------------------------------------------------------------------------------
# Optimizers, schedule, loss
# ---------------------------------------------------------------------------------------

# DCP keys the optimizers' state by parameter name ("state.blocks.0.attn.q_proj.weight.
# momentum_buffer"), which any number of ranks can reload.
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


class StackOptimizers(OptimizersContainer):
    """optim.build_optimizers' pair (Muon on the hidden matrices, AdamW on the rest) as
    torchtitan's container: stepped and zeroed as train.py steps them, and one state_dict
    of both, by parameter name."""

    def __init__(self, model: torch.nn.Module, run: config.TrainConfig):
        self.run, self.model_parts = run, [model]
        self.pair = optim.build_optimizers(model, run, run.mixed_precision)
        self.optimizers = list(self.pair.named.values())
        # torchtitan registers hooks on the container: Optimizer's own bookkeeping
        torch.optim.Optimizer.__init__(self, [p for p in model.parameters()], {})

    def step(self, *args, **kwargs):
        self.pair.step()

    def zero_grad(self, *args, **kwargs):
        self.pair.zero_grad()

    def state_dict(self) -> dict:
        model = self.model_parts[0]
        return {key: value for optimizer in self.optimizers
                for key, value in get_optimizer_state_dict(model, optimizer,
                                                           options=BY_NAME).items()}

    def load_state_dict(self, state_dict: dict):
        for optimizer in self.optimizers:  # each takes its own parameters' keys
            set_optimizer_state_dict(self.model_parts[0], optimizer, state_dict,
                                     options=BY_NAME)


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    if len(model_parts) != 1:
        raise ValueError("the stacklm spec trains one model part (no pipeline parallelism)")
    return StackOptimizers(model_parts[0], model_parts[0].run)


class StackSchedules(LRSchedulersContainer):
    """optim.lr_multiplier, the WSD schedule of the step, as one LambdaLR per optimizer: each
    sets its groups' lr to their initial (peak) lr × the multiplier, as Optimizers.set_lr
    does. torchtitan's container saves the first one's state and loads it into every one,
    which takes same-shaped optimizers (Muon has one param group, AdamW two): each saves and
    loads its own."""

    def state_dict(self) -> dict:
        return {str(i): scheduler.state_dict() for i, scheduler in enumerate(self.schedulers)}

    def load_state_dict(self, state_dict: dict):
        for i, scheduler in enumerate(self.schedulers):
            scheduler.load_state_dict(state_dict[str(i)])


def build_lr_schedulers(optimizers: StackOptimizers, lr_scheduler_config, training_steps):
    return StackSchedules(optimizers, functools.partial(optim.lr_multiplier, cfg=optimizers.run))


def build_loss_fn(job_config, **kwargs):
    """The training loss of Transformer.forward's head, summed over the targets (torchtitan
    divides by the global token count): the fused CE + z-loss, ce_chunk_size rows at a time
    without the (N, V) logits, or the plain head at ce_chunk_size 0 (the tiny flavor)."""
    model_cfg = FLAVORS[job_config.model.flavor]

    def loss_fn(pred: Hidden, labels: torch.Tensor) -> torch.Tensor:
        hidden, targets = pred.states.flatten(0, 1), labels.flatten()  # (N, C), (N,)
        if not model_cfg.ce_chunk_size:
            return plain_head_loss(hidden, pred.head, targets, model_cfg.z_loss, "sum").loss
        return fused_ce_z_loss(hidden, pred.head, targets, model_cfg.z_loss,
                               model_cfg.ce_chunk_size, reduction="sum")[0]
    return loss_fn


# ---------------------------------------------------------------------------------------
# Data and the log
# ---------------------------------------------------------------------------------------

class StackLoader(BaseDataLoader):
    """data.MixtureLoader's micro-batches as torchtitan's (input_dict, labels): input_ids as
    "input", and position_ids and seq_ids, which torchtitan passes to the model's forward
    (document masking). The data stage follows the optimizer step, as in train.py's loop.
    The loader's cursor counts the windows all ranks read together, so its state is the
    same on every rank and resumes on any number of ranks."""

    def __init__(self, run: config.TrainConfig, dp_rank: int, dp_world_size: int):
        stages = [data.Stage(*s) for s in run.stages(config.wsd_phases(run).decay_start)]
        self.loader = data.MixtureLoader(stages, run.seq_len, run.micro_batch_size, dp_rank,
                                         dp_world_size, seed=run.seed)
        self.accum = run.grad_accum_steps(dp_world_size)
        self.micro_batches = 0  # read so far, all steps

    def __iter__(self):
        while True:
            self.loader.set_step(self.micro_batches // self.accum)
            batch = next(self.loader)  # four (B, T) int64 tensors
            self.micro_batches += 1
            yield {"input": batch["input_ids"], "position_ids": batch["position_ids"],
                   "seq_ids": batch["seq_ids"]}, batch["targets"]

    def state_dict(self) -> dict:
        return {"micro_batches": self.micro_batches,
                "mixture": json.dumps(self.loader.state_dict())}  # one string: DCP's flat keys

    def load_state_dict(self, state_dict: dict):
        self.micro_batches = state_dict["micro_batches"]
        self.loader.load_state_dict(json.loads(state_dict["mixture"]))


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> StackLoader:
    return StackLoader(train_config(job_config), dp_rank, dp_world_size)


class StackMetrics(MetricsProcessor):
    """torchtitan's log, plus one JSON line a logged step in <dump_folder>/metrics.jsonl
    (rank 0), with the numbers as computed (its terminal line rounds them)."""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if dist.get_rank() != 0:
            return
        record = {"kind": "train", "step": step, "loss": global_avg_loss,
                  "grad_norm": grad_norm, **(extra_metrics or {})}
        os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
        with open(os.path.join(self.job_config.job.dump_folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def build_metrics(job_config, parallel_dims, model_args=None, tag=None) -> StackMetrics:
    return StackMetrics(job_config, parallel_dims, tag)


TRAIN_SPEC = TrainSpec(
    model_cls=StackTransformer,
    model_args={name: StackArgs(model=shape) for name, shape in FLAVORS.items()},
    parallelize_fn=parallelize,
    pipelining_fn=None,
    build_optimizers_fn=build_optimizers,
    build_lr_schedulers_fn=build_lr_schedulers,
    build_dataloader_fn=build_dataloader,
    build_tokenizer_fn=None,  # the data is tokenized already (prepare.py's shards)
    build_loss_fn=build_loss_fn,
    build_metrics_processor_fn=build_metrics,
)
register_train_spec("stacklm", TRAIN_SPEC)
