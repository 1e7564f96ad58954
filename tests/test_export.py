"""`python export.py OUT_DIR`: the export is the checkpoint's own model. Its shape and its
tokenizer come from the checkpoint (train_state.json and the tokenizer it recorded), the
command takes no model flags, and every error on this path is one line."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import export
import sample
import train
from conftest import copy_of, micro_config
from model import KVCache, Transformer, complete
from test_errors import run_cli
from test_train import REPO, checkpoint_weights
from plumbing import checkpoint, log

# Shape knobs the `tiny` preset does not have: a rope_theta no default shares, and NoPE on
# layer 2 of 2 (tiny's nope_every=4 leaves both layers with RoPE). Neither changes a tensor
# shape, so weights load under the preset's config without a word: only the logits differ.
SHAPE = {"model.rope_theta": 500_000.0, "model.nope_every": 2}
PROMPT = "def "


def logits(model, ids: list[int]) -> torch.Tensor:
    """(1, T, V) next-token logits of one row, through the model's cached forward."""
    with torch.no_grad():
        return model.forward_cached(torch.tensor([ids]), 0, [KVCache() for _ in model.blocks])


def trained_model(cfg, step: int) -> Transformer:
    model = Transformer(cfg.model)
    model.load_state_dict(checkpoint_weights(cfg, step))
    return model.eval()


@pytest.fixture
def trained(small_data_dir, tmp_path):
    """A micro run with non-default shape flags on a non-default data_dir (512-token
    vocabulary, tiny's is 4,096), checkpointed at steps 4 and 8."""
    data_dir = copy_of(small_data_dir, tmp_path)
    cfg = micro_config(str(data_dir), str(tmp_path / "run"), **SHAPE)
    train.main(cfg)
    return cfg


def test_the_export_is_the_trained_model_with_its_own_shape(trained, capsys):
    folder = export.export(trained.out_dir)
    assert json.loads((folder / "config.json").read_text()) == \
        json.loads(json.dumps(dataclasses.asdict(trained.model)))
    assert (folder / "tokenizer.json").read_bytes() == \
        (Path(trained.data_dir) / "tokenizer.json").read_bytes()

    exported, tokenizer, eos_id = sample.load_export(str(folder))
    assert eos_id == tokenizer.token_to_id("<|endoftext|>")
    reference = trained_model(trained, 8)
    ids = [tokenizer.token_to_id("<|endoftext|>")] + tokenizer.encode("import json\n").ids * 4
    torch.testing.assert_close(logits(exported, ids), logits(reference, ids), rtol=0, atol=0)
    # The inputs make the bug visible: the same weights under the tiny preset's rope_theta and
    # nope_every (what an export that took the shape from a preset would say) give other
    # logits.
    preset = Transformer(dataclasses.replace(trained.model, rope_theta=10_000.0, nope_every=4))
    preset.load_state_dict(reference.state_dict())
    assert (logits(preset.eval(), ids) - logits(reference, ids)).abs().max() > 1e-3

    # sample.py's greedy completion, in a process of its own, is the trained model's
    want = complete(reference, Tokenizer.from_file(str(Path(trained.data_dir) /
                           "tokenizer.json")), PROMPT, 16, temperature=0, top_k=None,
                    eos_id=eos_id)
    done = subprocess.run([sys.executable, "sample.py", "--export", str(folder), "--prompt",
                           PROMPT, "--max_new_tokens", "16", "--temperature", "0",
                           "--num_samples", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{want}\n---------------\n"


def test_resume_path_exports_that_checkpoint(trained):
    step4 = Path(trained.out_dir) / "ckpt" / "step_0000004"
    export.main([trained.out_dir, f"--resume={step4}"])
    exported = torch.load(Path(trained.out_dir) / "export" / "model.pt", weights_only=True)
    want = checkpoint_weights(trained, 4)
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], want[k]) for k in want)
    assert not all(torch.equal(exported[k], v) for k, v in checkpoint_weights(trained, 8).items())


