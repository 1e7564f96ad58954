"""How a run meets its launcher and its machine: the Accelerator, with the device
(devices.device_type), precision and compilation this machine gets (`make_accelerator`,
`mixed_precision`, `use_compile`), and where a launched run cannot work (`check_platform`);
the launch config's keys (what an accelerate yaml asks of train.py, read from the environment
`accelerate launch` gives the workers: `check_launch`, `precision_warnings`, `fsdp_launch`);
the signals a scheduler sends (`StopFlag`: SIGTERM or Ctrl-C finishes the step, saves,
exits 0); the outcome file a launch script reads, since a launcher's exit status cannot
tell a clean stop from a crash (`record_outcome`); and the process group, left after a
barrier on every way out (`leaving_process_group`).

Imports from stacklm: cli (is_rank0, for the one acknowledgement of a stop) and devices. It
takes a config object.
"""

import contextlib
import datetime
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState

from plumbing.cli import is_rank0
from plumbing.devices import device_type


def make_accelerator(cfg) -> Accelerator:
    """One Accelerator for the run, on the device `device_type` picks. The world size must
    be known before it exists (it sets the accumulation), so it is read from the launcher's
    environment via PartialState. On the CPU, `cpu=True` makes a multi-process launch DDP
    over gloo (MULTI_CPU); otherwise accelerate takes the GPU (CUDA, or an Apple GPU). The
    launch config is checked first (`check_launch`), before accelerate reads it."""
    check_launch(os.environ)
    device = device_type(cfg)
    check_platform(device, os.environ)
    cpu = device == "cpu"
    if device == "cuda":
        # fp32 matmuls (the loss head's fp32 logits above all) run on TF32 tensor cores:
        # fp32 range and accumulation, 10-bit mantissa inputs, as nanoGPT and torchtitan do.
        torch.set_float32_matmul_precision("high")
    world_size = PartialState(cpu=cpu).num_processes
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision(cfg)[0],
                       gradient_accumulation_steps=cfg.grad_accum_steps(world_size))


def check_platform(device: str, environ, platform: str = sys.platform):
    """Refuse a launched multi-process run where it cannot work: on an Apple GPU (no
    collective backend takes MPS tensors), and on Windows (torch's launcher and the
    process-group exit are tested on Linux only)."""
    if int(environ.get("WORLD_SIZE", "1")) == 1:
        return
    if device == "mps":
        raise ValueError("an Apple GPU (MPS) trains on one process: no collective backend "
                         "takes MPS tensors; run `python train.py`, or pass --device=cpu to "
                         "launch several CPU processes")
    if platform == "win32":
        raise ValueError("a launched multi-process run needs Linux or macOS; on Windows train "
                         "on one process (`python train.py`), or launch under WSL2")


def mixed_precision(cfg) -> tuple[str, str]:
    """accelerate's mixed_precision for this run, and why: the config's, or for `auto` what
    this machine computes fastest: bf16 autocast on a GPU with bf16 tensor cores
    (`gpu_computes_bf16`) and on a CPU that computes bf16 in hardware (`cpu_computes_bf16`),
    fp32 ("no") anywhere else, where bf16 is emulated and slower than fp32. It wins over the
    launch config's (precision_warnings warns)."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision, "the config's mixed_precision"
    device = device_type(cfg)
    if device == "mps":  # nanochat too trains in fp32 there
        return "no", ("auto: an Apple GPU (MPS) trains in fp32, which every macOS computes; "
                      "bf16 there needs macOS 14, and fp16 a loss scaler")
    if device == "cuda":
        name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        if gpu_computes_bf16():
            return "bf16", f"auto: {name} (compute capability {major}.{minor}) computes bf16"
        return "no", (f"auto: {name} (compute capability {major}.{minor}) has no bf16 tensor "
                      f"cores, which GPUs have from Ampere (8.0) on")
    if cpu_computes_bf16():
        return "bf16", "auto: this CPU computes bf16 natively"
    return "no", ("auto: this CPU has no bf16 arithmetic (AVX512_BF16, AMX or Arm's BF16), "
                  "and emulated bf16 is slower than fp32")


def gpu_computes_bf16() -> bool:
    """Whether this GPU has bf16 tensor cores: NVIDIA's from Ampere (compute capability 8.0)
    on. A T4 (7.5) or a V100 (7.0) runs bf16 matmuls without them, slower than fp32."""
    return torch.cuda.get_device_capability() >= (8, 0)


# The CPU flags (Linux's /proc/cpuinfo) of bf16 arithmetic in hardware: x86's AVX512_BF16
# (Intel from Cooper Lake, AMD from Zen 4) and AMX-BF16 (Intel from Sapphire Rapids), Arm's
# BF16 extension (Armv8.6: Graviton3, Neoverse V1 and later).
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_computes_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 arithmetic in hardware, from its flags (x86's `flags`,
    Arm's `Features`). Where they cannot be read (not Linux), no: fp32 is the safe guess."""
    try:
        lines = cpuinfo.read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    flags = {flag for line in lines if line.startswith(("flags", "Features"))
             for flag in line.partition(":")[2].split()}
    return bool(flags & BF16_CPU_FLAGS)


