"""Resuming off the golden path: the command line wins, fixed knobs are refused, damaged or
hostile checkpoints never load, and nothing overwrites a previous run."""

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import export
import optim
import train
from conftest import micro_config
from model import Transformer
from test_errors import run_cli
from test_train import cli_args
from plumbing import checkpoint, cli, overrides
from plumbing import resume as resume_lib

REPO = Path(__file__).resolve().parent.parent


def records(cfg) -> list[dict]:
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def ckpt(cfg, step: int) -> Path:
    return Path(cfg.out_dir) / "ckpt" / f"step_{step:07d}"


class RunsCode:
    """Unpickling this creates `marker`: what a hostile checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_hostile_dcp_metadata_runs_no_code_on_resume_or_export(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    marker = tmp_path / "pwned"
    (ckpt(cfg, 4) / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(checkpoint.UnsafeCheckpointError,
                       match=r"holds a reference to pathlib\.Path\.touch"):
        export.export(cfg.out_dir)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="could run code"):
        train.main(dataclasses.replace(cfg, stop_at_step=8))
    assert not marker.exists()


class MakesDir:
    """Unpickling this creates the directory `marker` (os.mkdir, as the issue's payload did)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture(scope="module")
def trained(small_data_dir, tmp_path_factory):
    """A 4-step run whose step-4 checkpoint the poisoning tests copy."""
    cfg = micro_config(small_data_dir, str(tmp_path_factory.mktemp("trained")), stop_at_step=4)
    train.main(cfg)
    return cfg


def poison(cfg, path: Path, kind: str, payload) -> str:
    """Re-save checkpoint `path` with `payload` in place of its first entry whose value is of
    type `kind` (the non-tensor values of the optimizers' param groups: str, float, int,
    bool, None, tuple, list), or of a weight ("tensor": a model entry becomes a pickled
    object); return the entry's name. The checkpoint is read back with DCP's own planner:
    it is this test's, trusted."""
    model = Transformer(cfg.model)
    optimizers = list(optim.build_optimizers(model, cfg).named.values())
    model_sd, optim_sd = get_state_dict(model, optimizers)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path))
    if kind == "tensor":
        where, key = sd["model"], "norm.weight"
    else:
        where = next(g for g in sd["optim"]["param_groups"]
                     if any(type(v).__name__ == kind for v in g.values()))
        key = next(k for k, v in where.items() if type(v).__name__ == kind)
    where[key] = payload
    dcp.save(sd, checkpoint_id=str(path))
    if kind == "tensor":
        return f"model.{key}"
    return f"optim.param_groups.{sd['optim']['param_groups'].index(where)}.{key}"


@pytest.mark.parametrize("kind", ["str", "float", "int", "bool", "NoneType", "tuple", "list",
                                  "tensor"])
def test_a_payload_in_any_checkpoint_entry_is_refused_and_runs_nothing(trained, tmp_path,
                                                                       capsys, kind):
    """DCP's default planner unpickles every entry that is not a tensor with full pickle. A
    checkpoint re-saved with a payload (its __reduce__ is os.mkdir) in one entry of each kind
    it holds: the resume command refuses it in one line naming the checkpoint and the entry,
    exit 2, and nothing ran (no directory was made). export.py reads only the weights: a
    payload among them is refused the same way; one in the optimizers' entries is never
    unpickled at all."""
    out_dir = tmp_path / "run"
    shutil.copytree(trained.out_dir, out_dir)
    cfg = dataclasses.replace(trained, out_dir=str(out_dir), stop_at_step=8)
    marker = tmp_path / "pwned"
    entry = poison(cfg, ckpt(cfg, 4), kind, MakesDir(marker))
    with pytest.raises(SystemExit) as exit_:
        train.cli(cli_args(cfg))
    line = capsys.readouterr().err
    assert exit_.value.code == 2 and not marker.exists()
    assert line == (f"error: {ckpt(cfg, 4)}: entry {entry}: holds a reference to "
                    f"posix.mkdir, which a checkpoint this trainer wrote never does; "
                    f"refusing to read it (unpickling it could run code). Delete this "
                    f"checkpoint folder or replace it with one this trainer wrote\n")
    assert records(cfg)[-1]["step"] == 4  # nothing trained
    if kind == "tensor":
        with pytest.raises(SystemExit) as exit_:
            export.main([cfg.out_dir])
        assert exit_.value.code == 2 and f"entry {entry}: holds a reference" in \
            capsys.readouterr().err
    else:
        export.main([cfg.out_dir])
    assert not marker.exists()


