"""`tiny` on this CPU: fp32 and bf16, eager and compiled, beside nanoGPT's step at its shape,
and what each of stacklm's speed levers buys.

    python bench/cpu_speed.py                                # 30 timed steps, 2 rounds
    python bench/cpu_speed.py --steps 2 --warmup 1 --rounds 1 --no-compile \
        --micro_batch_size 2                                 # a smoke run
    python bench/cpu_speed.py --profile                      # and where each step's time goes
    python bench/cpu_speed.py --no-compile --precision fp32  # the levers where auto is fp32

Every variant trains from the same seed on the same batches (16 × 256 windows of the built-in
corpus, data/stdlib-4k) in this one process, in interleaved rounds, so drift on shared
cores hits each alike:
- stacklm: the `tiny` model and optimizers (train.build_model, optim.build_optimizers), one
  optimizer step as train_step takes it (forward with the sum of token losses, backward,
  clip, Muon and AdamW), under torch.autocast(bf16) for bf16 as accelerate wraps it and
  with Muon's Newton–Schulz in bf16 as build_optimizers sets it, and with each block compiled
  (train.build_model) for "compiled". bench/throughput.py measures
  that the whole loop keeps ≥ 0.95 of such a bare step.
- nanoGPT: Karpathy's GPT-2 model at the same shape (4 layers, 4 heads, width 256, 256
  positions, 4,096 tokens, no bias, no dropout; LayerNorm, a 4× GELU MLP, learned
  positions, the head tied to the embedding) and its train.py step: F.cross_entropy on the
  logits, backward, clip at 1.0, AdamW (foreach, betas 0.9/0.95, wd 0.1), in fp32 and bf16
  autocast, eager and torch.compile'd whole; "nanogpt_best" is its fastest.
- the levers: stacklm's eager step at the precision auto picks here (or --precision's:
  fp32 stands for a CPU without bf16 arithmetic), with one lever undone
  (the code it replaced, kept below as the plain expression it computes): "without_X".
  Each lever's "gain" is the full step's speed over that. "with_X" tries an alternative
  that was not taken, the same way.
tokens/s is the median over the timed steps (after `warmup`) of all rounds. "vs_nanogpt"
is each stacklm variant's speed over nanoGPT's at the same precision and compilation, and
"goal" those two ratios at auto's precision (bf16 where the CPU computes it, else fp32).
A compiled variant's cold start is its first step's seconds less an eager step's, and
"compile_pays_after_steps" is that cold start over the seconds compiling saves a step
(none where it saves nothing). "cpu_bf16" says whether this CPU computes bf16 in hardware
(launch.cpu_computes_bf16), without which bf16 is emulated. "first_loss" is each variant's
loss per target token on the first batch: about ln(4,096) = 8.318 for both models, whose
initial predictions are near uniform. With --profile, "profile" gives each variant's
largest ops (torch.profiler, self CPU time) as shares of its step. One JSON line.
"""

import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from plumbing import cli, launch, log  # noqa: E402


class GPT(nn.Module):
    """nanoGPT's model (Karpathy, model.py) at a given shape, bias and dropout off."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, positions: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT ties them
        for name, p in self.named_parameters():  # GPT-2's init, as nanoGPT's _init_weights
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.attn_proj = nn.Linear(width, width, bias=False)
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.c_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


def stacklm_step(cfg, compiled: bool, bf16: bool):
    """One optimizer step of `tiny`, as train_step takes it, on the batch it is given; the
    forward under bf16 autocast for bf16, as accelerate wraps a model's forward."""
    model = train.build_model(cfg, compiled)
    optimizers = optim.build_optimizers(model, cfg, "bf16" if bf16 else "no")
    optimizers.set_lr(1.0)  # the peak rates

    def step(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch, reduction="sum").loss / cfg.global_batch_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizers.step()
        optimizers.zero_grad()
        return loss.detach()
    return step


