"""Configuration: the model shape (`StackConfig`) and the run (`TrainConfig`).

Everything a run can change lives here, under the name the concept has in the
literature, and is validated once, with messages that name the field, the numbers and
the fix. Presets are plain functions; overrides come from a TOML file and from the
command line (`--key=value`, `--model.key=value`), typed from the dataclass fields.

This file imports nothing else from stacklm.
"""

import argparse
import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field


@dataclass
class StackConfig:
    """The decoder's shape. The defaults are Stack-100M (101.3M parameters)."""

    vocab_size: int = 32768
    d_model: int = 512
    n_layers: int = 30
    n_heads: int = 8
    n_kv_heads: int = 2  # grouped-query attention: 4 query heads share each k/v head
    intermediate: int = 1408  # SwiGLU hidden width, ~2.75 x d_model
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    qk_norm: bool = True  # RMSNorm on per-head q and k (arXiv 2302.05442)
    nope_every: int = 4  # every 4th layer has no rotary embedding (NoPE, arXiv 2305.19466)
    tie_embeddings: bool = True
    z_loss: float = 1e-4  # PaLM's z-loss weight on logsumexp^2 (arXiv 2204.02311)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    ce_chunk_size: int = 4096  # rows of the loss head computed at once (memory vs speed)

    def __post_init__(self):
        positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                    "intermediate", "max_seq_len", "ce_chunk_size"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be positive")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by "
                             f"model.n_heads={self.n_heads}; pick n_heads dividing d_model")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} does not divide "
                             f"model.n_heads={self.n_heads}; each kv head must serve a whole "
                             f"group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head dim d_model/n_heads={self.head_dim} must be even for RoPE")
        if self.nope_every < 0:
            raise ValueError(f"model.nope_every={self.nope_every} must be >= 0 (0 = RoPE on "
                             f"every layer)")
        if not self.tie_embeddings:
            raise ValueError("model.tie_embeddings=False is not supported: Stack-100M ties "
                             "the LM head to the embedding")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def tiny_model() -> StackConfig:
    """About 4M parameters: trains on a laptop CPU in minutes (vocab of the 4k tokenizer)."""
    return StackConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                       intermediate=704, max_seq_len=256, ce_chunk_size=1024)