def test_a_branched_run_stopped_past_its_branch_point_continues_from_its_own_checkpoint(
        small_data_dir, tmp_path, capsys, monkeypatch):
    """README's anneal: a stable run to step 2, then an anneal into its own out_dir with
    --resume=the stable checkpoint. A SIGTERM at step 5 saves step 5; the same command again
    continues from the anneal's own step 5 and says so, not from the branch point, and logs
    bitwise the losses of an anneal never stopped; nothing is set aside as .replaced. The
    branch point is not read again: the stable run's folder may have moved meanwhile."""
    stable = micro_config(small_data_dir, str(tmp_path / "stable"), stop_at_step=2)
    train.main(stable)
    branch_point = ckpt(stable, 2)
    anneal = dataclasses.replace(stable, out_dir=str(tmp_path / "anneal"),
                                 resume=str(branch_point), stop_at_step=8)
    straight = dataclasses.replace(anneal, out_dir=str(tmp_path / "straight"))
    train.main(straight)
    step = train.train_step

    def stopped_at_5(run, stop):
        if run.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(run, stop)
    monkeypatch.setattr(train, "train_step", stopped_at_5)
    train.main(anneal)
    monkeypatch.setattr(train, "train_step", step)
    assert checkpoint.newest(anneal.out_dir) == str(ckpt(anneal, 5))
    capsys.readouterr()
    (tmp_path / "stable").rename(tmp_path / "stable-moved")
    train.main(anneal)  # the same command
    assert f"resumed from {ckpt(anneal, 5)} at step 5 (its own; --resume={branch_point} is " \
           f"where this run began" in capsys.readouterr().out
    losses = {r["step"]: r["loss"] for r in records(anneal) if r["kind"] == "train"}
    assert losses == {r["step"]: r["loss"] for r in records(straight) if r["kind"] == "train"}
    assert sorted(p.name for p in ckpt(anneal, 5).parent.iterdir()) == \
        ["step_0000004", "step_0000005", "step_0000008"]


def test_resume_applies_the_new_learning_rates_and_says_so(small_data_dir, tmp_path, capsys):
    """Loading optimizer state restores the checkpoint's param-group values; the run must
    train at the rates of its own command line, and print what changed."""
    first = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(first)
    resumed = dataclasses.replace(first, stop_at_step=8, muon_peak_lr=2e-3, adamw_peak_lr=1e-3,
                                  weight_decay=0.05, betas=(0.8, 0.9))
    seen = {}
    original = train.train_step

    def spy(run, stop):
        for name, opt in run.optimizers.named.items():
            seen[name] = [(g["peak_lr"], g["weight_decay"], g.get("betas"))
                          for g in opt.param_groups]
        return original(run, stop)
    train.train_step = spy
    try:
        train.main(resumed)
    finally:
        train.train_step = original
    out = capsys.readouterr().out
    assert "resume: muon_peak_lr 0.02 → 0.002" in out
    assert "resume: adamw_peak_lr 0.01 → 0.001" in out
    assert seen["muon"] == [(2e-3, 0.05, None)]
    assert seen["adamw"] == [(1e-3, 0.05, (0.8, 0.9)), (1e-3, 0.0, (0.8, 0.9))]
    step5 = next(r for r in records(resumed) if r.get("step") == 5 and "lr_muon" in r)
    multiplier = step5["lr_adamw"] / 1e-3
    assert step5["lr_muon"] == pytest.approx(2e-3 * multiplier)


def test_resume_refuses_a_different_model_shape_naming_both_values(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    wider = micro_config(small_data_dir, str(tmp_path), stop_at_step=8,
                         **{"model.n_layers": 3, "seed": 7})
    with pytest.raises(ValueError, match=r"model.n_layers 2 → 3.*seed 1337 → 7|"
                                         r"seed 1337 → 7.*model.n_layers 2 → 3"):
        train.main(wider)


def test_resume_refuses_other_data(small_data_dir, tmp_path):
    """A shard re-prepared between save and resume (manifest.json changes with it, so the
    data is consistent, only not the data the checkpoint was trained on)."""
    data_dir = tmp_path / "data"
    shutil.copytree(small_data_dir, data_dir)
    cfg = micro_config(str(data_dir), str(tmp_path / "out"), stop_at_step=4)
    train.main(cfg)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    shard = manifest["splits"]["val"]["shards"][0]
    tokens = np.fromfile(data_dir / shard["file"], dtype=manifest["dtype"])
    tokens[1:] = tokens[1:][::-1]  # other text: the same tokens in another order
    tokens.tofile(data_dir / shard["file"])
    shard["sha256"] = hashlib.sha256((data_dir / shard["file"]).read_bytes()).hexdigest()
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"source {data_dir} changed since the checkpoint"):
        train.main(dataclasses.replace(cfg, stop_at_step=8))