def nanogpt_step(cfg, compiled: bool, bf16: bool):
    """One step of nanoGPT's train.py at tiny's shape (one micro-batch a step, as tiny), its
    forward under bf16 autocast for bf16, as its `ctx` does."""
    torch.manual_seed(cfg.seed)
    m = cfg.model
    model = GPT(m.vocab_size, m.d_model, m.n_layers, m.n_heads, cfg.seq_len)
    forward = torch.compile(model) if compiled else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.adamw_peak_lr, betas=(0.9, 0.95), foreach=True)

    def step(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward(batch["input_ids"], batch["targets"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


VARIANTS = {  # name: (make a step, bf16, compiled)
    "stacklm_fp32_eager": (stacklm_step, False, False),
    "stacklm_fp32_compiled": (stacklm_step, False, True),
    "stacklm_bf16_eager": (stacklm_step, True, False),
    "stacklm_bf16_compiled": (stacklm_step, True, True),
    "nanogpt_fp32_eager": (nanogpt_step, False, False),
    "nanogpt_fp32_compiled": (nanogpt_step, False, True),
    "nanogpt_bf16_eager": (nanogpt_step, True, False),
    "nanogpt_bf16_compiled": (nanogpt_step, True, True),
}


# --- the levers: what each replaced, as the plain expression it computes ------------------

def whole_logits(self, hidden, targets, reduction):
    """Before plain_rows: the plain head's loss on all (N, V) logits at once."""
    with mock.patch.object(model, "PLAIN_ROWS", len(hidden)):
        return PLAIN_HEAD(self, hidden, targets, reduction)


def fp32_head(self, hidden, targets, reduction):
    """Before bf16_head: the plain head's matmul in fp32 whatever autocast says."""
    with torch.autocast(hidden.device.type, enabled=False):
        return PLAIN_HEAD(self, hidden.float(), targets, reduction)


PLAIN_HEAD = model.Transformer.plain_head


def separate_multiplies(G, steps=5, dtype=torch.float32):
    """Before ns_matmul_add: Newton–Schulz with its scalar multiplies and sums as ops of their
    own around the matmuls."""
    a, b, c = optim.NS_COEFFICIENTS
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = X @ X.mT
        X = a * X + (b * gram + c * gram @ gram) @ X
    return (X.mT if tall else X).to(G.dtype)


def one_by_one(self, updates, group):
    """Before ns_stacked: on a CPU, Newton–Schulz matrix by matrix."""
    return [self._orthogonalize(update, group) for update in updates]


def torch_rms_norm(self, x):
    """An alternative not taken: torch's own F.rms_norm (on a CPU its eager kernel is made of
    the same ops)."""
    return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


LEVERS = {  # name: what undoes it
    "plain_rows": lambda: mock.patch.object(model.Transformer, "plain_head", whole_logits),
    "bf16_head": lambda: mock.patch.object(model.Transformer, "plain_head", fp32_head),
    "ns_matmul_add": lambda: mock.patch.object(optim, "newton_schulz", separate_multiplies),
    "ns_stacked": lambda: mock.patch.object(optim.Muon, "_orthogonalize_bucket", one_by_one),
}
ALTERNATIVES = {"torch_rms_norm": lambda: mock.patch.object(model.RMSNorm, "forward",
                                                            torch_rms_norm)}


def timed_steps(make, bf16: bool, compiled: bool, cfg, batches: list, patched=None):
    """Seconds of each step, the first (compilation included) first, and the first loss;
    `patched` (a context manager) is in force while the step is made and run."""
    with patched or contextlib.nullcontext():
        step = make(cfg, compiled, bf16)
        seconds, losses = [], []
        for batch in batches:
            t0 = time.perf_counter()
            losses.append(float(step(batch)))  # the loop reads its loss every step
            seconds.append(time.perf_counter() - t0)
    return seconds, losses[0]


def profiled(make, bf16: bool, compiled: bool, cfg, batches: list, top: int = 8) -> list:
    """[op, share of the step's self CPU time] of the `top` largest ops of one step, after
    two untimed ones."""
    from torch.profiler import profile
    step = make(cfg, compiled, bf16)
    for batch in batches[:2]:
        step(batch)
    with profile() as prof:
        step(batches[2])
    ops = sorted(prof.key_averages(), key=lambda op: -op.self_cpu_time_total)
    total = sum(op.self_cpu_time_total for op in ops)
    return [[op.key, round(op.self_cpu_time_total / total, 3)] for op in ops[:top]]


def variants(args, precision: str) -> dict:
    """name -> (make, bf16, compiled, patched or None) for this run's flags."""
    chosen = {n: (*v, None) for n, v in VARIANTS.items() if not (v[2] and args.no_compile)}
    if not args.no_levers:
        base = (stacklm_step, precision == "bf16", False)
        chosen |= {f"stacklm_{precision}_eager_without_{n}": (*base, undo())
                   for n, undo in LEVERS.items()}
        chosen |= {f"stacklm_{precision}_eager_with_{n}": (*base, alternative())
                   for n, alternative in ALTERNATIVES.items()}
    return chosen


def main():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=cli.at_least(1), default=30,
                        help="timed steps per variant")
    parser.add_argument("--warmup", type=cli.at_least(0), default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=cli.at_least(1), default=2, help="interleaved rounds")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    parser.add_argument("--no-levers", action="store_true", help="no lever variants")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each of the eight base variants")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="the precision of the lever variants and the goal (auto: bf16 "
                             "where this CPU computes it, as the run's auto; fp32 stands for "
                             "a CPU without bf16 arithmetic)")
    parser.add_argument("--micro_batch_size", type=cli.at_least(1), default=16,
                        help="windows of 256 tokens a step (tiny's 16; fewer for a smoke run, "
                             "where a CPU without bf16 arithmetic emulates the bf16 variants)")
    args = parser.parse_args()
    cfg = dataclasses.replace(config.tiny(), micro_batch_size=args.micro_batch_size,
                              global_batch_tokens=args.micro_batch_size * config.tiny().seq_len)
    prepare.ensure_builtin([cfg.data_dir], cfg.model.vocab_size)
    loader = data.PackedShardLoader(cfg.data_dir, "train", cfg.seq_len, cfg.micro_batch_size,
                                    seed=cfg.seed)
    batches = [next(loader) for _ in range(max(args.warmup + args.steps, 3))]  # (16, 256)
    auto = "bf16" if launch.cpu_computes_bf16() else "fp32"  # auto's choice here
    precision = auto if args.precision == "auto" else args.precision
    chosen = variants(args, precision)
    seconds, first_loss = {name: [] for name in chosen}, {}
    for _ in range(args.rounds):
        for name, (make, bf16, compiled, patched) in chosen.items():
            run_seconds, first_loss[name] = timed_steps(make, bf16, compiled, cfg,
                                                        batches[:args.warmup + args.steps],
                                                        patched)
            seconds[name].append(run_seconds)
    tokens = cfg.global_batch_tokens
    step_s = {n: statistics.median(s for run in seconds[n] for s in run[args.warmup:])
              for n in chosen}
    result = {"bench": "cpu_speed", "device": log.device_name(torch.device("cpu")),
              "steps": args.steps,
              "rounds": args.rounds, "cpu_bf16": launch.cpu_computes_bf16(),
              "tokens_per_s": {n: round(tokens / s, 1) for n, s in step_s.items()},
              "first_loss": {n: round(loss, 4) for n, loss in first_loss.items()}}
    base = [n for n in step_s if n in VARIANTS]
    nanogpt = {n: result["tokens_per_s"][n] for n in base if n.startswith("nanogpt")}
    best = max(nanogpt, key=nanogpt.get)
    result["nanogpt_best"] = {"variant": best, "tokens_per_s": nanogpt[best]}
    result["vs_fp32_eager"] = {n: round(step_s["stacklm_fp32_eager"] / step_s[n], 3)
                               for n in base if n.startswith("stacklm")}
    result["vs_nanogpt_best"] = {n: round(step_s[best] / step_s[n], 3)
                                 for n in base if n.startswith("stacklm")}
    result["vs_nanogpt"] = {n: round(step_s[n.replace("stacklm", "nanogpt")] / step_s[n], 3)
                            for n in base if n.startswith("stacklm")}
    result["goal"] = {"precision": precision, **{
        mode: result["vs_nanogpt"].get(f"stacklm_{precision}_{mode}")
        for mode in ("eager", "compiled")}}
    full = step_s[f"stacklm_{precision}_eager"]
    result["levers"] = {n.split("_without_")[1]: round(step_s[n] / full, 3)
                        for n in step_s if "_without_" in n}
    result["alternatives"] = {n.split("_with_")[1]: round(step_s[n] / full, 3)
                              for n in step_s if "_with_" in n}
    result["compile"] = {}
    for compiled in (n for n in base if n.endswith("_compiled")):
        eager = compiled.replace("_compiled", "_eager")
        cold = seconds[compiled][0][0] - step_s[eager]  # the first round's: a cold cache
        saved = step_s[eager] - step_s[compiled]
        result["compile"][compiled] = {
            "cold_start_s": round(cold, 1),
            "pays_after_steps": math.ceil(cold / saved) if saved > 0 else None}
    if args.profile:
        result["profile"] = {n: profiled(*VARIANTS[n], cfg, batches) for n in base}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