@dataclass
class TrainConfig:
    """One training run. Defaults are the Stack-100M reference run (preset `stack100m`)."""

    model: StackConfig = field(default_factory=StackConfig)
    # data and outputs
    data_dir: str = "data/stdlib-32k"  # made by `python data.py`
    out_dir: str = "out/stack100m"
    # batch: the global batch is fixed in tokens; gradient accumulation is derived from it
    seq_len: int = 2048
    micro_batch_size: int = 32  # sequences per forward pass on one rank
    global_batch_tokens: int = 524_288  # tokens per optimizer step, all ranks together
    # schedule: warmup-stable-decay (WSD, arXiv 2404.06395), in optimizer steps
    total_steps: int = 38_147  # the full run the schedule is laid out for (20B tokens)
    stop_at_step: int = 34_332  # where this run stops: the end of the stable phase
    warmup_steps: int = 2_000
    decay_fraction: float = 0.1  # decay leg as a fraction of total_steps (if decay_steps unset)
    decay_steps: int | None = None  # decay leg length; None: round(decay_fraction*total_steps)
    decay_start: int | None = None  # absolute first decay step; None: total_steps-decay_steps
    decay_shape: str = "sqrt"  # linear | sqrt (1-sqrt) | cosine
    final_frac: float = 0.0  # lr multiplier at the end of the decay leg
    # optimizers: Muon on hidden matrices, AdamW on embedding and gains
    adamw_peak_lr: float = 3e-3
    muon_peak_lr: float = 6e-3
    muon_momentum: float = 0.95
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw | original
    matrix_optimizer: str = "muon"  # muon | adamw (the all-AdamW baseline)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops
    # hardware; "auto" picks the fast choice on CUDA and the safe one on CPU
    seed: int = 1337
    compile_model: str = "auto"  # auto | true | false
    mixed_precision: str = "auto"  # auto | bf16 | no
    activation_checkpointing: str = "none"  # none | full | every-N (every N-th block)
    # logging, evaluation, checkpoints
    log_every: int = 10
    eval_every: int = 1_000
    eval_tokens: int = 4_194_304  # validation tokens per evaluation
    ckpt_every: int = 1_000
    keep_last_ckpts: int = 5
    resume: str = "auto"  # auto (newest checkpoint in out_dir) | none | a checkpoint path
    sample_prompt: str = "def "
    sample_tokens: int = 64
    wandb_mode: str = "disabled"  # disabled | offline | online
    wandb_project: str = "stacklm"

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = StackConfig(**self.model)
        self.betas = tuple(self.betas)
        self.validate()

    def validate(self):
        """Checks that need no hardware and no data. Each error names the field and the fix."""
        positive = ["seq_len", "micro_batch_size", "global_batch_tokens", "total_steps",
                    "stop_at_step", "log_every", "eval_every", "eval_tokens", "ckpt_every",
                    "keep_last_ckpts", "max_bad_steps", "adamw_peak_lr", "muon_peak_lr"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}; lower seq_len or raise max_seq_len")
        per_rank = self.micro_batch_size * self.seq_len
        if self.global_batch_tokens % per_rank:
            raise ValueError(f"global_batch_tokens={self.global_batch_tokens:,} is not a "
                             f"multiple of micro_batch_size*seq_len={self.micro_batch_size}*"
                             f"{self.seq_len}={per_rank:,}; use a multiple such as "
                             f"{max(1, round(self.global_batch_tokens / per_rank)) * per_rank:,}")
        if self.stop_at_step > self.total_steps:
            raise ValueError(f"stop_at_step={self.stop_at_step:,} is past total_steps="
                             f"{self.total_steps:,}; the schedule has no steps there")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be within [0, 1]")
        if not 0.0 <= self.final_frac <= 1.0:
            raise ValueError(f"final_frac={self.final_frac} must be within [0, 1]")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ValueError("weight_decay, grad_clip and warmup_steps must be >= 0")
        choices = {"decay_shape": ("linear", "sqrt", "cosine"),
                   "compile_model": ("auto", "true", "false"),
                   "mixed_precision": ("auto", "bf16", "no"),
                   "muon_adjust_lr": ("match_rms_adamw", "original"),
                   "matrix_optimizer": ("muon", "adamw"),
                   "wandb_mode": ("disabled", "offline", "online")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        checkpointing_every(self.activation_checkpointing)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step, derived so the global batch survives
        any change of GPU count. Refuses a global batch the ranks cannot split evenly."""
        per_step = self.micro_batch_size * self.seq_len * world_size
        if self.global_batch_tokens % per_step:
            fits = [m for m in range(1, self.micro_batch_size + 1)
                    if self.global_batch_tokens % (m * self.seq_len * world_size) == 0]
            nearest = max(1, round(self.global_batch_tokens / per_step)) * per_step
            fix = (f"use micro_batch_size={fits[-1]}" if fits
                   else f"use global_batch_tokens={nearest:,} or another number of ranks")
            raise ValueError(f"global_batch_tokens={self.global_batch_tokens:,} is not divisible "
                             f"by micro_batch_size*seq_len*world_size={self.micro_batch_size}*"
                             f"{self.seq_len}*{world_size}={per_step:,}; {fix}")
        return self.global_batch_tokens // per_step

    def batch_summary(self, world_size: int) -> str:
        """E.g. `524,288 tokens/step = 256 seqs x 2,048 = 32 micro x 8 accum x 1 rank`."""
        accum = self.grad_accum_steps(world_size)
        seqs = self.global_batch_tokens // self.seq_len
        ranks = "rank" if world_size == 1 else "ranks"
        return (f"{self.global_batch_tokens:,} tokens/step = {seqs:,} seqs × {self.seq_len:,} = "
                f"{self.micro_batch_size} micro × {accum} accum × {world_size} {ranks}")


def checkpointing_every(mode: str) -> int:
    """`none` -> 0, `full` -> 1, `every-N` -> N: checkpoint every N-th block's activations."""
    if mode == "none":
        return 0
    if mode == "full":
        return 1
    prefix, _, n = mode.partition("-")
    if prefix != "every" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"activation_checkpointing={mode!r} is not none, full or every-N "
                         f"(e.g. every-2 recomputes every second block)")
    return int(n)