# On a CPU, a run shorter than this many optimizer steps stays eager: compiling costs more
# over a whole run (the first step, then evaluation's and the sample's own graphs) than it
# saves in its steps, up to about 420 of tiny's steps on 2 cores (docs/figures.md).
CPU_COMPILE_MIN_STEPS = 500


def use_compile(cfg) -> tuple[bool, str]:
    """Whether to torch.compile each block, and why: the config's, or for `auto` on a GPU,
    and on a CPU for a run long enough to pay back the compilation (CPU_COMPILE_MIN_STEPS,
    counted to stop_at_step from step 0)."""
    if cfg.compile_model != "auto":
        return cfg.compile_model == "true", "the config's compile_model"
    device = device_type(cfg)
    if device == "cuda":
        return True, "auto: a GPU"
    if device == "mps":
        return False, "auto: an Apple GPU, where torch.compile's backend is a prototype"
    long_enough = cfg.stop_at_step >= CPU_COMPILE_MIN_STEPS
    length = "long enough" if long_enough else "too short"
    return long_enough, (f"auto: a CPU run of {cfg.stop_at_step:,} steps, {length} to pay back "
                         f"compiling ({CPU_COMPILE_MIN_STEPS:,}+)")


# ---------------------------------------------------------------------------------------
# The launch config: what accelerate's yaml asks of train.py
# ---------------------------------------------------------------------------------------

# `accelerate launch` hands its yaml to the workers as environment variables
# (accelerate/utils/launch.py): ACCELERATE_MIXED_PRECISION, and under distributed_type FSDP
# one FSDP_* variable per fsdp_config key, an absent key as accelerate's default, and
# ACCELERATE_USE_FSDP=true, which is what makes train.py shard (`fsdp_launch`). train.py
# shards the model itself (train.shard_model), so of those it honours fsdp_version: 2 and
# fsdp_reshard_after_forward. Any other key set to something but its default would do
# nothing, or fight train.py's own sharding: it is refused. Variable: (the default, why).
REFUSED_FSDP_KEYS = {
    "FSDP_OFFLOAD_PARAMS": ("false", "offloading parameters to the CPU is not supported "
                                     "(nothing here can test it)"),
    "FSDP_ACTIVATION_CHECKPOINTING": ("false", "train.py recomputes activations itself: use "
                                               "--activation_recompute=full instead"),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": ("false", "activation offload is not supported"),
    "FSDP_AUTO_WRAP_POLICY": (None, "train.py shards one group per block itself"),
    "FSDP_TRANSFORMER_CLS_TO_WRAP": (None, "train.py shards one group per block itself"),
    "FSDP_MIN_NUM_PARAMS": ("100000000", "train.py shards one group per block itself"),
    "FSDP_IGNORED_MODULES": (None, "train.py shards every parameter"),
    "FSDP_STATE_DICT_TYPE": (None, "checkpoints are always sharded DCP folders (`python "
                                   "export.py OUT_DIR` writes a whole model)"),
    "FSDP_SHARDING_STRATEGY": ("FULL_SHARD", "that is FSDP1's; set fsdp_reshard_after_forward"),
    "FSDP_BACKWARD_PREFETCH": (None, "that is FSDP1's"),
    "FSDP_FORWARD_PREFETCH": ("false", "that is FSDP1's"),
    "FSDP_USE_ORIG_PARAMS": ("true", "that is FSDP1's"),
    "FSDP_SYNC_MODULE_STATES": ("true", "every rank builds the same weights from the seed"),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("true", "it is for loading pretrained transformers "
                                               "models"),
}


def fsdp_launch(environ) -> bool:
    """Whether the launch config asks for FSDP (accelerate launch exports its yaml's
    distributed_type FSDP as ACCELERATE_USE_FSDP): train.py then shards the model itself."""
    return environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def reshard_after_forward(environ) -> bool:
    """The launch config's fsdp_reshard_after_forward (true when absent), for shard_model."""
    return environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") == "true"