def test_a_model_flag_is_not_an_export_flag(trained, capsys):
    """The shape is the checkpoint's: export.py takes no model flags that could describe its
    weights wrongly (rope_theta changes no tensor shape, so nothing else would notice). It
    says so in one line, as it says why it needs no --force, and names its flags for any
    other; argparse's own refusals are one line too."""
    out = trained.out_dir
    assert "--model.rope_theta=10000: export.py takes no model flags: the model's shape " \
           "comes from the checkpoint's own train_state.json" in \
           run_cli([out, "--model.rope_theta=10000"], capsys, export.main)
    assert "--force: export.py needs none: it replaces the files of its own earlier export" \
        in run_cli([out, "--force=true"], capsys, export.main)
    assert "export.py takes OUT_DIR, --format, --resume, --data_dir and --debug" in \
        run_cli([out, "--bogus"], capsys, export.main)
    assert "invalid choice: 'xx'" in run_cli([out, "--format", "xx"], capsys, export.main)
    assert not (Path(out) / "export").exists()


def test_an_export_again_replaces_its_own_files_and_nothing_a_user_wrote(trained, monkeypatch,
                                                                         capsys):
    """A user's files beside an export (lm-eval's results, a model card, notes) survive a
    second export, byte for byte, while the export's own files are the new checkpoint's
    (the oracle: step 4's weights). An hf export of a shape that needs no modelling file
    removes the one an earlier export wrote. A killed export's scratch folder holding a
    user's file, and a file where the folder or the scratch folder goes, are refused before
    any work (the last in one line, before the weights are read), the file kept."""
    out = Path(trained.out_dir)
    export.main([str(out)])
    export.main([str(out), "--format", "hf"])
    mine = {out / "export" / "notes.txt": "mine", out / "export-hf" / "README.md": "a card",
            out / "export-hf" / "lm_eval_results" / "results_hellaswag.json": "{}"}
    for path, text in mine.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    export.main([str(out), f"--resume={out / 'ckpt' / 'step_0000004'}"])
    export.main([str(out), "--format", "hf"])
    assert all(path.read_text() == text for path, text in mine.items())
    exported = torch.load(out / "export" / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in checkpoint_weights(trained, 4).items())
    assert (out / "export-hf" / "modeling_stacklm.py").exists()  # QK-norm and NoPE layers
    qwen3 = dataclasses.replace(trained.model, nope_every=0)
    export.write_hf(out / "export-hf", Transformer(qwen3).state_dict(), qwen3,
                    str(Path(trained.data_dir) / "tokenizer.json"), 0, {"trained_by": "x"})
    assert not (out / "export-hf" / "modeling_stacklm.py").exists()
    assert all(path.read_text() == text for path, text in mine.items())
    (out / "export.tmp").mkdir()
    (out / "export.tmp" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"export\.tmp is export\.py's scratch folder, and "
                                         r"holds files an export does not write \(keep\.txt\)"):
        export.export(str(out))
    assert (out / "export.tmp" / "keep.txt").read_text() == "mine"
    shutil.rmtree(out / "export")
    (out / "export").write_text("a file")
    with pytest.raises(NotADirectoryError, match=r"export is a file, not the folder"):
        export.export(str(out))
    (out / "export-hf.tmp").write_text("mine")
    monkeypatch.setattr(checkpoint, "read_model", lambda *args: pytest.fail("weights read"))
    assert run_cli([str(out), "--format", "hf"], capsys, export.main) == \
        f"error: {out / 'export-hf.tmp'} is a file, where export.py writes its scratch " \
        f"folder; move it elsewhere"
    assert (out / "export-hf.tmp").read_text() == "mine"


