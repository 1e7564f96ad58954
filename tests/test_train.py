"""train.py: the loop end to end on CPU — equivalences, exact resume, faults, metrics."""

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
import model as model_lib
import optim
import report
import train
from conftest import micro_config
from model import Transformer, flops_per_token

REPO = Path(__file__).resolve().parent.parent


# --- helpers ----------------------------------------------------------------------------

def train_records(cfg) -> list[dict]:
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and not r.get("skipped")]


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


def launch(cfg, processes: int = 1) -> subprocess.CompletedProcess:
    """train.py in fresh processes: plain python for one, accelerate launch (DDP over gloo)
    for several."""
    if processes == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               "accelerate_configs/cpu_ddp.yaml", "--num_processes", str(processes),
               "--main_process_port", str(free_port()), "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd + cli_args(cfg), cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


# --- end to end -----------------------------------------------------------------------

def test_tiny_run_learns_logs_and_reconciles(small_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "peak_flops", lambda name: 2e12)  # pretend a 2 TFLOP/s chip
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


def test_compiled_blocks_train_like_eager_blocks(small_data_dir, tmp_path):
    """compile_model=true (regional compilation, the CUDA default) on CPU's inductor: the
    same losses as eager to float tolerance, and checkpoints keep the eager parameter names
    (a plain Transformer loads them)."""
    eager = micro_config(small_data_dir, str(tmp_path / "eager"), stop_at_step=2)
    compiled = micro_config(small_data_dir, str(tmp_path / "compiled"), stop_at_step=2,
                            compile_model="true")
    train.main(eager)
    train.main(compiled)
    for a, b in zip(train_records(eager), train_records(compiled), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert_weights(checkpoint_weights(eager, 2), checkpoint_weights(compiled, 2), atol=1e-4)


# --- resume -----------------------------------------------------------------------------

def test_resume_is_bitwise_exact(small_data_dir, tmp_path):
    straight = micro_config(small_data_dir, str(tmp_path / "straight"))
    halves = micro_config(small_data_dir, str(tmp_path / "halves"), stop_at_step=4)
    train.main(straight)
    train.main(halves)
    train.main(dataclasses.replace(halves, stop_at_step=8))  # resume="auto" finds step 4
    assert [r["loss"] for r in train_records(straight)] == \
        [r["loss"] for r in train_records(halves)]
    assert_weights(checkpoint_weights(straight, 8), checkpoint_weights(halves, 8))


def test_sigterm_saves_exits_zero_and_resumes_exactly(small_data_dir, tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, exit code 0; resuming
    reaches the same weights, bit for bit, as a run that was never interrupted."""
    cfg = micro_config(small_data_dir, str(tmp_path / "killed"), total_steps=400,
                       stop_at_step=400, eval_every=1000, ckpt_every=1000, warmup_steps=10)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "train.py"] + cli_args(cfg), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or
                                      len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "stop requested" in output
    saved = checkpoint.find(cfg.out_dir, "auto")
    stopped_at = json.loads((saved / "train_state.json").read_text())["step"]
    assert 3 <= stopped_at < 400

    resumed = dataclasses.replace(cfg, stop_at_step=stopped_at + 2)
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
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4, ckpt_every=1)
    inject_nan_loss(monkeypatch, bad_steps={2}, accum=cfg.grad_accum_steps(1))
    train.main(cfg)
    # step index 2 is the third update: skipped, so the weights after it equal those before
    assert_weights(checkpoint_weights(cfg, 2), checkpoint_weights(cfg, 3))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r.get("skipped")] == [3]  # numbered as training rows
    assert train_records(cfg)[-1]["skipped_steps"] == 1


def test_consecutive_non_finite_steps_stop_the_run(small_data_dir, tmp_path, monkeypatch):
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2, max_bad_steps=2)
    inject_nan_loss(monkeypatch, bad_steps={2, 3, 4, 5, 6, 7}, accum=cfg.grad_accum_steps(1))
    with pytest.raises(RuntimeError, match="2 consecutive non-finite steps"):
        train.main(cfg)
    assert checkpoint.find(cfg.out_dir, "auto").name == "step_0000002"
    weights = checkpoint_weights(cfg, 2)
    assert all(torch.isfinite(w).all() for w in weights.values())


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
    with pytest.raises(RuntimeError, match="non-finite values; refusing"):
        train.main(cfg)
    assert checkpoint.find(cfg.out_dir, "auto").name == "step_0000002"


# --- config and data mistakes fail before compute ----------------------------------------

def test_missing_data_dir_names_the_prepare_command(tmp_path):
    cfg = micro_config(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    with pytest.raises((FileNotFoundError, ValueError), match="prepare.py"):
        train.main(cfg)


def test_tokenizer_larger_than_model_vocab_is_refused(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), **{"model.vocab_size": 256})
    with pytest.raises(ValueError, match="--model.vocab_size=512"):
        train.main(cfg)


def test_schedule_trap_is_refused_before_any_work(tmp_path):
    cfg = micro_config(str(tmp_path / "nowhere"), str(tmp_path), total_steps=100,
                       stop_at_step=95, decay_fraction=0.1)  # would stop mid-decay
    with pytest.raises(ValueError, match="decay"):
        train.main(cfg)


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
    out = train.export(cfg)
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
        cfg = config.apply_overrides(config.tiny(), {
            "out_dir": str(tmp_path / precision), "mixed_precision": precision,
            "compile_model": "false", "total_steps": 200, "stop_at_step": 200,
            "log_every": 10, "eval_every": 200, "ckpt_every": 1000})
        runs[precision] = train.main(cfg)
        runs[precision]["curve"] = [r["loss"] for r in train_records(cfg)]
    assert runs["bf16"]["val_loss"] == pytest.approx(runs["no"]["val_loss"], abs=0.05)
    late = list(zip(runs["bf16"]["curve"], runs["no"]["curve"], strict=True))[5:]
    assert max(abs(a - b) for a, b in late) < 0.1
