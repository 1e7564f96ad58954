"""A clumsy or hostile user: every mistake is one clear line and exit status 2, a diverging
run keeps no damage, a signal stops after the step in flight, metrics stay valid JSON."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

import pytest

import optim
import train
from conftest import micro_config
from test_train import REPO, cli_args, inject_nan_loss, train_records

# (extra command-line flags, a fragment the one-line message must contain). Each is a
# mistake on top of a valid config; "{data}" and "{out}" name a prepared data dir and a
# fresh out_dir.
BAD_FLAGS = [
    (["--warmup_step=10"], "did you mean --warmup_steps?"),
    (["--muon_peak_lr=nan"], "muon_peak_lr=nan must be a positive, finite number"),
    (["--adamw_peak_lr=inf"], "adamw_peak_lr=inf must be a positive, finite number"),
    (["--adamw_peak_lr=-1"], "adamw_peak_lr=-1.0 must be a positive"),
    (["--betas=0.9"], "betas=(0.9,) must be two numbers in [0, 1)"),
    (["--betas=0.9,1.5"], "betas=(0.9, 1.5) must be two numbers in [0, 1)"),
    (["--betas=a,b"], "--betas='a': expected float"),
    (["--seq_len=abc"], "--seq_len='abc': expected int"),
    (["--seq_len=65"], "exceeds model.max_seq_len=64"),
    (["--compile_model=maybe"], "compile_model='maybe' is not one of"),
    (["--mixed_precision=fp16"], "mixed_precision='fp16' is not one of"),
    (["--decay_shape=exp"], "decay_shape='exp' is not one of"),
    (["--activation_recompute=half"], "is not none, full or every-N"),
    (["--global_batch_tokens=1000"], "global_batch_tokens=1,000 is not divisible"),
    (["--stop_at_step=9"], "stop_at_step=9 is past total_steps=8"),
    (["--warmup_steps=7"], "exceed total_steps=8"),
    (["--total_steps=100", "--stop_at_step=95", "--decay_fraction=0.1"], "mid-decay"),
    (["--decay_fraction=1.5"], "decay_fraction=1.5 must be within [0, 1]"),
    (["--final_frac=-0.1"], "final_frac=-0.1 must be within [0, 1]"),
    (["--weight_decay=-1"], "weight_decay=-1.0 must be a finite number >= 0"),
    (["--grad_clip=nan"], "grad_clip=nan must be a finite number >= 0"),
    (["--muon_momentum=1.0"], "muon_momentum=1.0 must be within [0, 1)"),
    (["--model.n_heads=3"], "not divisible by model.n_heads=3"),
    (["--model.n_kv_heads=3"], "model.n_kv_heads=3 does not divide"),
    (["--model.vocab_size=0"], "model.vocab_size=0 must be positive"),
    (["--model.vocab_size=256"], "set --model.vocab_size=512"),
    (["--max_bad_steps=0"], "max_bad_steps=0 must be a positive"),
    (["tiny"], "write overrides as --key=value"),
    (["--config=/nonexistent/run.toml"], "no such file"),
    (["--data_dir=/nonexistent/data"], "python prepare.py"),
    (["--resume=/nonexistent/step_0000004"], "no train_state.json there"),
    (["--out_dir={out}/file"], "is a file, not a directory"),
]

BAD_TOML = [
    ("betas = 0.9\n", "betas = 0.9: expected a list of numbers"),
    ("eval_tokens = 1e3\n", "eval_tokens = 1000.0: expected an integer"),
    ("total_steps = true\n", "total_steps = True: expected an integer"),
    ("compile_model = true\n", "compile_model = True: expected a quoted string"),
    ("[model]\nn_layers = 2.5\n", "model.n_layers = 2.5: expected an integer"),
    ("warmup_steps = \n", "--config"),
]


def run_cli(argv, capsys, command=None) -> str:
    """The command's (train.cli's unless given) exit status must be 2 and its stderr exactly
    one `error:` line."""
    with pytest.raises(SystemExit) as exit_:
        (command or train.cli)(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_a_bad_flag_is_one_clear_line(flags, message, small_data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    base = cli_args(micro_config(small_data_dir, str(tmp_path / "out")))
    flags = [f.format(out=tmp_path) for f in flags]
    assert message in run_cli(base + flags, capsys)


@pytest.mark.parametrize("toml, message", BAD_TOML)
def test_a_bad_toml_value_is_one_clear_line(toml, message, small_data_dir, tmp_path, capsys):
    """The flags win over the file, so the base config leaves out the key the file sets."""
    (tmp_path / "run.toml").write_text(toml)
    key = toml.split("=")[0].split("\n")[-1].strip()
    base = [a for a in cli_args(micro_config(small_data_dir, str(tmp_path / "out")))
            if not a.startswith((f"--{key}=", f"--model.{key}="))]
    assert message in run_cli(base + [f"--config={tmp_path / 'run.toml'}"], capsys)


def test_debug_shows_the_traceback_and_other_ranks_stay_quiet(monkeypatch, capsys):
    with pytest.raises(ValueError, match="muon_peak_lr"):
        train.cli(["--muon_peak_lr=nan", "--debug"])
    monkeypatch.setenv("RANK", "1")  # under a launcher, rank 0 alone prints the error
    with pytest.raises(SystemExit):
        train.cli(["--muon_peak_lr=nan"])
    assert capsys.readouterr().err == ""


def test_the_command_line_itself_prints_no_traceback():
    out = subprocess.run([sys.executable, "train.py", "--muon_peak_lr=nan"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: muon_peak_lr=nan must be a positive, finite number"


def test_a_diverging_run_checkpoints_no_damage_and_the_advice_works(small_data_dir, tmp_path):
    """lr 1e6: the losses go non-finite and the run stops, naming the learning rates. No
    checkpoint is written during the streak, so the rerun the message advises (the same
    command with sane rates) resumes from clean weights and trains to the end."""
    wild = micro_config(small_data_dir, str(tmp_path), muon_peak_lr=1e6, adamw_peak_lr=1e6,
                        grad_clip=0.0, ckpt_every=1, max_bad_steps=2, warmup_steps=0)
    with pytest.raises(train.TrainingDiverged, match=r"--muon_peak_lr=1e\+06") as error:
        train.main(wild)
    bad = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text()
                                  .splitlines()) if r["kind"] == "skip"]
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "ckpt").glob("step_[0-9]*[0-9]"))
    assert bad and all(s < bad[0] - 1 for s in saved), (bad, saved)  # none of the damage
    assert "lr muon 1.00e+06 adamw 1.00e+06" in str(error.value)
    sane = dataclasses.replace(wild, muon_peak_lr=2e-2, adamw_peak_lr=1e-2, grad_clip=1.0)
    metrics = train.main(sane)
    assert math.isfinite(metrics["val_loss"]) and metrics["step"] == 8


def test_a_signal_stops_after_the_step_in_flight(small_data_dir, tmp_path):
    """SIGTERM delivered in the middle of step 3 (inside the optimizer step): the run
    finishes that step, saves step 3 and returns; it does not run step 4."""
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=100)
    original, calls = optim.Optimizers.step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        original(self)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optim.Optimizers, "step", step)
        train.main(cfg)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_0000003"]
    assert [r["step"] for r in train_records(cfg)] == [1, 2, 3]


def test_metrics_are_valid_json_on_every_line(small_data_dir, tmp_path, monkeypatch):
    """A NaN loss is written as null (strict JSON), and the skipped step's line carries the
    step number of the training rows."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    inject_nan_loss(monkeypatch, bad_steps={1}, accum=cfg.grad_accum_steps(1))
    train.main(cfg)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    lines = [json.loads(x, parse_constant=refuse)
             for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in lines if r["kind"] == "skip"]
    assert skipped == [{"kind": "skip", "step": 2, "loss": None, "grad_norm": None}]
    assert [r["step"] for r in lines if "lr_muon" in r] == [1, 2, 3, 4]
    assert next(r for r in lines if r.get("step") == 2 and "lr_muon" in r)["loss"] is None