def test_a_re_prepared_data_dir_cannot_slip_in_another_tokenizer(trained, prepared, capsys):
    data_dir = Path(trained.data_dir)
    original = data_dir.with_name("original")
    shutil.move(data_dir, original)
    shutil.copytree(prepared, data_dir)  # another corpus, prepared at the same path
    err = run_cli([trained.out_dir], capsys, export.main)
    assert f"{data_dir / 'tokenizer.json'} is not the tokenizer" in err
    assert "--data_dir a copy" in err
    # the fix the message names: point --data_dir at the original data
    export.main([trained.out_dir, "--data_dir", str(original)])
    assert (Path(trained.out_dir) / "export" / "tokenizer.json").read_bytes() == \
        (original / "tokenizer.json").read_bytes()


def test_another_corpus_as_data_dir_is_named_as_the_one_passed(trained, prepared, capsys):
    """--data_dir naming another corpus (the checkpoint's own data unchanged): the message
    names the flag and the data the run trained on, not a re-preparation that never
    happened, and its fix (drop --data_dir) exports."""
    err = run_cli([trained.out_dir, "--data_dir", str(prepared)], capsys, export.main)
    assert f"--data_dir {prepared}: {prepared / 'tokenizer.json'} is not the tokenizer" in err
    assert f"(it trained on {trained.data_dir})" in err and "prepared again" not in err
    assert "drop --data_dir" in err
    export.main([trained.out_dir])
    err = run_cli([trained.out_dir, "--data_dir", str(prepared / "nowhere")], capsys,
                  export.main)
    assert f"--data_dir {prepared / 'nowhere'} does not exist; pass the folder the data" in err


def test_missing_data_is_one_line(trained, capsys):
    shutil.rmtree(trained.data_dir)
    err = run_cli([trained.out_dir], capsys, export.main)
    assert f"data directory {trained.data_dir} does not exist" in err


@pytest.mark.parametrize("damage", ["weights", "train_state"])
def test_a_damaged_checkpoint_is_one_line(trained, capsys, damage):
    """DCP's CheckpointException is a BaseException: it must not escape as a traceback."""
    step8 = Path(trained.out_dir) / "ckpt" / "step_0000008"
    files = step8.glob("*.distcp") if damage == "weights" else [step8 / "train_state.json"]
    for path in files:
        path.write_bytes(path.read_bytes()[:100])  # truncated
    err = run_cli([trained.out_dir], capsys, export.main)
    assert err.startswith(f"error: {step8}")


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_a_checkpoint_with_a_damaged_dcp_file_names_the_file_and_an_export_that_works(
        trained, capsys, damage):
    """DCP's own error says only which rank failed ("CheckpointException ranks:
    dict_keys([0])"): the line names the file, what is wrong with it, and the checkpoint to
    export instead, and that command, run as written, exports."""
    step8, step4 = (Path(trained.out_dir) / "ckpt" / f"step_000000{n}" for n in (8, 4))
    shard = next(step8.glob("*.distcp"))
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    err = run_cli([trained.out_dir], capsys, export.main)
    what = "is missing (.metadata lists it)" if damage == "missing" else \
        "is cut short: 100 bytes, .metadata reads it to byte"
    assert err.startswith(f"error: {shard} {what}"), err
    fix = f"export another checkpoint: `python export.py {trained.out_dir} --resume {step4}`"
    assert err.endswith(fix), err
    export.main(fix.split("`")[1].split()[2:])
    assert "exported" in capsys.readouterr().out


def test_a_checkpoint_given_as_out_dir_is_refused_with_the_command_that_exports_it(trained,
                                                                                  capsys):
    """Followed, the old fix ("pass --resume PATH") wrote the export inside the checkpoint
    folder, which pruning deletes whole."""
    step8 = Path(trained.out_dir) / "ckpt" / "step_0000008"
    err = run_cli([str(step8)], capsys, export.main)
    command = f"python export.py {trained.out_dir} --resume {step8}"
    assert err == f"error: {step8} is a checkpoint, not a run's out_dir; export it with " \
                  f"`{command}`"
    assert not (step8 / "export").exists()
    export.main(command.split()[2:])
    assert (Path(trained.out_dir) / "export" / "model.pt").exists()


@pytest.mark.parametrize("fmt, names", [("stacklm", export.STACKLM_FILES),
                                         ("hf", export.HF_FILES)])
