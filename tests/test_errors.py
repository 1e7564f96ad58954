"""A clumsy or hostile user: every mistake is one clear line and exit status 2, a diverging
run keeps no damage, a signal stops after the step in flight, metrics stay valid JSON."""

import dataclasses
import errno
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
import types
from pathlib import Path

import pytest
import torch

import config
import optim
import prepare
import report
import sample
import train
from conftest import micro_config
from model import Transformer
from test_train import REPO, cli_args, inject_nan_loss, train_records
from plumbing import checkpoint, cli, launch, log, overrides, shards

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
    (["--activation_recompute=half"], "is not none, full, every-N or selective"),
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
    (["--data_dir=a:0.7 b:0.3"], "write a mixture as DIR:W,DIR:W"),
    (["--presets", "tiny"], "did you mean --preset?"),
    (["--export"], "unknown config key 'export': train.py exports nothing: after training, "
                   "`python export.py OUT_DIR`"),  # the key is refused, not its missing value
    (["--export=out"], "`python export.py OUT_DIR` writes the newest checkpoint"),
    (["--source=corpus"], "unknown config key 'source': train.py reads prepared data: "
                          "`python prepare.py --source CORPUS --data_dir DIR`"),
    (["--frobnicate"], "unknown config key 'frobnicate'; see --help for every knob"),
    (["--force=true"], "--force: ignored explicit argument 'true' (the flag takes no value"),
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


@pytest.mark.parametrize("command, argv, message", [
    ("train", ["--preset=tinyy"], "argument --preset: invalid choice: 'tinyy'"),
    ("prepare", ["--vocab_size=many"], "argument --vocab_size: invalid int value: 'many'"),
    ("prepare", ["--force"], "unrecognized arguments: --force"),
    ("report", [], "the following arguments are required: OUT_DIR"),
    ("sample", ["--prompt=x"], "the following arguments are required: --export"),
])
def test_argparse_refusals_are_one_line_too(command, argv, message, capsys):
    """What argparse itself refuses, in every command, is the commands' one line and exit
    status 2, not its usage and a second line."""
    main = {"train": train.cli, "prepare": prepare.main, "report": report.cli,
            "sample": sample.main}[command]
    assert message in run_cli(argv, capsys, main)


@pytest.mark.parametrize("argv, message", [
    ([], "error: --world_size=N is required: the ranks of the launch"),
    (["--world_size=8", "--preset=tinyy"], "error: argument --preset: invalid choice: 'tinyy'"),
    (["--world_size=eight"], "error: argument --world_size: invalid int value: 'eight'"),
    (["--world_size=8", "--config=/nonexistent/run.toml"], "/nonexistent/run.toml"),
    (["--world_size=3"], "error: global_batch_tokens=524,288 is not divisible by"),
])
def test_config_py_refuses_in_one_line(argv, message):
    """`python config.py --world_size=N`, the command a launch script asks first, keeps the
    commands' contract without plumbing/cli.py: one `error:` line, exit status 2."""
    out = subprocess.run([sys.executable, "config.py", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_debug_shows_the_traceback_and_other_ranks_stay_quiet(monkeypatch, capsys):
    """Under a launcher rank 0 alone prints an error: a config's, and argparse's own."""
    with pytest.raises(ValueError, match="muon_peak_lr"):
        train.cli(["--muon_peak_lr=nan", "--debug"])
    assert run_cli(["--preset=tinyy"], capsys).endswith(" --help` lists the flags")
    monkeypatch.setenv("RANK", "1")
    for argv in (["--muon_peak_lr=nan"], ["--preset=tinyy"]):
        with pytest.raises(SystemExit) as exit_:
            train.cli(argv)
        assert exit_.value.code == 2 and capsys.readouterr().err == ""


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
    with pytest.raises(checkpoint.TrainingDiverged, match=r"--muon_peak_lr=1e\+06") as error:
        train.main(wild)
    bad = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text()
                                  .splitlines()) if r["kind"] == "skip"]
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "ckpt").glob("step_[0-9]*[0-9]"))
    assert bad and all(s < bad[0] - 1 for s in saved), (bad, saved)  # none of the damage
    assert "lr muon 1.00e+06 adamw 1.00e+06" in str(error.value)
    sane = dataclasses.replace(wild, muon_peak_lr=2e-2, adamw_peak_lr=1e-2, grad_clip=1.0)
    metrics = train.main(sane)
    assert math.isfinite(metrics["val_loss"]) and metrics["step"] == 8


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_same_command_resumes(
        small_data_dir, tmp_path, monkeypatch, capsys):
    """The disk fills while step 4's checkpoint is written (blocking, the default): one line
    names the step, the folder left incomplete, the disk, and the checkpoint the same command
    resumes from; once there is room, that command does, and trains to the end."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from test_checkpoint import disk_of
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2)
    root, write = tmp_path / "run" / "ckpt", FileSystemWriter.write_data

    def full_at_step_4(self, plan, planner):
        if "step_0000004" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, plan, planner)
    monkeypatch.setattr(FileSystemWriter, "write_data", full_at_step_4)
    err = run_cli(cli_args(cfg), capsys)
    assert err == (f"error: the checkpoint of step 4 failed while it was written: rank 0: "
                   f"OSError: [Errno 28] No space left on device; {root}/step_0000004.tmp is "
                   f"incomplete, and the newest complete checkpoint is still "
                   f"{root}/step_0000002; once there is room on the disk mounted at "
                   f"{disk_of(root)}, run the same command: it resumes from there")
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == ["step_0000002"]
    monkeypatch.setattr(FileSystemWriter, "write_data", write)  # room again
    train.cli(cli_args(cfg))
    assert f"resumed from {root}/step_0000002 at step 2" in capsys.readouterr().out
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == \
        ["step_0000002", "step_0000004", "step_0000006", "step_0000008"]
    assert not list(root.glob("*.tmp"))


@pytest.mark.parametrize("name, flags, where", [
    ("ckpt", ["--ckpt_async=true"], "where this run keeps its checkpoints (a folder)"),
    ("ckpt", [], "where this run keeps its checkpoints (a folder)"),
    ("tb", ["--tensorboard=true"], "where --tensorboard=true writes its folders")])
def test_a_file_where_a_runs_folder_goes_is_refused_before_the_model_is_built(
        name, flags, where, small_data_dir, tmp_path, monkeypatch, capsys):
    """A file of the user's at out_dir/ckpt (checkpoints, blocking or in the background) or
    out_dir/tb (--tensorboard=true), where the run makes a folder: one line naming it and the
    fix, before the model is built, and the file is kept as it was."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("mine")
    monkeypatch.setattr(train, "build_model", lambda *args: pytest.fail("the model was built"))
    err = run_cli(cli_args(micro_config(small_data_dir, str(out))) + flags, capsys)
    assert err == f"error: {out / name} is a file, {where}; move the file elsewhere, or " \
                  f"choose another --out_dir"
    assert (out / name).read_text() == "mine"


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


