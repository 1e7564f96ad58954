"""train.py: the loop end to end on CPU — equivalences, exact resume, faults, metrics."""

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tokenizers import Tokenizer
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import data
import export
import model as model_lib
import optim
import train
from conftest import copy_of, micro_config
from model import Transformer, flops_per_token
from plumbing import checkpoint, log, overrides, shards

REPO = Path(__file__).resolve().parent.parent


# --- helpers ----------------------------------------------------------------------------

def train_records(cfg) -> list[dict]:
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def checkpoint_weights(cfg, step: int) -> dict:
    """The model weights of out_dir/ckpt/step_XXXXXXX, read with DCP into a fresh model."""
    sd = {"model": Transformer(cfg.model).state_dict()}
    dcp.load(sd, checkpoint_id=str(Path(cfg.out_dir) / "ckpt" / f"step_{step:07d}"))
    return sd["model"]


def assert_weights(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for name in a:
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def cli_args(cfg) -> list[str]:
    """Every field of cfg as --key=value flags (the CLI's own syntax)."""
    def text(value):
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return "none" if value is None else str(value).lower() if isinstance(value, bool) \
            else str(value)
    args = [f"--{f.name}={text(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)
            if f.name != "model"]
    return args + [f"--model.{f.name}={text(getattr(cfg.model, f.name))}"
                   for f in dataclasses.fields(cfg.model)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg, processes: int = 1, config_file: str = "cpu_ddp.yaml") -> list[str]:
    """train.py in fresh processes: plain python for one, accelerate launch with
    accelerate_configs/`config_file` for several (DDP over gloo by default; fsdp2.yaml
    shards with FSDP2 over gloo)."""
    if processes == 1:
        return [sys.executable, "train.py", *cli_args(cfg)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            f"accelerate_configs/{config_file}", "--num_processes", str(processes),
            "--main_process_port", str(free_port()), "train.py", *cli_args(cfg)]


def launch(cfg, processes: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(launch_command(cfg, processes), cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


# --- end to end -----------------------------------------------------------------------

def test_tiny_run_learns_logs_and_reconciles(small_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(log, "peak_flops", lambda name: 2e12)  # pretend a 2 TFLOP/s chip
    cfg = micro_config(small_data_dir, str(tmp_path), total_steps=40, stop_at_step=40,
                       warmup_steps=4, eval_every=20, ckpt_every=20)
    metrics = train.main(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 20, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0, evals
    assert 0 < evals[-1]["val_bpb"] < evals[0]["val_bpb"]
    records = train_records(cfg)
    assert [r["step"] for r in records] == list(range(1, 41))
    fpt = flops_per_token(cfg.model, cfg.seq_len, "causal")
    for r in records:
        assert math.isclose(r["tflops"], fpt * r["tokens_per_s"] / 1e12, rel_tol=1e-9)
        assert math.isclose(r["mfu"], r["tflops"] / 2.0, rel_tol=1e-9)
        assert r["lr_adamw"] == pytest.approx(cfg.adamw_peak_lr * optim.lr_multiplier(
            r["step"] - 1, cfg))
        assert r["loss"] == pytest.approx(r["ce"] + r["z"], rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["step_0000020", "step_0000040"]
    assert metrics["sample"].startswith(cfg.sample_prompt)


# --- equivalences -----------------------------------------------------------------------

def test_the_last_step_is_evaluated_and_saved_off_the_intervals(small_data_dir, tmp_path):
    """stop_at_step 6 is no multiple of eval_every or ckpt_every (4): the loop still
    evaluates and saves it, once, as the step it ends on."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=6)
    train.main(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 4, 6]
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == \
        ["step_0000004", "step_0000006"]


def test_micro_batch_split_does_not_change_training(small_data_dir, tmp_path):
    """1 process × micro 8 × accum 1 equals 1 × micro 4 × accum 2 (same global batch)."""
    whole = micro_config(small_data_dir, str(tmp_path / "whole"), micro_batch_size=8)
    split = micro_config(small_data_dir, str(tmp_path / "split"), micro_batch_size=4)
    assert whole.grad_accum_steps(1) == 1 and split.grad_accum_steps(1) == 2
    train.main(whole)
    train.main(split)
    for a, b in zip(train_records(whole), train_records(split), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert_weights(checkpoint_weights(whole, 8), checkpoint_weights(split, 8), atol=2e-5)


def mask_targets_by_window(monkeypatch):
    """Every batch the loaders make (data.pack) gets the first k of each row's 64 targets
    masked (-100), k = 37·(the row's first token) mod 61, from 0 to 60: micro-batches then
    hold different numbers of targets, and a window is masked alike however the global
    batch is split."""
    original = data.pack

    def pack(tokens, eos_id):
        out = original(tokens, eos_id)
        for row, first in enumerate(tokens[:, 0]):
            out["targets"][row, :int(first) * 37 % 61] = -100
        return out
    monkeypatch.setattr(data, "pack", pack)


def test_accumulation_normalises_by_the_global_target_count(small_data_dir, tmp_path,
                                                            monkeypatch):
    """With masked targets the two micro-batches of a step hold different numbers of
    targets; 1 × micro 4 × accum 2 must still train as 1 × micro 8 × accum 1, whose loss is
    the mean over every target of the global batch. Measured, real code vs a mean of
    per-micro-batch means (which weights a target by the size of its micro-batch), against
    the tolerance: loss 9e-8 vs 3e-3 relative (1e-5), grad_norm 4e-7 vs 7e-2 relative
    (1e-5), step-8 weights 1.1e-5 vs 6e-2 absolute (2e-4)."""
    mask_targets_by_window(monkeypatch)
    whole = micro_config(small_data_dir, str(tmp_path / "whole"), micro_batch_size=8)
    split = micro_config(small_data_dir, str(tmp_path / "split"), micro_batch_size=4)
    assert whole.grad_accum_steps(1) == 1 and split.grad_accum_steps(1) == 2
    # The inputs make the mistake visible: the two micro-batches of every step differ.
    loader = data.PackedShardLoader(small_data_dir, "train", split.seq_len, 4, seed=split.seed)
    counts = [int((next(loader)["targets"] != -100).sum()) for _ in range(16)]
    assert all(a != b for a, b in zip(counts[::2], counts[1::2])), counts
    train.main(whole)
    train.main(split)
    for a, b in zip(train_records(whole), train_records(split), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=0)
    assert_weights(checkpoint_weights(whole, 8), checkpoint_weights(split, 8), atol=2e-4)


@pytest.mark.distributed
def test_two_ranks_equal_one_rank_with_accumulation(small_data_dir, tmp_path):
    """2 processes × accum 1 (DDP over gloo) equal 1 process × accum 2; then the 2-rank
    checkpoint resumes on 1 rank and continues the same global data stream."""
    one = micro_config(small_data_dir, str(tmp_path / "one"))
    two = micro_config(small_data_dir, str(tmp_path / "two"), stop_at_step=4)
    train.main(one)
    launch(two, processes=2)
    for a, b in zip(train_records(one)[:4], train_records(two), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        # The logged norm is the global gradient's, before clipping: a gradient that DDP's
        # averaging left halved shows here (×0.5), not only through the weights. Measured
        # 1 vs 2 ranks: identical (diff 0).
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=0)
    assert_weights(checkpoint_weights(one, 4), checkpoint_weights(two, 4), atol=2e-5)
    state = json.loads((tmp_path / "two/ckpt/step_0000004/train_state.json").read_text())
    assert state["world_size"] == 2

    resumed = dataclasses.replace(two, stop_at_step=8)
    train.main(resumed)  # 1 process now
    records = train_records(resumed)
    assert [r["step"] for r in records] == list(range(1, 9))
    for a, b in zip(train_records(one), records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert_weights(checkpoint_weights(one, 8), checkpoint_weights(resumed, 8), atol=2e-5)


# train.py's command, watched: an exit hook, which runs before the interpreter is torn down,
# writes whether the process group is still there, and when the process left (one write
# per rank, so the ranks' lines cannot interleave). With LINGER_S set, rank 0 stays that
# long in its run after training, as it does writing the end record and the report, and
# says when it is done.
WATCHED_TRAIN_PY = """\
import atexit, os, sys, time
import torch.distributed as dist
import train
atexit.register(lambda: os.write(1, f"process group at exit: {dist.is_initialized()} "
                                    f"at {time.time()}\\n".encode()))
main, linger = train.main, float(os.environ.get("LINGER_S", "0"))
def lingering(*args, **kwargs):
    metrics = main(*args, **kwargs)
    time.sleep(linger)
    os.write(1, f"rank 0 done at {time.time()}\\n".encode())
    return metrics
if linger and os.environ["RANK"] == "0":
    train.main = lingering
train.cli(sys.argv[1:])
"""


def watched_train_py(tmp_path: Path) -> Path:
    script = tmp_path / "watched.py"
    script.write_text(WATCHED_TRAIN_PY)
    return script


@pytest.mark.distributed
def test_a_launched_run_leaves_its_process_group_after_every_rank_is_done(small_data_dir,
                                                                          tmp_path):
    """train.py's command on 2 DDP ranks leaves its process group before the interpreter
    exits (left to the exit, gloo's threads can abort a finished run: SIGABRT, "terminate
    called without an active exception", as one 3-rank resume did in CI), and not before
    every rank is done: a rank that left while rank 0 still wrote its end record aborted
    too (1 of 36 bare launches here). Rank 0 lingers 2 s after training; rank 1 leaves
    after it."""
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), stop_at_step=2, eval_every=2)
    command = launch_command(cfg, processes=2)
    command[command.index("train.py")] = str(watched_train_py(tmp_path))
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                               "LINGER_S": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hardware: 2 × cpu" in done.stdout  # the ranks did form a process group
    exits = re.findall(r"process group at exit: (\w+) at ([\d.]+)", done.stdout)
    assert [left for left, _ in exits] == ["False", "False"], done.stdout[-3000:]
    rank0_done = float(re.search(r"rank 0 done at ([\d.]+)", done.stdout)[1])
    assert all(float(at) >= rank0_done for _, at in exits), (rank0_done, exits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_batches_reach_the_gpu_through_pinned_memory(monkeypatch):
    """From pinned memory a non_blocking copy spares the host the wait: each tensor is
    pinned on its way, and arrives unchanged."""
    pinned, pin = [], torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or pin(t))
    batch = {"input_ids": torch.arange(6).view(2, 3), "targets": torch.arange(6).view(2, 3)}
    moved = train.to_device(batch, torch.device("cuda"))
    assert len(pinned) == 2 and all(t.is_cuda for t in moved.values())
    assert all(torch.equal(moved[k].cpu(), batch[k]) for k in batch)
    assert train.to_device(batch, torch.device("cpu")) is batch  # nothing to copy


# Compiled blocks against eager ones: inductor fuses and reorders the blocks' sums, so the
# logged losses and grad norms may differ in their last bits. 10x the largest difference
# compile's own reordering made over 8 steps, on torch 2.11 and 2.13, with the hand-written
# norm and loss and with plain ones alike (docs/figures.md). A gradient the compiled blocks
# get wrong moves the grad norm of the very first step far past it.
COMPILE_RTOL = 2e-6


def test_compiled_blocks_train_like_eager_blocks(small_data_dir, tmp_path):
    """compile_model=true (regional compilation, the CUDA default) on CPU's inductor: the
    same losses and grad norms as eager up to compile's reordering, step by step, and
    checkpoints keep the eager parameter names (a plain Transformer loads them)."""
    eager = micro_config(small_data_dir, str(tmp_path / "eager"), stop_at_step=2)
    compiled = micro_config(small_data_dir, str(tmp_path / "compiled"), stop_at_step=2,
                            compile_model="true")
    train.main(eager)
    train.main(compiled)
    for a, b in zip(train_records(eager), train_records(compiled), strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=COMPILE_RTOL), a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=COMPILE_RTOL), a["step"]
    assert_weights(checkpoint_weights(eager, 2), checkpoint_weights(compiled, 2), atol=1e-4)


# --- resume -----------------------------------------------------------------------------

def test_resume_is_bitwise_exact(small_data_dir, tmp_path):
    straight = micro_config(small_data_dir, str(tmp_path / "straight"))
    halves = micro_config(small_data_dir, str(tmp_path / "halves"), stop_at_step=4)
    train.main(straight)
    train.main(halves)
    train.main(dataclasses.replace(halves, stop_at_step=8))  # resume="latest" finds step 4
    assert [r["loss"] for r in train_records(straight)] == \
        [r["loss"] for r in train_records(halves)]
    assert_weights(checkpoint_weights(straight, 8), checkpoint_weights(halves, 8))


@pytest.mark.distributed
def test_bf16_on_a_cpu_resumes_bitwise_keeps_fp32_state_and_two_ranks_equal_one(
        small_data_dir, tmp_path):
    """bf16 autocast on the CPU, what `auto` picks where the CPU computes bf16 natively
    (forced here: this machine may not). In one fresh process (accelerate fixes a process's
    precision at its first Accelerator): the run straight to step 8, and the run stopped at
    4 and resumed, which ends bitwise where the straight one does; the weights and both
    optimizers' state stay fp32; the losses are not fp32's (autocast ran); Muon's
    Newton–Schulz runs in bf16, as train.setup builds it (seen by the iteration's own
    input). 2 DDP ranks equal the one process accumulating 2 micro-batches, to the fp32
    test's tolerances. Without a launcher there is no launch config to warn about; the
    DDP launch's yaml says mixed_precision "no", and that is warned about."""
    straight = micro_config(small_data_dir, str(tmp_path / "straight"), mixed_precision="bf16")
    halves = dataclasses.replace(straight, out_dir=str(tmp_path / "halves"), stop_at_step=4)
    runs = [cli_args(c) for c in (straight, halves, dataclasses.replace(halves, stop_at_step=8))]
    script = ("import json, sys, optim, train\n"
              "seen, iterate = set(), optim.newton_schulz\n"
              "def watched(G, steps=5, dtype=torch.float32):\n"
              "    seen.add(str(G.to(dtype).dtype))\n"
              "    return iterate(G, steps, dtype)\n"
              "optim.newton_schulz = watched\n"
              "for args in json.loads(sys.argv[1]): train.cli(args)\n"
              "print('newton-schulz ran in', sorted(seen))\n")
    done = subprocess.run([sys.executable, "-c", "import torch\n" + script, json.dumps(runs)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "precision bf16 (the config's mixed_precision" in done.stdout
    assert "newton-schulz ran in ['torch.bfloat16']" in done.stdout
    assert "launch config's mixed_precision" not in done.stdout  # there is none
    two = dataclasses.replace(straight, out_dir=str(tmp_path / "two"))
    ddp = launch(two, processes=2)
    assert "warning: the launch config's mixed_precision=no is ignored: this run uses bf16" \
        in ddp.stdout
    fp32 = micro_config(small_data_dir, str(tmp_path / "fp32"), stop_at_step=2)
    train.main(fp32)

    losses = [r["loss"] for r in train_records(straight)]
    assert losses == [r["loss"] for r in train_records(halves)]
    assert_weights(checkpoint_weights(straight, 8), checkpoint_weights(halves, 8))
    dtypes = checkpoint_dtypes(straight, 8)
    assert len(dtypes) > 20 and set(dtypes.values()) == {torch.float32}, dtypes
    assert train_records(fp32)[1]["loss"] != losses[1]
    for a, b in zip(train_records(straight), train_records(two), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert_weights(checkpoint_weights(straight, 8), checkpoint_weights(two, 8), atol=2e-5)


def checkpoint_dtypes(cfg, step: int) -> dict[str, torch.dtype]:
    """The saved dtype of every floating-point tensor of a checkpoint (weights, Muon momentum,
    AdamW moments and step), by name, from its DCP metadata."""
    reader = dcp.FileSystemReader(str(Path(cfg.out_dir) / "ckpt" / f"step_{step:07d}"))
    return {k: v.properties.dtype for k, v in reader.read_metadata().state_dict_metadata.items()
            if hasattr(v, "properties") and v.properties.dtype.is_floating_point}


# Fields that measure the machine, not the run: they differ between any two runs.
TIMING_FIELDS = {"tokens_per_s", "tflops", "tflops_palm", "mfu", "mfu_palm", "elapsed_s",
                 "eta_s", "memory_gib"}


def logged_rows(cfg) -> list[dict]:
    """metrics.jsonl's train, eval and skip records without the timing fields (start,
    checkpoint and end records say how a run went, which differs). An evaluation row equal
    to the row before it is dropped: a resumed run evaluates again the step its first part
    ended on."""
    rows = []
    for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS}
        if row["kind"] not in ("train", "eval", "skip"):
            continue
        if not ("val_loss" in row and rows and row == rows[-1]):
            rows.append(row)
    return rows


def test_resume_continues_every_logged_metric(small_data_dir, tmp_path):
    """A stopped-and-resumed run logs what a straight run logs, every field of every row
    (tokens_seen, both lrs, grad_norm, ce, z, the evaluations), bit for bit: real diff 0,
    tolerance 0. (skipped_steps is 0 throughout here; the next test makes it count.)"""
    straight = micro_config(small_data_dir, str(tmp_path / "straight"))
    halves = micro_config(small_data_dir, str(tmp_path / "halves"), stop_at_step=4)
    train.main(straight)
    train.main(halves)
    train.main(dataclasses.replace(halves, stop_at_step=8))
    rows = logged_rows(straight)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 4, 8]
    assert rows[-2]["tokens_seen"] == 8 * straight.global_batch_tokens
    assert logged_rows(halves) == rows


def test_resume_keeps_the_skipped_step_count(small_data_dir, tmp_path, monkeypatch):
    """One skipped update (NaN loss at step index 1) before the stop at step 4: after the
    resume, skipped_steps must still say 1, as in the straight run."""
    straight = micro_config(small_data_dir, str(tmp_path / "straight"))
    halves = micro_config(small_data_dir, str(tmp_path / "halves"), stop_at_step=4)
    accum = straight.grad_accum_steps(1)
    for cfg in (straight, halves):
        inject_nan_loss(monkeypatch, bad_steps={1}, accum=accum)
        train.main(cfg)
        monkeypatch.undo()  # the next run counts its forwards from 0 again
    train.main(dataclasses.replace(halves, stop_at_step=8))
    rows, resumed = logged_rows(straight), logged_rows(halves)
    assert [r["step"] for r in rows if r["kind"] == "skip"] == [2]
    assert [{**r, "skipped_steps": 0} for r in resumed] == \
        [{**r, "skipped_steps": 0} for r in rows]  # all else agrees
    assert [r.get("skipped_steps") for r in resumed] == [r.get("skipped_steps") for r in rows]


def test_sigterm_saves_exits_zero_and_resumes_exactly(small_data_dir, tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, the run report says
    where it stopped, exit code 0; resuming reaches the same weights, bit for bit, as a run
    that was never interrupted."""
    cfg = micro_config(small_data_dir, str(tmp_path / "killed"), total_steps=400,
                       stop_at_step=400, eval_every=1000, ckpt_every=1000, warmup_steps=10,
                       write_report=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(launch_command(cfg), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or
                                      metrics.read_text().count('"kind": "train"') < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "stop requested" in output
    saved = checkpoint.find(cfg.out_dir, "latest")
    stopped_at = json.loads((saved / "train_state.json").read_text())["step"]
    assert 3 <= stopped_at < 400
    assert f"| outcome | stopped at step {stopped_at:,} of 400 |" in \
        (tmp_path / "killed" / "report.md").read_text()

    resumed = dataclasses.replace(cfg, stop_at_step=stopped_at + 2, write_report=False)
    launch(resumed)
    straight = dataclasses.replace(resumed, out_dir=str(tmp_path / "straight"))
    launch(straight)
    assert_weights(checkpoint_weights(resumed, stopped_at + 2),
                   checkpoint_weights(straight, stopped_at + 2))


# --- faults -----------------------------------------------------------------------------

def inject_nan_loss(monkeypatch, bad_steps: set[int], accum: int):
    """Make the training forward return a NaN loss on the given (0-based) steps."""
    original = model_lib.Transformer.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if torch.is_grad_enabled():
            step = calls["n"] // accum
            calls["n"] += 1
            if step in bad_steps:
                return out._replace(loss=out.loss * float("nan"))
        return out
    monkeypatch.setattr(model_lib.Transformer, "forward", forward)


def test_non_finite_loss_skips_the_update(small_data_dir, tmp_path, monkeypatch):
    """Step index 2 (the third update, row 3) has a NaN loss: its update is skipped, so the
    weights after row 3 are those after row 2; no checkpoint is written for row 3, which
    is inside the (one-step) non-finite streak; training goes on at row 4."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4, ckpt_every=1)
    inject_nan_loss(monkeypatch, bad_steps={2}, accum=cfg.grad_accum_steps(1))
    steps, original = [], optim.Optimizers.step
    monkeypatch.setattr(optim.Optimizers, "step", lambda self: (steps.append(1), original(self)))
    train.main(cfg)
    assert len(steps) == 3  # rows 1, 2 and 4 updated the weights; row 3 did not
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["step_0000001", "step_0000002", "step_0000004"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "skip"] == [3]  # numbered as training rows
    assert train_records(cfg)[-1]["skipped_steps"] == 1


def test_consecutive_non_finite_steps_stop_the_run(small_data_dir, tmp_path, monkeypatch):
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2, max_bad_steps=2)
    inject_nan_loss(monkeypatch, bad_steps={2, 3, 4, 5, 6, 7}, accum=cfg.grad_accum_steps(1))
    with pytest.raises(checkpoint.TrainingDiverged, match="2 consecutive non-finite steps"):
        train.main(cfg)
    # step_0000002's weights gave the first non-finite loss (row 3): set aside, not deleted
    assert checkpoint.find(cfg.out_dir, "latest") is None
    assert (tmp_path / "ckpt" / "step_0000002.diverged" / "train_state.json").exists()


def test_isolated_non_finite_steps_do_not_stop_the_run(small_data_dir, tmp_path, monkeypatch):
    """max_bad_steps counts consecutive bad steps: NaN losses at step indices 1, 3 and 5,
    each followed by a good step, never make 2 in a row, so the run finishes."""
    cfg = micro_config(small_data_dir, str(tmp_path), max_bad_steps=2)
    inject_nan_loss(monkeypatch, bad_steps={1, 3, 5}, accum=cfg.grad_accum_steps(1))
    train.main(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "skip"] == [2, 4, 6]
    last = train_records(cfg)[-1]
    assert last["step"] == 8 and last["skipped_steps"] == 3
    assert checkpoint.find(cfg.out_dir, "latest").name == "step_0000008"


def test_non_finite_weights_are_never_checkpointed(small_data_dir, tmp_path, monkeypatch):
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2)
    original = optim.Muon.step
    steps = {"n": 0}

    def poisoned_step(self, *args, **kwargs):
        original(self, *args, **kwargs)
        steps["n"] += 1
        if steps["n"] == 3:
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.fill_(float("nan"))
    monkeypatch.setattr(optim.Muon, "step", poisoned_step)
    with pytest.raises(checkpoint.TrainingDiverged, match="5 consecutive non-finite steps"):
        train.main(cfg)  # rows 4..8 are non-finite; row 4's checkpoint is not written
    assert checkpoint.find(cfg.out_dir, "latest").name == "step_0000002"


# --- the step and its metrics against independent oracles -------------------------------

def reference_loss_sum(model, batch, z_loss: float) -> torch.Tensor:
    """Σ over the valid targets of CE + z·logsumexp², from the full logits in float64
    through model.reference_loss (F.cross_entropy underneath), not the model's fused head."""
    logits = model.logits(batch["input_ids"], batch["position_ids"], batch["seq_ids"])
    logits, targets = logits.flatten(0, 1).double(), batch["targets"].flatten()  # (N, V), (N,)
    return model_lib.reference_loss(logits, targets, z_loss, reduction="sum").loss


def test_gradient_clipping_against_a_hand_clipped_gradient(small_data_dir, tmp_path,
                                                           monkeypatch):
    """The optimizers must see g·clip / max(‖g‖, clip), where g is the gradient of the mean
    loss over the whole global batch. Here g is computed independently, on all 8 windows at
    once from the full logits (`reference_loss_sum`), and clipped with plain math; the
    gradients are read as the optimizers step. clip = 0.05 is far below every step's norm
    (0.8–1.0 here), so clipping acts on every step; without it the optimizers see ~16×
    the clipped norm."""
    clip = 0.05
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=3, grad_clip=clip)
    built, seen = [], []  # the trainer's model; its gradients as the optimizers step
    build_model = train.build_model
    monkeypatch.setattr(train, "build_model", lambda *a: built.append(build_model(*a))
                        or built[-1])
    optimizers_step = optim.Optimizers.step

    def step(self):
        seen.append({n: p.grad.detach().clone() for n, p in built[0].named_parameters()})
        optimizers_step(self)
    monkeypatch.setattr(optim.Optimizers, "step", step)
    train.main(cfg)
    logged = [r["grad_norm"] for r in train_records(cfg)]

    set_seed(cfg.seed)  # as train.build_model: the same initial weights
    reference = Transformer(cfg.model)
    windows = cfg.global_batch_tokens // cfg.seq_len  # the first step's windows, in one batch
    batch = next(data.PackedShardLoader(small_data_dir, "train", cfg.seq_len, windows,
                                        seed=cfg.seed))
    (reference_loss_sum(reference, batch, cfg.model.z_loss) / batch["targets"].numel()) \
        .backward()
    g = {n: p.grad for n, p in reference.named_parameters()}
    norm = math.sqrt(sum(float(x.double().square().sum()) for x in g.values()))
    assert norm > 5 * clip and min(logged) > 5 * clip  # clipping acts on every step
    # the logged norm is the pre-clip norm of the mean-loss gradient: real diff 4e-7
    assert logged[0] == pytest.approx(norm, rel=1e-5)
    # the first update's gradient, entry by entry, relative to its size: real diff 9e-7
    clipped = {n: x * clip / max(norm, clip) for n, x in g.items()}
    error = math.sqrt(sum(float((seen[0][n] - clipped[n]).double().square().sum()) for n in g))
    assert error < 1e-4 * clip, error / clip
    # every step: the optimizers see a norm of min(pre-clip norm, clip); real diff 1e-6
    for grads, pre_clip in zip(seen, logged, strict=True):
        seen_norm = math.sqrt(sum(float(x.double().square().sum()) for x in grads.values()))
        assert seen_norm == pytest.approx(min(pre_clip, clip), rel=1e-4)


def test_tflops_and_mfu_match_counted_flops_over_the_measured_step_time(
        small_data_dir, tmp_path, monkeypatch):
    """tflops, tflops_palm and mfu against FLOPs counted by torch's FlopCounterMode on one
    step's forward and backward (every micro-batch, math SDPA as tests/test_model.py), over
    each step's own measured seconds (train_step's result, recorded here).

    The counter sees what the kernels compute, the PaLM convention plus the chunked head's
    logit recompute (2·V·C per token); the causal convention counts half the attention
    scores and 6 FLOPs per RMSNorm gain (no matmul). With those two corrections, stated in
    plain numbers below, every relation is exact but for float rounding: tolerance 1e-9."""
    monkeypatch.setattr(log, "peak_flops", lambda name: 2e12)  # pretend a 2 TFLOP/s chip
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=3)
    seconds = []
    train_step = train.train_step

    def timed(run, stop):
        result = train_step(run, stop)
        seconds.append(result.seconds)
        return result
    monkeypatch.setattr(train, "train_step", timed)
    train.main(cfg)

    model, m, tokens = Transformer(cfg.model), cfg.model, cfg.global_batch_tokens
    loader = data.PackedShardLoader(small_data_dir, "train", cfg.seq_len,
                                    cfg.micro_batch_size, seed=cfg.seed)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        for _ in range(cfg.grad_accum_steps(1)):
            model(**next(loader), reduction="sum").loss.backward()
    palm = counter.get_total_flops() - 2 * m.vocab_size * m.d_model * tokens
    gains = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    causal = palm - 6 * m.n_layers * cfg.seq_len * m.n_heads * m.head_size * tokens \
        + 6 * gains * tokens
    records = train_records(cfg)
    assert [r["step"] for r in records] == [1, 2, 3]  # log_every=1: one step per row
    for r, s in zip(records, seconds, strict=True):
        assert r["tokens_per_s"] == pytest.approx(tokens / s, rel=1e-9)
        assert r["tflops_palm"] == pytest.approx(palm / s / 1e12, rel=1e-9)
        assert r["tflops"] == pytest.approx(causal / s / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(causal / s / 2e12, rel=1e-9)
        assert r["mfu_palm"] == pytest.approx(palm / s / 2e12, rel=1e-9)


# --- evaluation ---------------------------------------------------------------------------

def independent_val_sums(cfg, model) -> dict:
    """Over every window of the val split in stream order (what train.val_loss reads when
    eval_tokens covers the split): Σ CE from F.cross_entropy on the full logits (float64),
    Σ logsumexp², the number of targets, and their UTF-8 bytes, each target decoded on its
    own by the tokenizer (special tokens decode to nothing) and its bytes counted here."""
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(cfg.data_dir))
    loader = data.PackedShardLoader(cfg.data_dir, "val", cfg.seq_len, cfg.micro_batch_size,
                                    seed=cfg.seed)
    assert loader.windows_per_epoch % cfg.micro_batch_size == 0  # whole batches, no remainder
    sums, targets = {"ce": 0.0, "lse2": 0.0}, []
    with torch.no_grad():
        for _ in range(loader.windows_per_epoch // cfg.micro_batch_size):
            batch = next(loader)
            logits = model.logits(batch["input_ids"], batch["position_ids"], batch["seq_ids"])
            logits = logits.flatten(0, 1).double()  # (N, V)
            sums["ce"] += float(F.cross_entropy(logits, batch["targets"].flatten(),
                                                reduction="sum"))
            sums["lse2"] += float(logits.logsumexp(-1).square().sum())
            targets += batch["targets"].flatten().tolist()
    pieces = tokenizer.decode_batch([[t] for t in targets])
    assert not any("\ufffd" in piece for piece in pieces)  # no target splits a character
    assert sum(piece == "" for piece in pieces) >= 1  # an EOS is among the targets
    return {**sums, "targets": len(targets),
            "bytes": sum(len(piece.encode("utf-8")) for piece in pieces)}


def test_bits_per_byte_counts_the_decoded_bytes_of_the_targets(small_data_dir, tmp_path):
    """val_bpb = Σ CE / (ln 2 · Σ bytes), bytes counted by decoding each target.

    evaluate sums the CE in float32 over 118 batches (real diff 3e-7 relative, tolerance
    1e-5), but val_bpb / val_loss = Σ targets / (ln 2 · Σ bytes) has the CE cancel and
    integer counts left, exact in float32: the byte count is pinned there to 1e-9 (real
    diff < 1e-15). Counting EOS as its 13 characters moves that ratio by 2e-4 (the val
    split holds one EOS target among 68,145 bytes), the input tokens' bytes by 1.4e-5."""
    cfg = micro_config(small_data_dir, str(tmp_path), eval_tokens=10**9)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    got = train.val_loss(cfg, Accelerator(cpu=True), model, data.token_bytes(cfg.data_dir),
                         cfg.data_dir)
    ref = independent_val_sums(cfg, model)
    assert got["val_bpb"] / got["val_loss"] == \
        pytest.approx(ref["targets"] / (math.log(2) * ref["bytes"]), rel=1e-9)
    assert got["val_bpb"] == pytest.approx(ref["ce"] / (math.log(2) * ref["bytes"]), rel=1e-5)


def test_val_loss_is_cross_entropy_without_the_z_loss(small_data_dir, tmp_path):
    """val_loss = mean CE over the val targets, from F.cross_entropy on the full logits. The
    model's z_loss weight is 0.1, so a val loss that included z·lse² would be 3.9 nats
    (63%) higher; real diff 3e-7 relative (float32 sums), tolerance 1e-5."""
    cfg = micro_config(small_data_dir, str(tmp_path), eval_tokens=10**9,
                       **{"model.z_loss": 0.1})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    got = train.val_loss(cfg, Accelerator(cpu=True), model, data.token_bytes(cfg.data_dir),
                         cfg.data_dir)
    ref = independent_val_sums(cfg, model)
    assert cfg.model.z_loss * ref["lse2"] / ref["targets"] > 1.0  # z would show by > 1 nat
    assert got["val_loss"] == pytest.approx(ref["ce"] / ref["targets"], rel=1e-5)


# --- config and data mistakes fail before compute ----------------------------------------

def test_missing_data_dir_names_the_prepare_command(tmp_path):
    cfg = micro_config(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    with pytest.raises((FileNotFoundError, ValueError), match="prepare.py"):
        train.main(cfg)


def test_tokenizer_larger_than_model_vocab_is_refused(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), **{"model.vocab_size": 256})
    with pytest.raises(ValueError, match="--model.vocab_size=512"):
        train.main(cfg)


def test_schedule_trap_is_refused_when_the_config_is_made(tmp_path):
    """Before any work: the config itself refuses, so train.main never sees it."""
    with pytest.raises(ValueError, match="inside the decay leg"):
        micro_config(str(tmp_path / "nowhere"), str(tmp_path), total_steps=100,
                     stop_at_step=95, decay_fraction=0.1)  # would stop mid-decay


# --- outputs ----------------------------------------------------------------------------

def test_wandb_offline_writes_a_run(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=2, total_steps=8,
                       wandb_mode="offline")
    train.main(cfg)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_export_then_sample(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    out = export.export(cfg.out_dir)
    exported = torch.load(out / "model.pt", weights_only=True)
    assert_weights(exported, checkpoint_weights(cfg, 4))
    result = subprocess.run([sys.executable, "sample.py", "--export", str(out), "--prompt",
                             "def ", "--max_new_tokens", "8", "--num_samples", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "def " in result.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_training_tracks_fp32(tmp_path):
    """200 steps of `tiny` on the GPU in bf16 autocast and in fp32 from the same seed and
    data. bf16 rounds every matmul input to 8 bits of mantissa, so the curves drift apart a
    little; a stated tolerance of 0.05 nats on the loss (about 1% at the end) separates
    that from a precision bug (an un-upcast loss head or norm diverges by far more)."""
    import config
    runs = {}
    for precision in ("bf16", "no"):
        cfg = overrides.apply_overrides(config.tiny(), {
            "out_dir": str(tmp_path / precision), "mixed_precision": precision,
            "compile_model": "false", "total_steps": 200, "stop_at_step": 200,
            "log_every": 10, "eval_every": 200, "ckpt_every": 1000})
        runs[precision] = train.main(cfg)
        runs[precision]["curve"] = [r["loss"] for r in train_records(cfg)]
    assert runs["bf16"]["val_loss"] == pytest.approx(runs["no"]["val_loss"], abs=0.05)
    late = list(zip(runs["bf16"]["curve"], runs["no"]["curve"], strict=True))[5:]
    assert max(abs(a - b) for a, b in late) < 0.1


def test_a_stop_during_the_last_step_still_evaluates_and_saves_it(small_data_dir, tmp_path,
                                                                   monkeypatch):
    """A SIGTERM or Ctrl-C that arrives while the final step trains: the run still ends as
    a finished run does, evaluated at stop_at_step (whose report needs it) and saved."""
    step = train.train_step

    def signalled_in_the_last_step(run, stop):
        if run.step == run.cfg.stop_at_step - 1:
            stop.requested = True
        return step(run, stop)
    monkeypatch.setattr(train, "train_step", signalled_in_the_last_step)
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=6, eval_every=4,
                       ckpt_every=4)
    metrics = train.main(cfg)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 4, 6]
    assert lines[-1]["kind"] == "end" and lines[-1]["outcome"] == "finished"
    assert "sample" in metrics and (checkpoint.step_path(cfg.out_dir, 6)).is_dir()


def test_a_damaged_val_split_is_refused_in_setup(small_data_dir, tmp_path):
    """Every data mistake fails before any compute: a val shard that differs from its
    manifest stops setup itself, not the step-0 evaluation."""
    data_dir = copy_of(small_data_dir, tmp_path)
    manifest = shards.load_manifest(data_dir)
    shard = data_dir / manifest["splits"]["val"]["shards"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{shard}.*sha256"):
        train.setup(micro_config(str(data_dir), str(tmp_path / "run")))
