"""What a run tells its user as it trains: the start-up banner, the memory estimate, and
one log line per log step (loss, gradient norm, learning rates, tokens/s, TFLOP/s, MFU,
memory, ETA) to the terminal, metrics.jsonl and Weights & Biases; and, at every checkpoint
and as the run ends, the run report, which report.py draws from metrics.jsonl in a process
of its own.

metrics.jsonl is the run's record: one JSON object per line, each with a `kind` and a
`step`. `start` (what each start of the run was: config, preset, code, hardware, data plan,
schedule, what a resume changed), `train` (a log line), `eval`, `skip` (an update skipped
for a non-finite loss or gradient norm), `checkpoint`, `sample` (the end-of-run sample)
and `end` (how this start ended: finished, stopped, or the error). A restart appends to
it; a step logged twice (redone after a crash) counts once, its last record, when
report.py reads it back.

The losses, gradient norm, counts and evaluations the logger gets are global (reduced across
ranks by the loop); memory and times are rank 0's own; only the main process writes.

Imports from stacklm: config (the nearest preset and the schedule's phases, for the start
record) and model (the parameter and FLOP counts of a config, for the memory check before
the model is built and for MFU). Otherwise it takes plain numbers and the run's objects, and
starts report.py as a command.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

import config
from model import count_matmul_params, count_params, flops_per_token

# Dense bf16 tensor-core peak per GPU (vendor datasheets, no sparsity), by the exact name
# CUDA reports (torch.cuda.get_device_name): a name that merely contains one of these is
# another card ("NVIDIA L40" is neither the L4 nor the L40S). MFU is reported against
# these; any other device, and CPUs, show MFU as n/a rather than a made-up number.
PEAK_FLOPS = {
    "NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA GH200 480GB": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12, "NVIDIA L4": 121e12, "NVIDIA A10G": 70e12,
    "NVIDIA GeForce RTX 4090": 165e12,
}


def model_flops(cfg) -> dict[str, float]:
    """Training FLOP per token in both conventions ("causal", "palm"), for TFLOP/s and MFU."""
    return {c: flops_per_token(cfg.model, cfg.seq_len, c) for c in ("causal", "palm")}


def code_revision(root=Path(__file__).resolve().parent.parent) -> str:
    """The git commit of the code that runs (the repository this package sits in), `-dirty`
    appended if tracked files changed since; "unknown" outside a git checkout of its own (a
    copied tree) or without git."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return "unknown"  # a copy that sits inside some other repository
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def peak_flops(device_name: str) -> float | None:
    """Peak FLOP/s of the device of exactly this name, or None."""
    return PEAK_FLOPS.get(device_name)


# ---------------------------------------------------------------------------------------
# Start-up: the banner and the memory estimate
# ---------------------------------------------------------------------------------------

# Bytes saved for backward per token per block, per unit of d_model, for Stack-shaped
# blocks (intermediate = 2.75·d_model, 4 query heads per kv head), as counted on d_model=512
# blocks by tests/test_log.py (the storages a forward leaves alive for backward): all of a
# block's activations ("none"), and what activation_recompute=selective keeps (the outputs
# of attention and of every other matmul, model.selective_recompute). bf16 autocast keeps
# each norm's fp32 input and normalised value (autograd's RMSNorm): not half of fp32.
# Keys: bf16 yes/no.
ACTIVATION_BYTES_PER_D = {"none": {True: 64, False: 89}, "selective": {True: 16, False: 28}}