# --- the fix a message suggests works when followed ---------------------------------------

@pytest.mark.parametrize("raw", ["corpus", "data/corpus"])
def test_raw_text_gets_a_prepare_command_that_works(raw, tmp_path, monkeypatch, capsys):
    """--data_dir pointing at raw text (a folder of .txt, in the root or under data/) names
    the prepare command for it, into a folder that is not the source, at the model's vocab
    size; that command succeeds, and the folder it names is data the model can train on."""
    monkeypatch.chdir(tmp_path)
    texts = [p.read_text()[:300] for p in sorted(Path(sysconfig.get_paths()["stdlib"])
                                                 .glob("*.py"))[:100]]
    Path(raw).mkdir(parents=True)
    (Path(raw) / "a.txt").write_text("<|endoftext|>".join(texts * 3))  # 300 documents
    cfg = micro_config(raw, str(tmp_path / "out"))
    message = run_cli(cli_args(cfg), capsys)
    command = message.split("`")[1]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "prepare.py"] and f"--source {raw}" in command
    prepare.main(argv[2:])
    target = message.rsplit("--data_dir=", 1)[1]
    assert Path(target).resolve() != Path(raw).resolve() and f"--data_dir {target}" in command
    shards.check_sources([target], cfg.model.vocab_size)  # what train.py checks first


@pytest.mark.parametrize("spec", ["a:0.7 b:0.3", "a=0.7,b=0.3"])
def test_a_mixture_written_another_way_is_refused_with_the_form(spec):
    """Weights after spaces or equals signs are not read as one directory name: the message
    names the DIR:W,DIR:W form, and its example, followed, is the mixture meant."""
    with pytest.raises(ValueError, match="DIR:W,DIR:W") as error:
        config.parse_mixture(spec)
    example = str(error.value).rsplit("e.g. data_dir=", 1)[1]
    assert config.parse_mixture(example) == (("a", 0.7), ("b", 0.3))


def test_total_steps_below_the_presets_stop_names_stop_at_step():
    """tiny stops at step 300: --total_steps=50 alone is refused naming --stop_at_step, and
    the flag it names, added, makes a valid config."""
    with pytest.raises(ValueError, match="pass --stop_at_step=50 with it"):
        overrides.parse_args(["--preset", "tiny", "--total_steps=50"])
    cfg, _ = overrides.parse_args(["--preset", "tiny", "--total_steps=50", "--stop_at_step=50"])
    assert (cfg.total_steps, cfg.stop_at_step) == (50, 50)


# --- a plan that cannot fit ---------------------------------------------------------------

def fake_accelerator(device: str):
    """What log.check_memory reads of an Accelerator: one process, fp32."""
    return types.SimpleNamespace(num_processes=1, device=torch.device(device),
                                 mixed_precision="no")