def test_a_killed_exports_scratch_folder_is_cleared_by_the_next_export(trained, fmt, names):
    """A kill mid-export leaves export.tmp (export-hf.tmp) holding some of the export's own
    files, half written: the next export clears it and writes the whole export."""
    folder = Path(trained.out_dir) / ("export-hf" if fmt == "hf" else "export")
    scratch = folder.with_name(folder.name + ".tmp")
    scratch.mkdir()
    for name in names[:2]:
        (scratch / name).write_bytes(b"half a")
    assert export.export(trained.out_dir, fmt) == folder
    assert not scratch.exists()
    assert (folder / "config.json").read_bytes() != b"half a"
    assert {"config.json", "tokenizer.json", "provenance.json"} <= {p.name for p in
                                                                      folder.iterdir()}


def test_an_export_that_fails_leaves_the_previous_export_as_it_was(trained, monkeypatch):
    """Every file is written to the scratch folder first: an export that fails midway (the
    weights' write, here) moves nothing into the export's folder."""
    folder = export.export(trained.out_dir, "hf")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export.export(trained.out_dir, "hf", resume=str(Path(trained.out_dir) / "ckpt" /
                                                        "step_0000004"))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_nothing_to_export_is_one_line_naming_the_fix(trained, capsys, tmp_path):
    """A run folder without checkpoints; a run whose one checkpoint is damaged, which has
    no other to export."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli([str(empty)], capsys, export.main) == (
        f"error: no checkpoint in {empty / 'ckpt'} to export; train first, or pass --resume "
        f"PATH to a checkpoint folder")
    shutil.rmtree(Path(trained.out_dir) / "ckpt" / "step_0000004")
    shard = next((Path(trained.out_dir) / "ckpt" / "step_0000008").glob("*.distcp"))
    shard.unlink()
    assert run_cli([trained.out_dir], capsys, export.main).endswith(
        "; restore the file; this run has no other checkpoint to export")


def test_the_revision_is_recorded_in_the_checkpoint_the_banner_and_the_export(capsys,
                                                                              trained):
    """In this git checkout, the revision is HEAD's sha (with -dirty for uncommitted
    changes), read independently here with git itself. (capsys comes first, so it holds
    what the trained fixture's run printed.)"""
    import subprocess
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no") != ""
    revision = log.code_revision()
    assert revision == git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    state = json.loads((Path(trained.out_dir) / "ckpt" / "step_0000008" /
                        "train_state.json").read_text())
    assert state["revision"] == revision
    assert f"\ncode: {revision}\n" in capsys.readouterr().out  # the start-up banner
    export.main([trained.out_dir])
    provenance = json.loads((Path(trained.out_dir) / "export" / "provenance.json").read_text())
    assert provenance == {"checkpoint": str(Path(trained.out_dir) / "ckpt" / "step_0000008"),
                          "step": 8, "trained_by": revision, "exported_by": revision}


def test_a_changed_tracked_file_marks_the_revision_dirty_and_an_untracked_one_does_not(
        tmp_path):
    """In a git repository of its own: a commit, then an untracked file (still clean), then
    an uncommitted change to a tracked file (-dirty)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t",
                               "-c", "user.email=t@t", *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    shutil.copy(REPO / "plumbing" / "log.py", tmp_path)
    git("init", "-q")
    git("add", "log.py")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked")
    assert log.code_revision(tmp_path) == head
    (tmp_path / "log.py").write_text((tmp_path / "log.py").read_text() + "# changed\n")
    assert log.code_revision(tmp_path) == f"{head}-dirty"


def test_outside_a_git_checkout_the_revision_is_unknown(tmp_path):
    copy = tmp_path / "copied"
    copy.mkdir()
    shutil.copy(REPO / "plumbing" / "log.py", copy)
    assert log.code_revision(copy) == "unknown"
    nested = REPO / "tests" / "__pycache__"  # inside this repository, but not its top
    assert log.code_revision(nested if nested.is_dir() else REPO / "tests") == "unknown"
