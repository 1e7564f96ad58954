"""Configuration: the model shape (`StackConfig`) and the run (`TrainConfig`).

Everything a run can change lives here, under the name the concept has in the literature,
documented once beside its field (`--help` prints that line), checked once, with messages
that name the field, the numbers and the fix. Presets are plain functions; a run's config
is a preset, a TOML file and flags, which plumbing/overrides.py reads, typed from the fields.

`python config.py --world_size=N` prints the micro-batch a launch on N ranks should use.
Imports from stacklm: nothing.
"""

import argparse
import dataclasses
import json
import math
import re
import sys
import tomllib
from typing import NamedTuple
from dataclasses import dataclass, field


def knob(default, description: str, section: str | None = None):
    """A config field and its one-line description, which `--help` prints; a `section` opens
    a group of knobs there (`--help` prints the groups as they read here)."""
    return field(default=default, metadata={"help": description, "section": section})


# The knobs that take one of a few words; `TrainConfig.check` refuses others, `--help` lists them.
CHOICES = {"decay_shape": ("linear", "sqrt", "cosine"),
           "device": ("auto", "cuda", "mps", "cpu"),
           "compile_model": ("auto", "true", "false"),
           "mixed_precision": ("auto", "bf16", "no"),
           "loss_head_dtype": ("fp32", "bf16"),
           "muon_adjust_lr": ("match_rms_adamw", "original"),
           "matrix_optimizer": ("muon", "adamw"),
           "wandb_mode": ("disabled", "offline", "online")}


@dataclass
class StackConfig:
    """The decoder's shape. The defaults are Stack-100M (101.35M parameters)."""

    vocab_size: int = knob(32768, "tokens in the vocabulary, at least that of data_dir's "
                                  "tokenizer")
    d_model: int = knob(512, "width of the residual stream")
    n_layers: int = knob(30, "transformer blocks")
    n_heads: int = knob(8, "query heads per attention layer")
    n_kv_heads: int = knob(2, "key/value heads, shared by groups of query heads (GQA, arXiv "
                              "2305.13245)")
    head_dim: int | None = knob(None, "width of each head's q, k and v; none: d_model/n_heads "
                                      "(Qwen3-0.6B: 128, on a width of 1,024 with 16 heads)")
    intermediate: int = knob(1408, "SwiGLU hidden width, ~2.75 x d_model")
    max_seq_len: int = knob(2048, "longest sequence the model accepts")
    rope_theta: float = knob(10000.0, "RoPE base frequency (arXiv 2104.09864)")
    qk_norm: bool = knob(True, "RMSNorm on per-head q and k (arXiv 2302.05442)")
    nope_every: int = knob(4, "every N-th layer has no RoPE (NoPE, arXiv 2305.19466); 0: none")
    z_loss: float = knob(1e-4, "PaLM's z-loss weight on logsumexp^2 (arXiv 2204.02311)")
    norm_eps: float = knob(1e-6, "RMSNorm epsilon")
    init_std: float = knob(0.02, "normal init std; o_proj and down_proj get "
                                 "init_std/sqrt(2*n_layers)")
    ce_chunk_size: int = knob(4096, "rows of the loss head computed at once (memory vs speed); "
                                    "0: the plain head, all (N, V) logits at once")

    def __post_init__(self):
        positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                    "intermediate", "max_seq_len"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.ce_chunk_size < 0:
            raise ValueError(f"model.ce_chunk_size={self.ce_chunk_size} must be >= 0 (0: the "
                             f"plain loss head over the whole logits)")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"model.head_dim={self.head_dim} must be positive, or none for "
                             f"d_model/n_heads")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by "
                             f"model.n_heads={self.n_heads}; pick n_heads dividing d_model, or "
                             f"set model.head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} does not divide "
                             f"model.n_heads={self.n_heads}; each kv head must serve a whole "
                             f"group of query heads")
        if self.head_size % 2:
            raise ValueError(f"each head's width {self.head_size} (model.head_dim, or "
                             f"d_model/n_heads) must be even for RoPE")
        if self.nope_every < 0:
            raise ValueError(f"model.nope_every={self.nope_every} must be >= 0 (0 = RoPE on "
                             f"every layer)")

    @classmethod
    def from_saved(cls, saved: dict) -> "StackConfig":
        """The shape a checkpoint or an export recorded. An older record's tie_embeddings, a
        knob that only true passed (the head is the embedding), is dropped."""
        return cls(**{k: v for k, v in saved.items() if k != "tie_embeddings"})

    @property
    def head_size(self) -> int:
        """D, the width of each head's q, k and v: head_dim, or d_model / n_heads."""
        return self.head_dim or self.d_model // self.n_heads