def test_a_plan_past_the_ram_is_refused_before_any_work_and_force_overrides(tmp_path,
                                                                             capsys):
    """A model whose weights alone exceed any machine's RAM (a 10^12-token vocabulary) is
    refused in one line that names --preset tiny and --force, before its data is looked at
    (the data_dir does not even exist); with --force the run goes on to the data."""
    cfg = micro_config(str(tmp_path / "no-data"), str(tmp_path / "out"))
    huge = cli_args(cfg) + ["--model.vocab_size=1000000000000"]
    message = run_cli(huge, capsys)
    assert "GiB of RAM" in message and "--preset tiny" in message and "--force" in message
    assert "does not exist" in run_cli(huge + ["--force"], capsys)


def test_the_micro_batch_the_refusal_names_fits(small_data_dir, tmp_path, monkeypatch):
    """With RAM between the estimates of micro-batches 2 and 4 (computed here from the built
    model's and optimizers' own parameter counts), micro-batch 4 is refused naming
    --micro_batch_size=2, and micro-batch 2 passes the same check."""
    cfg = micro_config(small_data_dir, str(tmp_path))  # micro-batch 4; 1, 2 and 4 split it
    model = Transformer(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    n_muon = sum(p.numel() for g in optim.build_optimizers(model, cfg).named["muon"]
                 .param_groups for p in g["params"])

    def need(micro: int) -> float:
        plan = dataclasses.replace(cfg, micro_batch_size=micro)
        return log.memory_estimate(plan, n_params, n_muon, 1, False, False)["total"]
    ram = (need(2) / 0.9 + need(4)) / 2
    assert need(2) < 0.9 * ram < ram < need(4)
    monkeypatch.setattr(log, "memory_capacity", lambda device: (ram, "this test's RAM"))
    with pytest.raises(ValueError, match=r"use --micro_batch_size=2 \(estimate"):
        log.check_memory(cfg, fake_accelerator("cpu"), sharded=False, force=False)
    smaller = dataclasses.replace(cfg, micro_batch_size=2)
    assert log.check_memory(smaller, fake_accelerator("cpu"), sharded=False, force=False) == []


def test_on_a_gpu_a_plan_past_its_memory_is_a_warning(tmp_path, monkeypatch):
    """The GPU branch, with the device's properties stood in: past its memory the plan is
    warned about, naming the GPU, and not refused (no --force needed)."""
    cfg = micro_config(str(tmp_path), str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=2**20, name="H0"))
    [warning] = log.check_memory(cfg, fake_accelerator("cuda"), sharded=False, force=False)
    assert warning.startswith("warning: the memory estimate") and "GPU's 0.0 GiB (H0)" in warning
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=2**40, name="H0"))
    assert log.check_memory(cfg, fake_accelerator("cuda"), sharded=False, force=False) == []


# --- a finished run, and a stop ------------------------------------------------------------

def test_a_finished_run_says_there_is_nothing_to_train(small_data_dir, tmp_path, capsys,
                                                       monkeypatch):
    """The same command again after a run finished: one line naming both fixes, exit status
    0, no model built (test_resume.py: nothing written). From that checkpoint into a new
    out_dir: the line names the later --stop_at_step, and that fix, followed, trains on."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(train, "build_model", lambda *a: pytest.fail("built a model"))
        train.cli(cli_args(cfg))  # returns: exit status 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line == (f"nothing to train: {tmp_path / 'ckpt' / 'step_0000004'} is at step 4, "
                        f"and this run stops at stop_at_step=4; pass a new --out_dir to train "
                        f"afresh, or a later --stop_at_step to continue it")
        with pytest.raises(cli.NothingToDo, match="pass a later --stop_at_step"):
            train.main(dataclasses.replace(cfg, out_dir=str(tmp_path / "branch"),
                                           resume=str(tmp_path / "ckpt" / "step_0000004")))
    assert train.main(dataclasses.replace(cfg, stop_at_step=6))["step"] == 6


def test_ctrl_c_is_acknowledged_at_once_and_a_second_one_quits_in_one_line(small_data_dir,
                                                                           tmp_path):
    """A real Ctrl-C (SIGINT) to `python train.py` in a step of thousands of micro-batches:
    the acknowledgement comes at once, not when the step ends; a second Ctrl-C quits with
    one line, no traceback, exit status 130, and nothing saved."""
    cfg = micro_config(small_data_dir, str(tmp_path / "out"), global_batch_tokens=2**20)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "train.py", *cli_args(cfg)], cwd=REPO, env=env,
                                stdout=stdout, stderr=stderr)

    def wait_for(path: Path, text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while text not in path.read_text():
            if time.monotonic() > deadline or proc.poll() is not None:
                return False
            time.sleep(0.05)
        return True
    try:
        assert wait_for(out, "eval      0 |", 120), out.read_text() + err.read_text()
        proc.send_signal(signal.SIGINT)  # step 1 has begun: 4,096 micro-batches
        ack = launch.StopFlag.ACKNOWLEDGEMENT.decode()
        assert wait_for(err, ack, 5), err.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert err.read_text() == ack + launch.StopFlag.QUIT + "\n"
    assert not (tmp_path / "out" / "ckpt").exists()