def stack100m() -> TrainConfig:
    """The reference run: 524,288 tokens/step, stopped at the end of the stable phase."""
    return TrainConfig()


def tiny() -> TrainConfig:
    """A ~4M-parameter model that trains on 2 CPU cores in about eight minutes."""
    return TrainConfig(model=tiny_model(), data_dir="data/stdlib-4k", out_dir="out/tiny",
                       seq_len=256, micro_batch_size=16, global_batch_tokens=4096,
                       total_steps=300, stop_at_step=300, warmup_steps=30, decay_fraction=0.2,
                       log_every=10, eval_every=100, eval_tokens=65_536, ckpt_every=100,
                       keep_last_ckpts=2, sample_tokens=48)


PRESETS = {"stack100m": stack100m, "tiny": tiny}


# ---------------------------------------------------------------------------------------
# Overrides: TOML file, then `--key=value` flags, each typed from the dataclass field.
# ---------------------------------------------------------------------------------------

def _parse_value(text: str, kind, key: str):
    """Turn the text of `--key=value` into the field's type, or say what was expected."""
    if isinstance(kind, types.UnionType):  # `int | None`
        if text.lower() in ("none", "null", ""):
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key}={text!r}: expected true or false")
    if typing.get_origin(kind) is tuple:
        parts = text.strip("()[] ").split(",")
        return tuple(_parse_value(p.strip(), typing.get_args(kind)[0], key) for p in parts)
    try:
        if kind is int:
            return int(text.replace("_", "").replace(",", ""))
        return kind(text)
    except ValueError:
        raise ValueError(f"--{key}={text!r}: expected {kind.__name__}") from None


def _unknown_key(key: str, known: list[str]) -> ValueError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for every knob"
    return ValueError(f"unknown config key {key!r}{hint}")


def apply_overrides(cfg: TrainConfig, overrides: dict[str, typing.Any]) -> TrainConfig:
    """Return a new, validated config with `{"key": value, "model.key": value}` applied.
    Values may be strings (from the CLI) or already typed (from TOML)."""
    train_types, model_types = (typing.get_type_hints(TrainConfig),
                                 typing.get_type_hints(StackConfig))
    known = [k for k in train_types if k != "model"] + [f"model.{k}" for k in model_types]
    top, model = {}, {}
    for key, value in overrides.items():
        target, types_, name = (model, model_types, key[6:]) if key.startswith("model.") \
            else (top, train_types, key)
        if name not in types_ or name == "model":
            raise _unknown_key(key, known)
        target[name] = _parse_value(value, types_[name], key) if isinstance(value, str) \
            and types_[name] is not str else value
    new_model = dataclasses.replace(cfg.model, **model)
    return dataclasses.replace(cfg, model=new_model, **top)


def _flatten_toml(table: dict) -> dict:
    flat = {}
    for key, value in table.items():
        if key == "model" and isinstance(value, dict):
            flat.update({f"model.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _help_text() -> str:
    lines = ["knobs (defaults of the stack100m preset):"]
    for f in dataclasses.fields(TrainConfig):
        if f.name != "model":
            lines.append(f"  --{f.name}={getattr(TrainConfig(), f.name)}")
    for f in dataclasses.fields(StackConfig):
        lines.append(f"  --model.{f.name}={getattr(StackConfig(), f.name)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None, default_preset: str = "stack100m"):
    """CLI -> (TrainConfig, actions). Order of precedence: preset < TOML file < flags."""
    parser = argparse.ArgumentParser(
        description="Pretrain a Stack-100M-style decoder.", epilog=_help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help=f"starting point (default: {default_preset})")
    parser.add_argument("--config", metavar="RUN.TOML", help="TOML file of overrides")
    parser.add_argument("--export", action="store_true",
                        help="write out_dir/export/ from the newest checkpoint and exit")
    args, rest = parser.parse_known_args(argv)
    cfg = PRESETS[args.preset or default_preset]()
    overrides = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                overrides.update(_flatten_toml(tomllib.load(f)))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--config {args.config}: {e}") from None
    for item in rest:
        key, eq, value = item.removeprefix("--").partition("=")
        if not item.startswith("--") or not eq:
            raise ValueError(f"cannot read {item!r}: write overrides as --key=value")
        overrides[key.replace("-", "_")] = value
    return apply_overrides(cfg, overrides), args