def memory_estimate(cfg, n_params: int, n_muon: int, world: int, sharded: bool,
                    bf16: bool) -> dict[str, float]:
    """A start-up estimate of peak memory per rank, in GiB, to set beside the measured peak
    in the log. fp32 master weights and gradients (4 bytes each), Muon's momentum (4) and
    AdamW's two moments (8), divided by the rank count under FSDP2; the activations each
    block keeps for backward (all of them; what selective recomputation keeps; or only its
    input, where recomputed in full), and one block's whole activations while it is
    recomputed, one at a time; and the loss head's peak (`loss_head_bytes`)."""
    m = cfg.model
    shard = world if sharded else 1
    tokens = cfg.micro_batch_size * cfg.seq_len
    kept = {mode: tokens * per_d[bf16] * m.d_model
            for mode, per_d in ACTIVATION_BYTES_PER_D.items()}
    kept["full"] = tokens * m.d_model * (2 if bf16 else 4)  # the block's input
    modes = [cfg.block_recompute(layer) for layer in range(m.n_layers)]
    activations = sum(kept[mode] for mode in modes)
    if set(modes) != {"none"}:
        activations += kept["none"]
    gib = 2**30
    budget = {"weights+grads": 8 * n_params / shard / gib,
              "optimizer": (4 * n_muon + 8 * (n_params - n_muon)) / shard / gib,
              "activations": activations / gib,
              "loss_head": loss_head_bytes(cfg, bf16) / gib}
    budget["total"] = sum(budget.values())
    return budget


def loss_head_bytes(cfg, bf16: bool) -> int:
    """The loss head's peak, model.py's plain head or loss.py's chunked one, of rows × V
    numbers each. The plain head (ce_chunk_size 0) holds all B·T rows of logits, in bf16 or
    fp32 as the forward runs, beside the fp32 log-probabilities its loss keeps for backward;
    backward then holds the same bytes in gradients. The chunked head holds one chunk's fp32
    buffer (logits, then softmax, then their gradient), and with loss_head_dtype=bf16 that
    gradient's bf16 copy too."""
    m = cfg.model
    tokens = cfg.micro_batch_size * cfg.seq_len
    if not m.ce_chunk_size:
        return tokens * m.vocab_size * ((2 if bf16 else 4) + 4)
    per_number = 4 + (2 if cfg.loss_head_dtype == "bf16" else 0)
    return min(m.ce_chunk_size, tokens) * m.vocab_size * per_number


def check_memory(cfg, accelerator, sharded: bool, force: bool) -> list[str]:
    """Before any work: the memory estimate of this plan, from the parameters the config
    counts (nothing is built yet), against what one rank has. Past a CPU's RAM (shared by the
    ranks on the machine) the run is refused, naming a micro-batch that fits, unless `force`;
    past a GPU's memory it gets a warning line (the estimate is a rough one, and the largest
    term, the activations, may be what the run needs or not)."""
    world, device = accelerator.num_processes, accelerator.device
    bf16 = accelerator.mixed_precision == "bf16"
    capacity, where = memory_capacity(device)

    def estimate(micro_batch_size: int) -> float:
        plan = dataclasses.replace(cfg, micro_batch_size=micro_batch_size)
        return memory_estimate(plan, *planned_params(cfg), world, sharded, bf16)["total"]
    need = estimate(cfg.micro_batch_size)
    if need <= capacity:
        return []
    # The largest smaller micro-batch that still splits the global batch evenly and leaves a
    # tenth of the memory to what the estimate leaves out (the runtime, the allocator).
    fits = next((m for m in range(cfg.micro_batch_size - 1, 0, -1)
                 if cfg.global_batch_tokens % (m * cfg.seq_len * world) == 0
                 and estimate(m) <= 0.9 * capacity), None)
    fix = (f"--micro_batch_size={fits} (estimate {estimate(fits):.1f} GiB: the same global "
           f"batch, in more accumulation steps), or " if fits else "") + "--preset tiny"
    problem = f"the memory estimate is {need:.1f} GiB per rank, more than {where}"
    if device.type != "cpu":  # a GPU that runs out says so; a CPU that does swaps or is killed
        return [f"warning: {problem}; if it runs out of memory, use {fix} (docs/scale.md: Memory)"]
    if force:
        return [f"warning: {problem}; starting anyway (--force)"]
    raise ValueError(f"{problem}: it would run out of memory; use {fix}, or pass --force to "
                     f"start anyway")


def planned_params(cfg) -> tuple[int, int]:
    """(parameters, those in Muon) of cfg's model, counted from its shape as the built model
    and optimizers would hold them: the tied embedding once; Muon takes the hidden matrices,
    every matmul weight but the embedding (none where matrix_optimizer is adamw)."""
    m = cfg.model
    hidden = count_matmul_params(m) - m.vocab_size * m.d_model
    return count_params(m), hidden if cfg.matrix_optimizer == "muon" else 0