def check_launch(environ):
    """Refuse, in one line, a launch-config key train.py would not honour, before accelerate
    reads it (`make_accelerator` calls this first: the Accelerator would end in accelerate's
    own error, naming neither key nor file). A key accelerate does not know never reaches
    the workers (it exports the keys it knows, and not the file's path): no check sees it."""
    if environ.get("ACCELERATE_DYNAMO_BACKEND", "NO") != "NO":
        raise ValueError(f"launch config: dynamo_backend={environ['ACCELERATE_DYNAMO_BACKEND']} "
                         f"would compile the model a second time; train.py compiles each block "
                         f"itself: remove dynamo_config and use --compile_model")
    if fsdp_launch(environ):
        if environ.get("FSDP_VERSION") != "2":
            raise ValueError(f"launch config: fsdp_version={environ.get('FSDP_VERSION')} asks "
                             f"for FSDP1, and train.py shards with FSDP2 only; set "
                             f"fsdp_version: 2")
        if environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") not in ("true", "false"):
            raise ValueError(f"launch config: fsdp_reshard_after_forward="
                             f"{environ['FSDP_RESHARD_AFTER_FORWARD']} must be true or false "
                             f"under fsdp_version: 2")
        for variable, (default, why) in REFUSED_FSDP_KEYS.items():
            if environ.get(variable, default) != default:
                raise ValueError(f"launch config: {variable.lower()}={environ[variable]} is "
                                 f"not honoured: {why}; remove it from the yaml")


def precision_warnings(environ, run_precision: str) -> list[str]:
    """A warning when the launch config's mixed_precision differs from `run_precision`, the
    one this run uses: the config's mixed_precision wins (it is part of the run, saved in
    every checkpoint). Without a launcher there is no launch config, and no warning."""
    launched = environ.get("ACCELERATE_MIXED_PRECISION", run_precision)
    if launched != run_precision:
        return [f"warning: the launch config's mixed_precision={launched} is ignored: this run "
                f"uses {run_precision}, from its config (--mixed_precision chooses)"]
    return []


# ---------------------------------------------------------------------------------------
# Signals and the outcome file
# ---------------------------------------------------------------------------------------

class StopFlag:
    """SIGTERM (a scheduler's preemption) or Ctrl-C asks the loop to finish its step, save
    and exit 0, and says so at once; a second Ctrl-C interrupts at once (KeyboardInterrupt,
    which cli.user_errors makes the line QUIT and exit status 130). The old handlers come
    back on exit. (A launcher's workers start sessions of their own, so a Ctrl-C in the
    terminal reaches only the launcher, which passes one signal on to each worker: rank 0
    alone acknowledges it.)"""

    ACKNOWLEDGEMENT = b"stopping after this step (Ctrl-C again to quit now)\n"
    QUIT = "interrupted: the step in flight was not saved; run the same command to resume"

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
        # os.write, not print: the handler may run while the main thread is inside a write
        # to sys.stderr (the progress bar's), and a buffered stream refuses reentrant calls.
        if not self.requested and is_rank0():
            os.write(2, self.ACKNOWLEDGEMENT)
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor([float(self.requested)], device=device)


# Under `accelerate launch`, torch's elastic agent turns a SIGTERM it receives (SLURM signals
# every process of a job step, the launcher too) into a non-zero exit, even when every rank
# saved and exited 0 (torch/distributed/launcher/api.py). So a script cannot tell a clean
# stop from a crash by the exit status. Where this variable names a file, the first process
# of each node writes "stopped STEP" (a signal stopped the run; resuming continues it) or
# "finished STEP" there as it ends; slurm_fsdp2.sh reads it and requeues a stopped job.
OUTCOME_FILE = "STACKLM_OUTCOME"


def record_outcome(outcome: str, step: int, is_local_main: bool):
    path = os.environ.get(OUTCOME_FILE)
    if path and is_local_main:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(f"{outcome} {step}\n", encoding="utf-8")
        tmp.replace(path)  # whole or absent, never half-written (rename fails on Windows)


# How long a rank on its way out after an error waits for the others at the barrier: a rank
# that failed elsewhere, or waits inside a collective, never comes, and the launcher ends it
# once this one has exited.
LEAVE_WAIT_S = 30


@contextlib.contextmanager
def leaving_process_group():
    """The command's body; on the way out, however it ends (finished, a user error's exit 2,
    a crash), the process group is left (`leave_process_group`)."""
    try:
        yield
    except BaseException:
        leave_process_group(cleanly=False)
        raise
    leave_process_group(cleanly=True)


def leave_process_group(cleanly: bool):
    """A launched process's last act: meet every rank at a barrier, then destroy the process
    group while the interpreter is whole. A rank that destroys its group while another is
    still busy (rank 0 writing the end record and the report) can abort at exit, and so can
    one that leaves the group to the interpreter's exit: gloo's threads are torn down while
    they still work ("terminate called without an active exception", SIGABRT,
    pytorch/pytorch#190489). After an error (`cleanly` False) another rank may never come:
    the wait is bounded over gloo (monitored_barrier), and over NCCL, whose threads are not
    gloo's, there is none."""
    if not dist.is_initialized():
        return
    if cleanly:
        dist.barrier()  # every rank has finished its run
    elif dist.get_backend() == "gloo":
        with contextlib.suppress(RuntimeError):  # a rank that never came: leave all the same
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_WAIT_S))
    dist.destroy_process_group()