def test_resume_none_never_overwrites_checkpoints(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    before = (ckpt(cfg, 4) / "train_state.json").read_text()
    with pytest.raises(ValueError, match="already holds checkpoints.*new --out_dir"):
        train.main(dataclasses.replace(cfg, resume="none"))
    assert (ckpt(cfg, 4) / "train_state.json").read_text() == before


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(small_data_dir, tmp_path,
                                                                    capsys):
    """A truncated .distcp in the newest checkpoint: a warning names it, the folder is kept
    as step_0000004.damaged (the resumed run writes a new step 4 beside it, not over it),
    and the run resumes from the previous one, reaching the same weights as a run never
    interrupted."""
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    shard = next(ckpt(cfg, 4).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    evidence = {p.name: p.read_bytes() for p in ckpt(cfg, 4).iterdir()}
    resumed = dataclasses.replace(cfg, stop_at_step=6)
    train.main(resumed)
    out = capsys.readouterr().out
    kept = ckpt(cfg, 4).with_name("step_0000004.damaged")
    assert f"skipping damaged checkpoint: {shard} is cut short: " in out  # DCP's file, named
    assert f"kept as {kept}" in out
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == evidence
    assert checkpoint.read_train_state(ckpt(cfg, 4))["step"] == 4  # the resumed run's own
    assert f"resumed from {ckpt(cfg, 2)} at step 2" in out
    straight = micro_config(small_data_dir, str(tmp_path / "straight"), ckpt_every=2,
                            stop_at_step=6)
    train.main(straight)
    a = torch.load(ckpt(cfg, 6) / "rng_rank0.pt", weights_only=True)
    b = torch.load(ckpt(straight, 6) / "rng_rank0.pt", weights_only=True)
    assert torch.equal(a["torch"], b["torch"])
    losses = [r["loss"] for r in records(resumed) if "loss" in r and r["step"] > 4]
    assert losses == [r["loss"] for r in records(straight) if "loss" in r and r["step"] > 4]
    # An explicit --resume=PATH to a damaged checkpoint is one clear refusal.
    shard = next(ckpt(cfg, 6).glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot be read"):
        train.main(dataclasses.replace(cfg, stop_at_step=8, resume=str(ckpt(cfg, 6))))


def test_a_run_resumed_from_an_older_checkpoint_keeps_the_newer_one(small_data_dir, tmp_path):
    """--resume=PATH to step 2 while step 4 exists: the branch's own step 4 is written, and
    the first run's step 4 is kept, byte for byte, as step_0000004.replaced."""
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    before = {p.name: p.read_bytes() for p in ckpt(cfg, 4).iterdir()}
    train.main(dataclasses.replace(cfg, resume=str(ckpt(cfg, 2)), muon_peak_lr=1e-3))
    kept = ckpt(cfg, 4).with_name("step_0000004.replaced")
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    assert json.loads((ckpt(cfg, 4) / "train_state.json").read_text())["config"][
        "muon_peak_lr"] == 1e-3


@pytest.mark.parametrize("out_dir, resume", [
    ("run", "{tmp}/run/ckpt/step_0000002"),  # out_dir relative, --resume absolute
    ("{tmp}/run", "run/ckpt/step_0000002"),  # the reverse
    ("run", "link/ckpt/step_0000002"),  # --resume through a symlink to out_dir
    ("link", "{tmp}/run/ckpt/step_0000002")])  # out_dir through the symlink
def test_resume_naming_one_of_the_runs_own_checkpoints_is_taken_however_it_is_spelt(
        small_data_dir, tmp_path, monkeypatch, capsys, out_dir, resume):
    """--resume=PATH to one of out_dir's own checkpoints is taken as named: the run goes back
    to step 2 and trains step 3 again, bitwise as the run that never resumed trained it (an
    oracle no resume code ran). Taken for a branch origin, it would continue its own newest
    (step 4) instead, with nothing left to train."""
    monkeypatch.chdir(tmp_path)
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    (tmp_path / "link").symlink_to(tmp_path / "run")
    resume = resume.format(tmp=tmp_path)
    capsys.readouterr()
    train.main(dataclasses.replace(cfg, out_dir=out_dir.format(tmp=tmp_path), resume=resume,
                                   stop_at_step=3))
    assert f"resumed from {resume} at step 2\n" in capsys.readouterr().out
    straight, again = [r["loss"] for r in records(cfg) if r["kind"] == "train" and r["step"] == 3]
    assert again == straight


@pytest.mark.parametrize("damage", [b'{"step": 4, "tokens', b"\xff\xfe\x00garbled", b"{}",
                                    b"[4]"])
def test_a_newest_checkpoint_whose_train_state_is_damaged_falls_back_to_the_one_before(
        small_data_dir, tmp_path, capsys, damage):
    """README's fallback for a train_state.json cut short, garbled, or JSON without a
    checkpoint's fields, as for a damaged tensor file: a warning that names the file, the
    folder kept as step_0000004.damaged, and the run continues from step 2, bitwise as the
    run that never stopped (its first start's records); no traceback."""
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    (ckpt(cfg, 4) / "train_state.json").write_bytes(damage)
    capsys.readouterr()
    train.cli(cli_args(cfg))
    out, err = capsys.readouterr()
    assert f"warning: skipping damaged checkpoint: {ckpt(cfg, 4)}: train_state.json" in out
    assert f"resumed from {ckpt(cfg, 2)} at step 2\n" in out and "Traceback" not in err
    assert (ckpt(cfg, 4).with_name("step_0000004.damaged") / "train_state.json").read_bytes() \
        == damage
    losses = {}
    for record in (r for r in records(cfg) if r["kind"] == "train"):
        losses.setdefault(record["step"], []).append(record["loss"])
    assert losses[3][0] == losses[3][1] and losses[4][0] == losses[4][1]


def test_rerunning_a_finished_run_trains_nothing_and_rewrites_nothing(small_data_dir, tmp_path):
    """The very end: the same command again after the last step says there is nothing to
    train (cli.NothingToDo: one line, exit status 0; tests/test_errors.py reads the line),
    and writes nothing: no record, no checkpoint (its own last one is not written again,
    nor set aside as replaced)."""
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    before = {p.name: p.read_bytes() for p in ckpt(cfg, 4).iterdir()}
    log_before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(cli.NothingToDo, match="nothing to train"):
        train.main(cfg)
    assert (tmp_path / "metrics.jsonl").read_text() == log_before
    assert sorted(p.name for p in ckpt(cfg, 4).parent.iterdir()) == ["step_0000004"]
    assert {p.name: p.read_bytes() for p in ckpt(cfg, 4).iterdir()} == before


def test_a_hostile_rng_file_stops_the_run_as_unsafe(small_data_dir, tmp_path):
    """An rng_rank0.pt that torch.load(weights_only=True) refuses could run code if read
    any other way: the run stops and names it, nothing runs, and the checkpoint stays as
    it is (no fallback to an older one, no renaming: a person decides)."""
    cfg = micro_config(small_data_dir, str(tmp_path), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    marker = tmp_path / "pwned"
    torch.save(MakesDir(marker), ckpt(cfg, 4) / "rng_rank0.pt")
    with pytest.raises(checkpoint.UnsafeCheckpointError,
                       match=f"^{ckpt(cfg, 4)}/rng_rank0.pt: holds a reference to posix.mkdir"):
        train.main(dataclasses.replace(cfg, stop_at_step=6))
    assert not marker.exists()
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == \
        ["step_0000002", "step_0000004"]
    assert records(cfg)[-1]["step"] == 4  # nothing trained


def test_a_truncated_rng_file_is_damaged_not_unsafe(tmp_path):
    """The other side of that line: a file cut short is damaged (fall back), not hostile."""
    rng = tmp_path / "rng_rank0.pt"
    torch.save(checkpoint.rng_state(), rng)
    rng.write_bytes(rng.read_bytes()[: rng.stat().st_size // 2])
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"^{rng}: "):
        with checkpoint.reading(rng):
            checkpoint.read_tensors(rng)


def test_a_resume_that_names_no_checkpoint_is_refused_with_its_fix(small_data_dir, tmp_path,
                                                                   capsys):
    """Checked even where out_dir holds checkpoints of its own (--resume=latest was taken
    there as a branch origin, never read, and the run went on from its own newest): another
    word for the newest (other trainers', or stacklm's old auto) names --resume=latest; a checkpoint's train_state.json names
    its folder. A folder without one says so where it would be read (a branch's origin is
    not, once out_dir has its own: README)."""
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    base = cli_args(dataclasses.replace(cfg, stop_at_step=6))
    state = ckpt(cfg, 4) / "train_state.json"
    for resume, message in [
            ("auto", "error: resume=auto: the newest checkpoint is --resume=latest here (the "
                       "default); or name a checkpoint folder, out_dir/ckpt/step_XXXXXXX"),
            (str(state), f"error: resume={state} is the checkpoint's train_state.json; name the "
                         f"folder that holds it: --resume={ckpt(cfg, 4)}"),
            (str(ckpt(cfg, 4) / "nowhere"), f"error: resume={ckpt(cfg, 4) / 'nowhere'}: "
                                             f"no train_state.json there")]:
        assert run_cli(base + [f"--resume={resume}"], capsys).startswith(message)
    assert records(cfg)[-1]["step"] == 4  # nothing trained


@pytest.mark.parametrize("knob, value", [("matrix_optimizer", "adamw"), ("seq_len", 32),
                                         ("seed", 7), ("model.n_layers", 3)])
def test_a_resume_may_not_change_what_the_checkpoint_fixes(knob, value, small_data_dir):
    """README: the model's shape, seq_len, seed and matrix_optimizer cannot change on a
    resume; the refusal names the knob and both values. (A changed matrix_optimizer would
    otherwise meet another optimizer's state in DCP's load and read as a damaged checkpoint,
    set aside.)"""
    saved = micro_config(small_data_dir, "out")
    resumed = overrides.apply_overrides(saved, {knob: value})
    old = saved.model.n_layers if knob == "model.n_layers" else getattr(saved, knob)
    with pytest.raises(ValueError, match=f"^resume: {knob} {old!r} → {value!r} cannot change "
                                         f"on a resume"):
        resume_lib.resume_changes(resumed, dataclasses.asdict(saved))


def test_out_dir_that_is_a_file_is_refused(small_data_dir, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        train.main(micro_config(small_data_dir, str(tmp_path / "file")))
    assert os.path.getsize(tmp_path / "file") == 0


# --- checkpoints written in the background (ckpt_async) --------------------------------

@pytest.fixture(scope="module")
def async_and_blocking(small_data_dir, tmp_path_factory) -> tuple:
    """The same 8-step run checkpointing every 2 steps: blocking, and in the background
    (steps 2, 4 and 6; the last step's save blocks)."""
    root = tmp_path_factory.mktemp("async")
    blocking = micro_config(small_data_dir, str(root / "blocking"), ckpt_every=2)
    background = dataclasses.replace(blocking, out_dir=str(root / "async"), ckpt_async=True)
    train.main(blocking)
    train.main(background)
    return blocking, background


def test_async_checkpoints_are_the_blocking_ones_bitwise(async_and_blocking):
    """Losses and every checkpoint's tensors (weights and both optimizers' state, read by
    DCP's own consolidation) are the blocking run's bit for bit; each background checkpoint
    is logged once complete, in order, and no scratch folder is left."""
    from test_checkpoint import every_tensor
    blocking, background = async_and_blocking
    train_losses = [[r["loss"] for r in records(c) if r["kind"] == "train"]
                    for c in (blocking, background)]
    assert train_losses[0] == train_losses[1]
    for step in (2, 4, 6, 8):
        ours, theirs = every_tensor(ckpt(background, step)), every_tensor(ckpt(blocking, step))
        assert ours.keys() == theirs.keys() and len(ours) > 20
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), step
    logged = [r for r in records(background) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in logged] == [2, 4, 6, 8]
    assert all(r["write_seconds"] >= r["seconds"] for r in logged)
    assert not list(Path(background.out_dir, "ckpt").glob("*.tmp"))


def test_a_run_resumed_from_an_async_checkpoint_continues_bitwise(async_and_blocking,
                                                                 tmp_path):
    """A background checkpoint (step 4) continued in a new folder logs the blocking run's
    losses from step 5 on, bit for bit."""
    blocking, background = async_and_blocking
    branch = dataclasses.replace(background, out_dir=str(tmp_path / "branch"),
                                 resume=str(ckpt(background, 4)))
    train.main(branch)
    ours = {r["step"]: r["loss"] for r in records(branch) if r["kind"] == "train"}
    theirs = {r["step"]: r["loss"] for r in records(blocking) if r["kind"] == "train"}
    assert sorted(ours) == [5, 6, 7, 8] and ours == {s: theirs[s] for s in ours}


def test_a_sigterm_with_a_save_in_flight_completes_it_then_saves_its_step(
        small_data_dir, tmp_path, monkeypatch):
    """SIGTERM while step 4's checkpoint is still being written (slowly, here): the run
    finishes that save, saves the step it stops at (5), and ends "stopped" with both
    complete and nothing left half-written."""
    from test_checkpoint import slow_writes
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=4, ckpt_async=True)
    save, in_flight = checkpoint.Saver.save, []

    def signalled(self, *args, **kwargs):
        done = save(self, *args, **kwargs)
        if self.in_flight is not None:  # the background save has begun
            in_flight.append(self.in_flight.step)
            os.kill(os.getpid(), signal.SIGTERM)
        return done
    monkeypatch.setattr(checkpoint.Saver, "save", signalled)
    slow_writes(monkeypatch, 0.5)
    train.main(cfg)
    assert in_flight == [4]
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == \
        ["step_0000004", "step_0000005"]
    assert not list(Path(cfg.out_dir, "ckpt").glob("*.tmp"))
    assert [r["outcome"] for r in records(cfg) if r["kind"] == "end"] == ["stopped"]
    assert [r["step"] for r in records(cfg) if r["kind"] == "checkpoint"] == [4, 5]


# Runs train.py's command with DCP's writer slowed (a save stays in flight for a while).
SLOW_WRITER = """
import sys, time
from torch.distributed.checkpoint.filesystem import FileSystemWriter
write = FileSystemWriter.write_data
def slow(self, plan, planner):
    time.sleep(2.0)
    return write(self, plan, planner)
FileSystemWriter.write_data = slow
sys.argv = ["train.py", *sys.argv[1:]]
import train
train.cli()
"""


def test_a_kill_during_a_background_save_resumes_bitwise_from_the_one_before(
        async_and_blocking, tmp_path):
    """kill -9 while step 4's checkpoint is written in the background: step 2's stays the
    newest (the half-written folder is never resumed from), and the same command again
    finishes with the blocking run's final weights and optimizer state, bit for bit."""
    from test_checkpoint import every_tensor
    blocking, background = async_and_blocking
    cfg = dataclasses.replace(background, out_dir=str(tmp_path / "killed"))
    args = cli_args(cfg)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    scratch = ckpt(cfg, 4).with_name("step_0000004.tmp")
    deadline = time.time() + 120
    while not (scratch / "train_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == ["step_0000002"]
    train.main(cfg)  # the same command: resumes from step 2
    ours, theirs = every_tensor(ckpt(cfg, 8)), every_tensor(ckpt(blocking, 8))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_an_error_with_a_save_in_flight_leaves_it_uncounted_and_the_same_command_resumes(
        async_and_blocking, tmp_path, monkeypatch):
    """The run stops on an error (a bug in step 5, here) while step 4's checkpoint is still
    written in the background: it stays step_0000004.tmp, is never counted (no checkpoint
    record, not resumed from), and the same command resumes from step 2's and ends with the
    blocking run's final weights and optimizer state, bit for bit."""
    from test_checkpoint import every_tensor, slow_writes
    blocking, background = async_and_blocking
    cfg = dataclasses.replace(background, out_dir=str(tmp_path / "run"))
    train_step, in_flight = train.train_step, []

    def a_bug_in_step_5(run, stop):
        if run.step == 4:
            in_flight.append(run.saver.in_flight.step if run.saver.in_flight else None)
            raise RuntimeError("a bug in step 5")
        return train_step(run, stop)
    monkeypatch.setattr(train, "train_step", a_bug_in_step_5)
    slow_writes(monkeypatch, 0.5)
    with pytest.raises(RuntimeError, match="a bug in step 5"):
        train.main(cfg)
    assert in_flight == [4]
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == ["step_0000002"]
    assert ckpt(cfg, 4).with_name("step_0000004.tmp").is_dir()
    assert [r["step"] for r in records(cfg) if r["kind"] == "checkpoint"] == [2]
    assert [r["outcome"] for r in records(cfg) if r["kind"] == "end"] == ["error"]
    monkeypatch.undo()
    train.main(cfg)  # the same command
    assert [r["resumed_from"] for r in records(cfg) if r["kind"] == "start"] == \
        [None, str(ckpt(cfg, 2).resolve())]
    ours, theirs = every_tensor(ckpt(cfg, 8)), every_tensor(ckpt(blocking, 8))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list(Path(cfg.out_dir, "ckpt").glob("*.tmp"))