def tiny_model() -> StackConfig:
    """About 4M parameters: trains on a laptop CPU in minutes (vocab of the 4k tokenizer)."""
    return StackConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                       intermediate=704, max_seq_len=256,
                       # the plain head: all 16 × 256 rows of 4,096 logits at once
                       ce_chunk_size=0)


@dataclass
class TrainConfig:
    """One training run. Defaults are the Stack-100M reference run (preset `stack100m`)."""

    model: StackConfig = field(default_factory=StackConfig,
                               metadata={"help": "the decoder's shape"})
    data_dir: str = knob("data/stdlib-32k", "prepared data (`python prepare.py`), or a mixture "
                                            "by shares of the tokens: dirA:7,dirB:2,dirC:1",
                         section="data and outputs")
    anneal_data_dir: str | None = knob(None, "the mixture from decay_start on, same syntax (the "
                                             "decay phase as mid-training, arXiv 2404.06395)")
    data_stages: tuple[dict, ...] = knob((), "more stages, in a TOML file only: [[data_stages]] "
                                             "with start = STEP and data_dir = MIXTURE")
    out_dir: str = knob("out/stack100m", "checkpoints (out_dir/ckpt), metrics.jsonl, the report; "
                                         "`python export.py` writes its exports here")
    seq_len: int = knob(2048, "tokens per training sequence",
                        section="batch: the global batch is fixed in tokens; gradient "
                                "accumulation is derived from it")
    micro_batch_size: int = knob(32, "sequences per forward pass on one rank")
    global_batch_tokens: int = knob(524_288, "tokens per optimizer step, all ranks together")
    total_steps: int = knob(38_147, "the full run the schedule is laid out for (stack100m: "
                                    "20B tokens)",
                            section="schedule: warmup-stable-decay (WSD, arXiv 2404.06395), in "
                                    "optimizer steps")
    stop_at_step: int = knob(34_332, "where this run stops (stack100m: end of the stable phase)")
    warmup_steps: int = knob(2_000, "linear warmup length, in optimizer steps")
    decay_fraction: float = knob(0.1, "decay leg as a fraction of total_steps, when "
                                      "decay_steps is none")
    decay_steps: int | None = knob(None, "decay leg length; none: "
                                         "round(decay_fraction*total_steps)")
    decay_start: int | None = knob(None, "first step of the decay leg; none: "
                                         "total_steps-decay_steps")
    decay_shape: str = knob("sqrt", "shape of the decay leg (sqrt: 1-sqrt, arXiv 2405.18392)")
    final_frac: float = knob(0.0, "lr multiplier at the end of the decay leg")
    adamw_peak_lr: float = knob(3e-3, "AdamW's peak lr (embedding, gains; matrices too if adamw)",
                                section="optimizers: Muon on hidden matrices, AdamW on embedding "
                                        "and gains")
    # The unit of muon_peak_lr: with match_rms_adamw, Muon's step on an (A, B) matrix is
    # lr·0.2·√max(A, B)·O, and an orthogonal O has entry RMS 1/√max(A, B): the update's RMS
    # is 0.2·lr, an AdamW update's scale (Moonlight, arXiv 2502.16982). 6e-3, twice
    # adamw_peak_lr, is a starting point, not tuned for Stack-100M (tiny's: docs/figures.md).
    muon_peak_lr: float = knob(6e-3, "Muon's peak lr; on AdamW's scale with match_rms_adamw; "
                                     "not tuned")
    muon_momentum: float = knob(0.95, "Muon's momentum (Nesterov)")
    muon_adjust_lr: str = knob("match_rms_adamw", "Muon's per-matrix lr scale (Moonlight, "
                                                  "arXiv 2502.16982 | Jordan et al.)")
    matrix_optimizer: str = knob("muon", "optimizer of the hidden matrices (adamw: the all-AdamW "
                                         "baseline)")
    weight_decay: float = knob(0.1, "decoupled weight decay of matrices and embedding, not "
                                    "gains")
    betas: tuple[float, float] = knob((0.9, 0.95), "AdamW's (beta1, beta2)")
    grad_clip: float = knob(1.0, "max global grad norm; 0 disables clipping")
    max_bad_steps: int = knob(5, "consecutive non-finite steps before the run stops")
    seed: int = knob(1337, "seeds the initial weights, the data order and the sample",
                     section="hardware and numerics: auto picks what this machine computes "
                             "fastest, and the banner says why")
    device: str = knob("auto", "where the run trains (auto: a CUDA GPU, else an Apple GPU "
                               "(mps), else the CPU)")
    compile_model: str = knob("auto", "torch.compile each block (auto: on CUDA, and on a CPU "
                                      "for runs of 500+ steps, where it pays back)")
    mixed_precision: str = knob("auto", "autocast (auto: bf16 on a GPU or CPU that computes "
                                        "bf16 natively, else no: fp32)")
    loss_head_dtype: str = knob("fp32", "the chunked loss head's matmul inputs; bf16 keeps fp32 "
                                        "accumulation, logits and logsumexp")
    activation_recompute: str = knob("none", "none | full | every-N | selective: blocks "
                                             "recomputed in backward instead of stored "
                                             "(selective: their cheap ops only)")
    log_every: int = knob(10, "optimizer steps between log lines",
                          section="logging, evaluation, checkpoints")
    eval_every: int = knob(1_000, "optimizer steps between validation evaluations")
    eval_tokens: int | None = knob(4_194_304, "validation tokens per evaluation and source (at "
                                              "most its whole val split); none: all of it")
    downstream: str = knob("", "multiple-choice tasks scored as lm-eval does (downstream.py): "
                               "NAME:PATH,NAME:PATH; NAME hellaswag, arc_easy, arc_challenge, "
                               "piqa, nextline (PATH a prepared data_dir; bare nextline: the "
                               "run's own data) or any: generic")
    downstream_every: int | None = knob(None, "optimizer steps between scorings, a multiple of "
                                              "eval_every; none: at each evaluation")
    downstream_items: int | None = knob(500, "items scored per task: a file's first N, nextline's "
                                             "first N in its seeded order; none: all")
    ckpt_every: int = knob(1_000, "optimizer steps between checkpoints")
    ckpt_async: bool = knob(False, "write each checkpoint in the background: staged in memory, "
                                   "then written while training goes on (the last step's "
                                   "blocks)")
    keep_last_ckpts: int = knob(5, "newest checkpoints kept in out_dir/ckpt; older ones are "
                                   "deleted, except where a data stage or the decay begins")
    resume: str = knob("latest", "latest | none | PATH: latest is the newest checkpoint in "
                       "out_dir; PATH elsewhere is where a branched run begins (it continues "
                       "its own checkpoints once it has them)")
    init_from: str | None = knob(None, "a transformers folder (Llama, Qwen3, SmolLM3, stacklm's "
                                       "export): its config.json sets the model's shape, its "
                                       "weights a fresh run's start (a checkpoint wins)")
    max_epochs: float | None = knob(16.0, "refuse a run that would read a train split more than "
                                         "this many times (none: any; past 4, a plan is warned "
                                         "about either way)")
    sample_prompt: str = knob("def ", "text the end-of-run sample continues")
    sample_tokens: int = knob(64, "tokens generated for that sample")
    write_report: bool = knob(True, "out_dir/report.md and report.png at every checkpoint and "
                                    "at the end (`python report.py OUT_DIR` makes them any time)")
    tensorboard: bool = knob(False, "also write the train and eval records' numbers to "
                                    "out_dir/tb/ for TensorBoard (pip install tensorboard)")
    wandb_mode: str = knob("disabled", "Weights & Biases logging")
    wandb_project: str = knob("stacklm", "Weights & Biases project")

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = StackConfig.from_saved(self.model)
        self.betas = tuple(self.betas)
        self.data_stages = tuple(dict(stage) for stage in self.data_stages)
        self.check()

    def check(self):
        """Checks that need no hardware and no data. Each error names the field and the fix."""
        positive = ["seq_len", "micro_batch_size", "global_batch_tokens", "total_steps",
                    "stop_at_step", "log_every", "eval_every", "ckpt_every",
                    "keep_last_ckpts", "max_bad_steps", "adamw_peak_lr", "muon_peak_lr"]
        for name in positive:
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):  # `value <= 0` would let NaN through
                raise ValueError(f"{name}={value} must be a positive, finite number")
        for name, none in [("eval_tokens", "the whole val split"),
                           ("downstream_items", "every item")]:
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"{name}={value} must be positive, or none for {none}")
        if self.downstream_every is not None and (self.downstream_every <= 0
                                                  or self.downstream_every % self.eval_every):
            raise ValueError(f"downstream_every={self.downstream_every} must be a positive "
                             f"multiple of eval_every={self.eval_every} (scoring runs at an "
                             f"evaluation), or none for every evaluation")
        parse_downstream(self.downstream)  # raises if the task list is malformed
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1), e.g. "
                             f"--betas=0.9,0.95 (AdamW's beta1, beta2)")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum={self.muon_momentum} must be within [0, 1)")
        if self.seq_len > self.model.max_seq_len and self.init_from:  # its config.json's
            raise ValueError(f"seq_len={self.seq_len} exceeds max_position_embeddings="
                             f"{self.model.max_seq_len} of {self.init_from}/config.json, the "
                             f"longest sequence that model takes; pass --seq_len="
                             f"{self.model.max_seq_len} or less")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}; lower seq_len or raise max_seq_len")
        self.grad_accum_steps(1)  # raises if one rank cannot split the global batch
        if self.stop_at_step > self.total_steps:
            raise ValueError(f"stop_at_step={self.stop_at_step:,} is past total_steps="
                             f"{self.total_steps:,}; the schedule has no steps there: pass "
                             f"--stop_at_step={self.total_steps} with it, or a larger "
                             f"--total_steps")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be within [0, 1]")
        if not 0.0 <= self.final_frac <= 1.0:
            raise ValueError(f"final_frac={self.final_frac} must be within [0, 1]")
        if self.max_epochs is not None and not (self.max_epochs > 0
                                                and math.isfinite(self.max_epochs)):
            raise ValueError(f"max_epochs={self.max_epochs} must be a positive, finite number "
                             f"(or none)")
        for name in ("weight_decay", "grad_clip", "warmup_steps"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.loss_head_dtype == "bf16" and not self.model.ce_chunk_size:
            raise ValueError("loss_head_dtype=bf16 sets the chunked loss head's matmul inputs, "
                             "and model.ce_chunk_size=0 runs the plain head; set "
                             "--model.ce_chunk_size (e.g. 4096) with it, or drop it")
        self.block_recompute(0)  # raises if activation_recompute is malformed
        self.stages(None)  # raises if a mixture or a stage is malformed
        check_schedule(self)  # raises if the schedule cannot be laid out, or stops mid-decay

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step, derived so the global batch survives
        any change of GPU count. Refuses a global batch the ranks cannot split evenly."""
        per_step = self.micro_batch_size * self.seq_len * world_size
        if self.global_batch_tokens % per_step:
            fits = self.fitting_micro_batch(world_size)
            nearest = max(1, round(self.global_batch_tokens / per_step)) * per_step
            # every rank count is a multiple of 1, and no multiple of world_size can split it
            ranks = " or another number of ranks" if world_size > 1 else ""
            fix = (f"use micro_batch_size={fits}" if fits
                   else f"use global_batch_tokens={nearest:,}{ranks}")
            raise ValueError(f"global_batch_tokens={self.global_batch_tokens:,} is not divisible "
                             f"by micro_batch_size*seq_len*world_size={self.micro_batch_size}*"
                             f"{self.seq_len}*{world_size}={per_step:,}; {fix}")
        return self.global_batch_tokens // per_step

    def fitting_micro_batch(self, world_size: int) -> int | None:
        """The largest micro-batch, at most micro_batch_size, that splits the global batch
        evenly over world_size ranks (None: none does): slurm_fsdp2.sh's, on any node count."""
        fits = [m for m in range(1, self.micro_batch_size + 1)
                if self.global_batch_tokens % (m * self.seq_len * world_size) == 0]
        return fits[-1] if fits else None

    def stages(self, decay_start: int | None) -> list[tuple[int, tuple[tuple[str, float], ...]]]:
        """The data stages, (first step, ((data_dir, share), ...)), by step: data_dir from step
        0, each [[data_stages]] table from its start, anneal_data_dir from decay_start
        (wsd_phases resolves it; None: its mixture is only checked)."""
        tables = [(0, "data_dir", self.data_dir)]
        for i, table in enumerate(self.data_stages):
            if set(table) != {"start", "data_dir"} or type(table["start"]) is not int \
                    or not isinstance(table["data_dir"], str):
                raise ValueError(f"data_stages[{i}] = {table!r}: each [[data_stages]] table "
                                 f"holds start = STEP (an integer) and data_dir = \"MIXTURE\"")
            tables.append((table["start"], f"data_stages[{i}]", table["data_dir"]))
        if self.anneal_data_dir is not None:
            if decay_start is None:
                parse_mixture(self.anneal_data_dir, "anneal_data_dir")
            else:
                tables.append((decay_start, "anneal_data_dir", self.anneal_data_dir))
        starts = {}
        for start, name, _ in tables:
            if not 0 <= start <= self.total_steps:
                raise ValueError(f"{name} starts at step {start:,}, outside the schedule's 0.."
                                 f"{self.total_steps:,}")
            if start in starts:
                raise ValueError(f"{name} and {starts[start]} both start at step {start:,}; "
                                 f"a step reads one stage: move one of them")
            starts[start] = name
        return sorted((start, parse_mixture(spec, name)) for start, name, spec in tables)

    def block_recompute(self, layer: int) -> str:
        """What block `layer` (from 0) recomputes in backward (model.Block.recompute): "none",
        "full" (every block, or every N-th, blocks 0, N, 2N, … for every-N) or
        "selective" (every block: its cheap ops only)."""
        mode = self.activation_recompute
        if mode in ("none", "full", "selective"):
            return mode
        prefix, _, n = mode.partition("-")
        if prefix != "every" or not n.isdigit() or int(n) < 1:
            raise ValueError(f"activation_recompute={mode!r} is not none, full, every-N or "
                             f"selective (e.g. every-2 recomputes every second block)")
        return "full" if layer % int(n) == 0 else "none"

    def batch_summary(self, world_size: int) -> str:
        """E.g. `524,288 tokens/step = 256 seqs x 2,048 = 32 micro x 8 accum x 1 rank`."""
        accum = self.grad_accum_steps(world_size)
        seqs = self.global_batch_tokens // self.seq_len
        ranks = "rank" if world_size == 1 else "ranks"
        return (f"{self.global_batch_tokens:,} tokens/step = {seqs:,} seqs × {self.seq_len:,} = "
                f"{self.micro_batch_size} micro × {accum} accum × {world_size} {ranks}")


# ---------------------------------------------------------------------------------------
# The schedule's layout: warmup-stable-decay, checked with the rest of the config
# ---------------------------------------------------------------------------------------

class WSDPhases(NamedTuple):
    """The warmup-stable-decay layout over total_steps; every field counts optimizer steps."""
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_start: int  # the first step of the decay leg


def wsd_phases(cfg) -> WSDPhases:
    """Resolve the defaults: decay_steps = round(decay_fraction·total_steps) and
    decay_start = total_steps − decay_steps unless set."""
    decay_steps = cfg.decay_steps
    if decay_steps is None:
        decay_steps = round(cfg.decay_fraction * cfg.total_steps)
    start = cfg.total_steps - decay_steps if cfg.decay_start is None else cfg.decay_start
    return WSDPhases(cfg.warmup_steps, start - cfg.warmup_steps, decay_steps, start)


def format_phases(phases: WSDPhases) -> str:
    return (f"{phases.warmup_steps:,} warmup / {phases.stable_steps:,} stable / "
            f"{phases.decay_steps:,} decay")


def check_schedule(cfg) -> WSDPhases:
    """The phases; refuses a schedule that cannot be laid out, or that would stop a run
    mid-decay: stopped early (stop_at_step < total_steps) to continue later, the run would
    leave a partly annealed checkpoint, and re-warming it costs much of what decaying bought."""
    phases = wsd_phases(cfg)
    warmup, decay, start = phases.warmup_steps, phases.decay_steps, phases.decay_start
    layout = f"{format_phases(phases)} over total_steps={cfg.total_steps:,}"
    if decay < 0:
        raise ValueError(f"decay_steps={decay} must be >= 0")
    if warmup + decay > cfg.total_steps:
        raise ValueError(f"warmup_steps + decay_steps = {warmup:,} + {decay:,} exceed "
                         f"total_steps={cfg.total_steps:,} ({layout}); shorten warmup_steps or "
                         f"the decay leg (decay_fraction, decay_steps), or raise total_steps")
    if phases.stable_steps < 0 or start + decay > cfg.total_steps:
        raise ValueError(f"decay_start={start:,} does not fit between the end of warmup and "
                         f"total_steps ({layout}); use a decay_start between {warmup:,} and "
                         f"{cfg.total_steps - decay:,}")
    stops_mid_decay = cfg.stop_at_step < cfg.total_steps and start < cfg.stop_at_step
    if cfg.decay_start is None and stops_mid_decay:
        raise ValueError(
            f"stop_at_step={cfg.stop_at_step:,} is inside the decay leg (from step "
            f"{start:,}; {layout}): the run would stop mid-decay, leaving an annealed "
            f"checkpoint that is costly to re-warm; set decay_start={start:,} explicitly if "
            f"intended, or stop_at_step={start:,} to stop at the end of the stable phase, or "
            f"total_steps={cfg.stop_at_step:,} to fit the whole schedule into this run")
    return phases


# A weight written another way than DIR:W,DIR:W: `a:0.7 b:0.3` (spaces between sources) or
# `a=0.7` (an equals sign). Read as it is, either would be one odd directory name.
OTHER_WEIGHT_SYNTAX = re.compile(r":\s*[\d.]+\s+[^\s,]|=\s*[\d.]+(\s|,|$)")


def parse_mixture(spec: str, name: str = "data_dir") -> tuple[tuple[str, float], ...]:
    """`dirA:7,dirB:2,dirC:1` -> ((dirA, 0.7), (dirB, 0.2), (dirC, 0.1)); a bare directory
    is a mixture of one. Weights are shares of the training tokens, whatever each source's
    size, normalised to sum to 1."""
    if OTHER_WEIGHT_SYNTAX.search(spec):
        fixed = ",".join(re.sub(r"\s*[:=]\s*", ":", part)
                         for part in re.split(r"[\s,]+(?=[^\s,:=]+\s*[:=])", spec.strip()))
        raise ValueError(f"{name}={spec!r}: write a mixture as DIR:W,DIR:W (a colon before "
                         f"each weight, commas between sources, no spaces), e.g. "
                         f"{name}={fixed}")
    sources = []
    for item in spec.split(","):
        path, colon, weight = item.strip().rpartition(":")
        if not colon:
            path, weight = weight, "1"
        try:
            share = float(weight)
        except ValueError:
            share = math.nan
        if not path or not (share > 0 and math.isfinite(share)):
            raise ValueError(f"{name}={spec!r}: {item.strip()!r} is not DIR or DIR:WEIGHT with "
                             f"a positive weight; write e.g. {name}=data/fwe:7,data/cosmo:3")
        sources.append((path, share))
    paths = [path for path, _ in sources]
    if len(set(paths)) < len(paths):
        raise ValueError(f"{name}={spec!r} names a directory twice; give each source once, "
                         f"with its whole weight")
    total = sum(share for _, share in sources)
    return tuple((path, share / total) for path, share in sources)


def parse_downstream(spec: str) -> list[tuple[str, str | None]]:
    """`hellaswag:data/hellaswag_val.jsonl,nextline:data/stdlib-4k` -> [(name, path), ...];
    "" -> no tasks; bare `nextline` -> ("nextline", None): the run's own data (downstream.py).
    A name keys the task's metrics (acc/<name>), so each appears once."""
    tasks = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, colon, path = item.partition(":")
        if item == "nextline":
            path = None
        elif not (colon and name and path) or "/" in name:
            raise ValueError(f"downstream={spec!r}: {item!r} is not NAME:PATH (only nextline "
                             f"stands alone: the run's own data); write e.g. "
                             f"--downstream=hellaswag:data/hellaswag_val.jsonl")
        tasks.append((name, path))
    names = [name for name, _ in tasks]
    if len(set(names)) < len(names):
        raise ValueError(f"downstream={spec!r} names a task twice; give each a name of its own")
    return tasks


# Repeating data up to about 4 epochs trains almost as well as fresh data; beyond that each
# further repetition is worth less by a factor e every ~15 (Muennighoff et al., arXiv
# 2305.16264). A plan past 4 is warned about; one past max_epochs (16 by default) refused.
EPOCHS_WARNED = 4


def eval_windows(cfg: TrainConfig, val_windows: int) -> int:
    """How many of a val split's `val_windows` windows an evaluation reads: the first
    eval_tokens' worth, or all of them (eval_tokens none, or a smaller split); at least one."""
    wanted = val_windows if cfg.eval_tokens is None else cfg.eval_tokens // cfg.seq_len
    return max(1, min(wanted, val_windows))


def data_plan(cfg: TrainConfig, stages: list, tokens_per_epoch: dict[str, int]) -> list[dict]:
    """One row per stage and source: its share, the train tokens it holds (one epoch), and the
    tokens this run reads from it in that stage (steps before stop_at_step × batch × share)."""
    rows = []
    for k, (start, sources) in enumerate(stages):
        end = stages[k + 1][0] if k + 1 < len(stages) else cfg.stop_at_step
        steps = max(0, min(end, cfg.stop_at_step) - start)
        rows += [{"start": start, "source": path, "weight": weight,
                  "available": tokens_per_epoch[path],
                  "planned": round(steps * cfg.global_batch_tokens * weight)}
                 for path, weight in sources]
    return rows


def check_epochs(cfg: TrainConfig, plan: list[dict]) -> list[str]:
    """A warning line for each source this run reads more than EPOCHS_WARNED times, over
    all its stages; a ValueError naming the first source past max_epochs (none: no bound)."""
    planned, available = {}, {}
    for row in plan:
        planned[row["source"]] = planned.get(row["source"], 0) + row["planned"]
        available[row["source"]] = row["available"]
    warnings = []
    for source, tokens in planned.items():
        epochs = tokens / available[source]
        if cfg.max_epochs is not None and epochs > cfg.max_epochs:
            raise ValueError(f"this run would read {source} {epochs:,.1f} times ({tokens:,} "
                             f"tokens planned over {available[source]:,} tokens/epoch), more "
                             f"than max_epochs={cfg.max_epochs:g}; prepare a real corpus "
                             f"with prepare.py (docs/data.md), lower --stop_at_step or the "
                             f"source's weight, or pass --max_epochs=none to accept it")
        if epochs > EPOCHS_WARNED:
            warnings.append(f"warning: this run reads {source} {epochs:,.1f} times (more than "
                            f"{EPOCHS_WARNED} epochs, past which repeated data teaches little); "
                            f"prepare a real corpus or a mixture of corpora (docs/data.md), "
                            f"or set --max_epochs=4 to refuse such a plan")
    return warnings


def flat(config: dict) -> dict:
    """A config (as asdict, a train_state.json or a start record holds it), model knobs flat."""
    config = dict(config)
    model = config.pop("model", {})
    return {**config, **{f"model.{k}": v for k, v in model.items()}}


def differences(cfg: TrainConfig, other: dict) -> list[tuple[str, object, object]]:
    """(knob, other's value, cfg's value) for each knob cfg differs in from `other` (a config
    as `flat` reads it); a knob `other` lacks (a config older than the knob) counts as equal."""
    ours = flat(json.loads(json.dumps(dataclasses.asdict(cfg))))  # tuples compare as lists
    theirs = flat(json.loads(json.dumps(other)))
    return [(k, theirs.get(k), v) for k, v in ours.items() if theirs.get(k, v) != v]


def nearest_preset(cfg: TrainConfig) -> tuple[str, list[tuple[str, object, object]]]:
    """The preset cfg differs least from, and those differences (`differences`): the config
    a run report shows, as a diff from the defaults it was made from."""
    diffs = {name: differences(cfg, dataclasses.asdict(make())) for name, make in PRESETS.items()}
    name = min(diffs, key=lambda name: len(diffs[name]))
    return name, diffs[name]


def stack100m() -> TrainConfig:
    """The reference run: 524,288 tokens/step, stopped at the end of the stable phase."""
    return TrainConfig()


# The tiny run's next-line items per evaluation: a scoring costs a small share of the training
# between evaluations (docs/figures.md), and the acc of 100 has a standard error ≤ 0.05.
TINY_ITEMS = 100


def tiny() -> TrainConfig:
    """A ~4M-parameter model that trains 1.23M tokens (300 steps of 4,096) on 2 CPU cores in
    minutes. It keeps its tokens whatever the CPU, so a preset computes the same run on
    every machine (the times and the choice: docs/figures.md)."""
    return TrainConfig(model=tiny_model(), data_dir="data/stdlib-4k", out_dir="out/tiny",
                       seq_len=256, micro_batch_size=16, global_batch_tokens=4096,
                       total_steps=300, stop_at_step=300, warmup_steps=30, decay_fraction=0.2,
                       # eval_tokens none: all of val, the documents manifest.json lists,
                       # so a scorer outside the run reads the same text (docs/checkpoints.md)
                       log_every=10, eval_every=100, eval_tokens=None, ckpt_every=100,
                       keep_last_ckpts=2, sample_tokens=48,
                       downstream="nextline", downstream_items=TINY_ITEMS)


PRESETS = {"stack100m": stack100m, "tiny": tiny}


# What `python config.py --world_size=N` reads of train.py's flags: the knobs that size the
# batch, so that it answers without importing torch. train.py checks the rest.
BATCH_KNOBS = ("seq_len", "micro_batch_size", "global_batch_tokens")


def fit_micro_batch(argv: list[str] | None = None) -> int:
    """`python config.py --world_size=N [train.py's flags]`: the micro-batch a launch on N
    ranks should use, in the config train.py makes of the preset, a TOML file and the flags."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="stack100m")
    parser.add_argument("--config", metavar="RUN.TOML", help="TOML file of overrides")
    for name in ("world_size", *BATCH_KNOBS):
        parser.add_argument(f"--{name}", type=int)
    args, knobs = parser.parse_known_args(argv)[0], {}
    if args.world_size is None:
        raise ValueError("--world_size=N is required: the ranks of the launch")
    if args.config:
        with open(args.config, "rb") as f:
            knobs = {k: v for k, v in tomllib.load(f).items() if k in BATCH_KNOBS}
    knobs |= {k: getattr(args, k) for k in BATCH_KNOBS if getattr(args, k) is not None}
    cfg = dataclasses.replace(PRESETS[args.preset](), **knobs)
    micro = cfg.fitting_micro_batch(args.world_size)
    if micro is None:
        cfg.grad_accum_steps(args.world_size)  # no micro-batch splits the batch: it says why
    return micro


if __name__ == "__main__":
    try:
        print(fit_micro_batch())
    except (ValueError, OSError, argparse.ArgumentError) as e:  # one line, as every command
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