def memory_capacity(device: torch.device) -> tuple[float, str]:
    """The GiB one rank has, and what they are, for messages: the GPU's memory, or the
    machine's RAM over the ranks a launcher started on it (LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        gib = properties.total_memory / 2**30
        return gib, f"this GPU's {gib:.1f} GiB ({properties.name})"
    if device.type == "mps":  # memory shared with the CPU: what Metal lets the GPU's work hold
        gib = torch.mps.recommended_max_memory() / 2**30
        return gib, f"this Apple GPU's {gib:.1f} GiB (Metal's recommended working set)"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ram = psutil.virtual_memory().total / 2**30
    shared = f", shared by {ranks} ranks" if ranks > 1 else ""
    return ram / ranks, f"this machine's {ram:.1f} GiB of RAM{shared}"


@dataclasses.dataclass
class Hardware:
    """Where a run trains, as the banner prints it and metrics.jsonl records it."""
    world: int  # ranks
    device: str  # e.g. "cuda:0" or "cpu"
    distributed: str  # accelerate's DistributedType value (NO, MULTI_GPU, MULTI_CPU) or FSDP2
    precision: str  # "bf16" or "no"
    compiled: bool
    device_name: str = ""  # e.g. "NVIDIA H200", or the CPU's model and core count
    torch: str = torch.__version__
    precision_why: str = ""  # e.g. "auto: this CPU computes bf16 natively" (launch.mixed_precision)
    compile_why: str = ""  # e.g. "auto: a GPU" (launch.use_compile)


def hardware(accelerator, sharded: bool, compiled: tuple[bool, str],
             precision_why: str) -> Hardware:
    """The Hardware an accelerate.Accelerator runs on; FSDP2 where train.py sharded the model
    (accelerate's own distributed type says MULTI_CPU there on a CPU). `compiled` and
    `precision_why` are launch.use_compile's and launch.mixed_precision's choices and reasons."""
    distributed = "FSDP2" if sharded else accelerator.distributed_type.value
    return Hardware(accelerator.num_processes, str(accelerator.device), distributed,
                    accelerator.mixed_precision, compiled[0], device_name(accelerator.device),
                    precision_why=precision_why, compile_why=compiled[1])


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model (from /proc/cpuinfo where there is one) and the
    cores this process may use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (MPS)"
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "CPU"
    return f"{model}, {os.cpu_count()} cores"


# What the log's mem column measures, as the banner says beside its estimate.
MEM_COLUMN = {"cuda": "the log's mem column is the measured peak of allocated tensors",
              "cpu": "on a CPU the log's mem column is the process's peak resident memory, "
                     "the Python runtime and libraries included: not comparable to this",
              "mps": "on an Apple GPU the log's mem column is what Metal holds for this process "
                     "at the log line (it keeps no peak)"}


@dataclasses.dataclass
class RunFacts:
    """What one start of the run is, beside its config: the banner prints it and the `start`
    record of metrics.jsonl keeps it, so that report.py can describe the whole run from
    out_dir alone (old checkpoints are pruned)."""
    hardware: Hardware
    revision: str  # the git revision of the code that runs (code_revision)
    data_plan: list[dict]  # config.data_plan's rows: each stage's sources, tokens and epochs
    eval_sources: dict[str, float]  # the sources with a val split and their shares of val_loss
    val_windows: dict[str, int]  # the windows of seq_len in each evaluated source's val split
    tasks: dict[str, dict] = dataclasses.field(default_factory=dict)  # downstream.describe's
    resumed_from: str | None = None  # the checkpoint this start continues
    resume_changes: list = dataclasses.field(default_factory=list)  # (knob, old, new)


def start_record(cfg, facts: RunFacts, step: int, tokens_seen: int) -> dict:
    """metrics.jsonl's `start` record: where this start begins, the config and how it differs
    from its nearest preset, the code, the hardware, the data plan, the schedule's phases,
    and what a resume continued and changed."""
    preset, preset_changes = config.nearest_preset(cfg)
    return {"step": step, "tokens_seen": tokens_seen,
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "preset": preset, "preset_changes": preset_changes,
            "config": dataclasses.asdict(cfg), "revision": facts.revision,
            "hardware": dataclasses.asdict(facts.hardware), "plan": facts.data_plan,
            "phases": config.wsd_phases(cfg)._asdict(),
            "resumed_from": facts.resumed_from, "resume_changes": facts.resume_changes}


def banner(cfg, facts: RunFacts, model, optimizers, schedule: str,
           flops: dict[str, float]) -> str:
    """Everything a practitioner checks before trusting a run, with units.

    `optimizers` is optim.Optimizers (its summary() is one line with a part per group, read
    before accelerate.prepare wraps them); `schedule` optim.schedule_summary's line; `flops` the
    FLOP/token of both conventions ("causal", "palm")."""
    hardware = facts.hardware
    n_params = sum(p.numel() for p in model.parameters())
    muon = optimizers.named.get("muon")
    n_muon = sum(p.numel() for g in muon.param_groups for p in g["params"]) if muon else 0
    budget = memory_estimate(cfg, n_params, n_muon, hardware.world,
                             hardware.distributed == "FSDP2", hardware.precision == "bf16")
    unevaluated = [row["source"] for row in facts.data_plan
                   if row["source"] not in facts.eval_sources]
    lines = [
        f"model: {n_params / 1e6:.2f}M parameters ({optimizers.summary()})",
        *([f"model shape: {init_from_shape(cfg)}"] if cfg.init_from else []),
        f"FLOP/token: {flops['causal']:.3e} causal, {flops['palm']:.3e} palm "
        f"(seq {cfg.seq_len:,})",
        f"batch: {cfg.batch_summary(hardware.world)}",
        f"schedule: {schedule}; this run stops at step {cfg.stop_at_step:,} of "
        f"{cfg.total_steps:,}",
        *(f"data from step {row['start']:,}: {row['source']} × {row['weight']:.3g}, "
          f"{row['available']:,} train tokens/epoch; this run reads {row['planned']:,} tokens "
          f"= {row['planned'] / row['available']:.2f} epochs" for row in facts.data_plan),
        *([f"val: {', '.join(dict.fromkeys(unevaluated))} has no val split: trained on, "
           f"not evaluated; val_loss is the mean of "
           + ", ".join(f"{d} × {w:.3g}" for d, w in facts.eval_sources.items())]
          if unevaluated else []),
        *eval_coverage(cfg, facts.val_windows),
        *([downstream_coverage(cfg, facts.tasks)] if facts.tasks else []),
        f"hardware: {hardware.world} × {hardware.device} ({hardware.distributed}), "
        f"precision {hardware.precision} ({hardware.precision_why}; mixed_precision="
        f"{cfg.mixed_precision} wins over a launch config's), compile {hardware.compiled} "
        f"({hardware.compile_why}), activation recompute {cfg.activation_recompute}",
        f"code: {facts.revision}",
        "memory estimate per rank: " + " + ".join(
            f"{k} {v:.2f}" for k, v in budget.items() if k != "total")
        + f" = {budget['total']:.2f} GiB ({MEM_COLUMN[hardware.device.split(':')[0]]})",
        "loss: cross-entropy + z-loss in nats per target token; val_loss is the cross-entropy "
        "alone; val_bpb is bits per byte of the target text",
    ]
    return "\n".join(lines)


def init_from_shape(cfg) -> str:
    """The shape --init_from's config.json set, as the banner prints it."""
    m = cfg.model
    rope = f"no RoPE every {m.nope_every} layers" if m.nope_every else "RoPE on every layer"
    return (f"{cfg.init_from}/config.json's: d_model {m.d_model}, {m.n_layers} layers, "
            f"{m.n_heads} heads of {m.head_size} ({m.n_kv_heads} KV), MLP {m.intermediate}, "
            f"vocab {m.vocab_size:,}, {'QK-norm' if m.qk_norm else 'no QK-norm'}, {rope} "
            f"(theta {m.rope_theta:g}), norm eps {m.norm_eps:g}")


# An evaluation whose forward passes cost more than half the training compute between
# evaluations takes over a third of the run (tiny, which reads all of val, on a corpus of
# billions of tokens, say): warned about, not refused.
EVAL_SHARE_WARNED = 0.5


def forward_share(cfg, forward_tokens: int, every: int) -> float:
    """What `forward_tokens` forward tokens cost every `every` steps, as a share of the
    training compute between them: a forward is a third of a trained token (2 of the 6
    FLOPs per parameter: model.flops_per_token)."""
    return forward_tokens / 3 / (every * cfg.global_batch_tokens)


def eval_coverage(cfg, val_windows: dict[str, int]) -> list[str]:
    """What each evaluation reads, e.g. `eval every 100 steps: all of data/stdlib-4k's val
    (262 windows of 256 tokens); 67,072 val tokens per evaluation`, and a warning where it
    costs more than EVAL_SHARE_WARNED of the training between evaluations."""
    parts, tokens = [], 0
    for source, total in val_windows.items():
        n = config.eval_windows(cfg, total)
        tokens += n * cfg.seq_len
        parts.append(f"all of {source}'s val ({total:,} windows of {cfg.seq_len:,} tokens)"
                     if n == total else f"{n:,} of {source}'s {total:,} val windows "
                                        f"({n / total:.1%})")
    lines = [f"eval every {cfg.eval_every:,} steps: {'; '.join(parts)}; {tokens:,} val tokens "
             f"per evaluation"]
    share = forward_share(cfg, tokens, cfg.eval_every)
    if share > EVAL_SHARE_WARNED:
        lines.append(f"warning: an evaluation costs ~{share:.0%} of the training compute "
                     f"between evaluations; set eval_tokens (val tokens per source; now "
                     f"{cfg.eval_tokens or 'none: all of val'}) or a larger eval_every")
    return lines


def downstream_coverage(cfg, tasks: dict[str, dict]) -> str:
    """Where each task's items come from, what each scoring costs and what chance is, e.g.
    `downstream every 100 steps: nextline 100 items from data/stdlib-4k's val documents
    (chance 0.250); 102,400 forward tokens per scoring, ~8.3% of the training compute
    between scorings` (forward_share)."""
    every = cfg.downstream_every or cfg.eval_every
    parts = [f"{name} {task['items']:,} items from {task['from']} (chance {task['chance']:.3f})"
             for name, task in tasks.items()]
    tokens = sum(task["forward_tokens"] for task in tasks.values())
    return (f"downstream every {every:,} steps: {'; '.join(parts)}; {tokens:,} forward tokens "
            f"per scoring, ~{forward_share(cfg, tokens, every):.1%} of the training compute "
            f"between scorings")


# ---------------------------------------------------------------------------------------
# The log: terminal, metrics.jsonl, wandb
# ---------------------------------------------------------------------------------------

# report.py, which the logger runs as a command: in a process of its own, drawing never
# holds up training, and a fault in it can never stop a run.
REPORT_SCRIPT = Path(__file__).resolve().parent.parent / "report.py"
# A run that ends any other way than finishing (a SIGTERM or Ctrl-C stop, an error) waits
# this long for its report, then leaves it to `python report.py`: the launcher's shutdown
# timeout is 30 s, and the step in flight and the checkpoint come first.
STOP_REPORT_WAIT_S = 10.0


class ReportProcess:
    """report.py drawing out_dir's report in a process of its own, one at a time: while one
    draws, a checkpoint starts none. `say` prints a line above the progress bar."""

    def __init__(self, out_dir: str, say):
        self.out_dir, self.say, self.process = out_dir, say, None

    def draw(self, final: bool):
        """A checkpoint's report runs --quiet; the final one prints where the report is
        (and, for the `tiny` preset, how the run compares with the reference seeds)."""
        if self.drawing():
            return
        command = [sys.executable, str(REPORT_SCRIPT), self.out_dir,
                   *([] if final else ["--quiet"])]
        # A session of its own: a Ctrl-C at the terminal reaches the run, not the drawing.
        self.process = subprocess.Popen(command, start_new_session=True)

    def drawing(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def final(self, deadline: float | None):
        """The report of the whole run, after the end record: let a checkpoint's report that
        still draws finish, then draw once more, and wait."""
        if self.wait(deadline):
            self.draw(final=True)
            self.wait(deadline)

    def wait(self, deadline: float | None) -> bool:
        """Wait for report.py until `deadline` (time.monotonic(); None: no limit). Past it,
        the run goes on to exit, the drawing finishes on its own, and this returns False."""
        if self.process is None:
            return True
        try:
            code = self.process.wait(None if deadline is None
                                     else max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.say(f"report: still drawing {STOP_REPORT_WAIT_S:g} s after the stop; it "
                     f"finishes in the background (`python report.py {self.out_dir}` draws "
                     f"it again)")
            return False
        if code:  # report.py printed its error above
            self.say(f"report: not written (report.py exited {code}); the run is unaffected: "
                     f"`python report.py {self.out_dir}` draws it")
        return True


class MetricsLogger:
    """One line per log step to the terminal, metrics.jsonl and wandb, from the main process
    only. A tqdm progress bar sits under the lines when stderr is a terminal; redirected to
    a file or a scheduler's log, there is no bar and every line is a plain line.

    At each checkpoint it has report.py redraw the run report in the background, and on
    leaving the `with` block it records how this start ended and draws the report once
    more, waiting for it, so that report.md and report.png are complete when the command
    exits; except after a second Ctrl-C (KeyboardInterrupt), which asks to quit now."""

    def __init__(self, cfg, is_main: bool, device: torch.device, world: int,
                 flops: dict[str, float], start_step: int):
        self.cfg, self.main, self.device, self.world = cfg, is_main, device, world
        self.flops = flops
        cuda = device.type == "cuda"
        self.peak = peak_flops(torch.cuda.get_device_name(device) if cuda else "cpu")
        self.opened = time.perf_counter()  # when this start's logging began
        self.last_step, self.last_seconds = start_step, 0.0
        self.step = start_step  # the newest step recorded
        self.report = ReportProcess(cfg.out_dir, self.print) \
            if is_main and cfg.write_report else None
        self.bar = tqdm(total=cfg.stop_at_step, initial=start_step, dynamic_ncols=True,
                        desc="train", disable=not (is_main and sys.stderr.isatty()))
        self.jsonl = self.wandb = self.tensorboard = None
        if self.main:
            path = Path(cfg.out_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            cut = last_byte(path) not in (b"", b"\n")
            self.jsonl = open(path, "a", encoding="utf-8")
            # A line a kill -9 cut short gets its newline, so it stays one bad line that
            # report.py skips, never glued to the first record of this start.
            if cut:
                self.jsonl.write("\n")
            if cfg.wandb_mode != "disabled":
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode,
                                        dir=cfg.out_dir, config=dataclasses.asdict(cfg))
            if cfg.tensorboard:
                self.tensorboard = tensorboard_writer(cfg.out_dir, start_step)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.bar.close()
        if not self.main:
            return
        finished = exc is None and self.step >= self.cfg.stop_at_step
        outcome = "finished" if finished else "stopped" if exc is None else "error"
        self.write({"kind": "end", "step": self.step, "outcome": outcome,
                    "error": None if exc is None else f"{exc_type.__name__}: {exc}",
                    "elapsed_s": time.perf_counter() - self.opened})
        self.jsonl.close()
        if self.report is not None and exc_type is not KeyboardInterrupt:
            self.report.final(None if finished else time.monotonic() + STOP_REPORT_WAIT_S)
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def print(self, line: str):
        if self.main:  # tqdm.write prints above the bar, and plainly when there is none
            self.bar.write(line)

    def write(self, record: dict):
        """One JSON object per line. NaN and inf (a skipped step's loss) are not JSON: they
        are written as null, so every line parses with any JSON reader."""
        record = {k: v if not isinstance(v, float) or math.isfinite(v) else None
                  for k, v in record.items()}
        self.step = max(self.step, record["step"])
        if self.main:
            self.jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self.jsonl.flush()
            if self.wandb is not None and record["kind"] in ("train", "eval", "skip"):
                self.wandb.log({k: v for k, v in record.items() if k != "kind"},
                               step=record["step"])
            if self.tensorboard is not None and record["kind"] in ("train", "eval"):
                for key, value in scalars(record).items():
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def log_start(self, record: dict):
        """What this start of the run is (start_record), before its first line."""
        self.write({"kind": "start", **record})

    def log_checkpoints(self, saved: list[tuple[int, float, float]]):
        """Checkpoints now complete, (step, seconds the loop waited for it, seconds its save
        took in all: more, when written in the background): record each, and redraw the
        report."""
        for step, seconds, write_seconds in saved:
            self.write({"kind": "checkpoint", "step": step, "seconds": seconds,
                        "write_seconds": write_seconds})
        if saved and self.report is not None:
            self.report.draw(final=False)

    def log_sample(self, step: int, prompt: str, text: str):
        self.print(f"sample ({prompt!r} →):\n{text}")
        self.write({"kind": "sample", "step": step, "prompt": prompt, "text": text})

    def log_train(self, run, result, train_seconds: float) -> dict:
        """The step `run` (train.Run) has reached, with `result` (train.StepResult), and the
        data epochs begun since the last line. Throughput over the steps since the last line,
        on training time only (`train_seconds`: evaluation and checkpoints excluded). TFLOP/s
        and MFU follow from tokens/s by construction: tflops = flops_per_token × tokens/s and
        mfu = tflops / (peak × ranks)."""
        step, lrs = run.step, run.optimizers.lrs()
        steps = step - self.last_step
        seconds = max(train_seconds - self.last_seconds, 1e-9)
        tokens_per_s = steps * self.cfg.global_batch_tokens / seconds
        tflops = self.flops["causal"] * tokens_per_s / 1e12
        tflops_palm = self.flops["palm"] * tokens_per_s / 1e12
        peak_tflops = self.peak * self.world / 1e12 if self.peak else None
        record = {
            "kind": "train", "step": step,
            "loss": result.loss, "ce": result.ce, "z": result.z,
            "grad_norm": result.grad_norm, **{f"lr_{k}": v for k, v in lrs.items()},
            "tokens_seen": run.tokens_seen,  # and below, the tokens read from each source
            **{f"tokens/{source}": tokens for source, tokens in run.loader.tokens_read().items()},
            "tokens_per_s": tokens_per_s, "tflops": tflops, "tflops_palm": tflops_palm,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "mfu_palm": tflops_palm / peak_tflops if peak_tflops else None,
            "memory_gib": memory_gib(self.device), "skipped_steps": run.skipped_steps,
            "elapsed_s": time.perf_counter() - self.opened,
            "eta_s": (self.cfg.stop_at_step - step) * seconds / steps,
        }
        self.last_step, self.last_seconds = step, train_seconds
        self.print(train_line(record, lrs, peak_tflops is not None))
        self.bar.update(steps)
        self.write(record)
        self.log_epochs(run.loader.take_new_epochs())
        return record

    def log_eval(self, step: int, tokens_seen: int, metrics: dict) -> dict:
        """The mixture's val loss and bits per byte, then each source's when there are
        several (`val_loss/<source>`), then each downstream task's acc and acc_norm against
        chance when it was scored. The mixture's value weights the sources by the first
        stage's shares for the whole run, so it stays comparable across a stage switch.
        Returns `metrics`."""
        sources = [k.split("/", 1)[1] for k in metrics if k.startswith("val_loss/")]
        line = (f"eval {step:>6,} | val_loss {metrics['val_loss']:.4f} | "
                f"val_bpb {metrics['val_bpb']:.4f}")
        if len(sources) > 1:
            line += " (the mixture, at fixed shares) | " + " | ".join(
                f"{name} {metrics[f'val_loss/{name}']:.4f}" for name in sources)
        for task in (k.split("/", 1)[1] for k in metrics if k.startswith("acc/")):
            line += (f" | {task} acc {metrics[f'acc/{task}']:.3f} acc_norm "
                     f"{metrics[f'acc_norm/{task}']:.3f} (chance {metrics[f'chance/{task}']:.3f})")
        self.print(line)
        self.write({"kind": "eval", "step": step, "tokens_seen": tokens_seen, **metrics})
        return metrics

    def log_epochs(self, epochs: dict[str, list[int]]):
        """One line per source for the epochs of its train split begun since the last log
        line: a small corpus can pass several in one interval (`data: train epochs 3–9 of
        data/x began`)."""
        for source, begun in epochs.items():
            if begun:
                which = f"s {begun[0]}–{begun[-1]}" if len(begun) > 1 else f" {begun[0]}"
                self.print(f"data: train epoch{which} of {source} began")

    def log_skipped(self, step: int, loss: float, grad_norm: float, skipped_steps: int):
        """A step whose update was skipped; `step` is numbered as the training rows are."""
        self.print(f"step {step:>6,} | non-finite loss {loss} or grad norm {grad_norm}: "
                   f"update skipped ({skipped_steps} skipped so far)")
        self.write({"kind": "skip", "step": step, "loss": loss, "grad_norm": grad_norm})


def check_tensorboard(out_dir: str):
    """--tensorboard=true needs the tensorboard package, which stacklm does not require, and
    out_dir/tb to be a folder (or absent)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("--tensorboard=true needs the tensorboard package: pip install "
                         "tensorboard (or drop the flag)") from None
    root = tensorboard_root(out_dir)
    if root.exists() and not root.is_dir():  # the user's: kept, and refused before any work
        raise ValueError(f"{root} is a file, where --tensorboard=true writes its folders; move "
                         f"the file elsewhere, or choose another --out_dir")


def tensorboard_root(out_dir: str) -> Path:
    return Path(out_dir) / "tb"


def tensorboard_writer(out_dir: str, start_step: int):
    """A TensorBoard writer for this start of the run: out_dir/tb/<date-time>-step<N>/, one
    folder per start, as torchtitan writes ./outputs/tb/<date-time>/."""
    from torch.utils.tensorboard import SummaryWriter  # needs tensorboard: preflight checks
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-step{start_step}"
    return SummaryWriter(log_dir=str(tensorboard_root(out_dir) / name))


def scalars(record: dict) -> dict[str, float]:
    """A train or eval record's numbers that are not null (MFU is null on a CPU), by key;
    `kind` and `step` are where TensorBoard files them."""
    return {k: v for k, v in record.items() if k not in ("kind", "step")
            and isinstance(v, int | float) and not isinstance(v, bool)}


def last_byte(path: Path) -> bytes:
    """The file's last byte; b"" for an empty or missing file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 1, 0))
            return f.read(1)
    except FileNotFoundError:
        return b""


def train_line(record: dict, lrs: dict[str, float], has_peak: bool) -> str:
    """The step line README's "What a run looks like" shows: the step, the loss with its ce
    and z parts, the gradient norm, each optimizer's lr, tokens/s, TFLOP/s, MFU, memory, and
    the time elapsed and left."""
    mfu = f"{record['mfu']:.1%} ({record['mfu_palm']:.1%} palm)" if has_peak else "n/a"
    rates = " ".join(f"{name} {lr:.2e}" for name, lr in lrs.items())
    return (f"step {record['step']:>6,} | loss {record['loss']:.4f} (ce {record['ce']:.4f} "
            f"z {record['z']:.2e}) | gnorm {record['grad_norm']:.3f} | lr {rates} | "
            f"{record['tokens_per_s']:,.0f} tok/s | {record['tflops']:.2f} TFLOP/s | MFU {mfu} | "
            f"mem {record['memory_gib']:.2f} GiB | {fmt_time(record['elapsed_s'])} elapsed, "
            f"ETA {fmt_time(record['eta_s'])}")


def memory_gib(device: torch.device) -> float:
    """Peak CUDA memory allocated; on an Apple GPU what Metal holds for this process now (it
    keeps no peak); on a CPU the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 2**30
    return peak_resident_bytes() / 2**30


def peak_resident_bytes(platform: str = sys.platform) -> int:
    """This process's peak resident memory: Windows reports it as the peak working set;
    the Unix `resource` module (absent on Windows) as ru_maxrss, in bytes on macOS and in
    KiB elsewhere (Linux, the BSDs)."""
    if platform == "win32":
        return psutil.Process().memory_info().peak_wset
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform == "darwin" else peak * 1024


def fmt_time(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"
