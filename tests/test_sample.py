"""sample.py's command line on bad exports: one clear line naming the file and the fix,
exit status 2, no traceback (unless --debug), and a pickle that would run code is refused
without running it."""

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import config
import sample
from data import EOS_TOKEN
from model import Transformer

REPO = Path(__file__).resolve().parent.parent


def write_export(out: Path, end_of_text: str = EOS_TOKEN) -> Path:
    """An export of a random ~20k-parameter model at `out` (model.pt, config.json,
    tokenizer.json), whose tokenizer's one special token is `end_of_text`."""
    out.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        ["def add(a, b):\n    return a + b\n"] * 10,
        trainers.BpeTrainer(vocab_size=280, special_tokens=[end_of_text], show_progress=False,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(out / "tokenizer.json"))
    cfg = config.StackConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, n_layers=1,
                             n_heads=2, n_kv_heads=1, intermediate=64, max_seq_len=64)
    torch.manual_seed(0)
    torch.save(Transformer(cfg).state_dict(), out / "model.pt")
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return out


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A good export, of a tokenizer with <|endoftext|> (prepare.py's own)."""
    return write_export(tmp_path_factory.mktemp("run") / "export")


def damaged_copy(export: Path, tmp_path: Path, **files: bytes | None) -> Path:
    """A copy of the export at tmp_path/run/export with some files replaced (None: removed)."""
    copy = tmp_path / "run" / "export"
    copy.mkdir(parents=True)
    for name in sample.EXPORT_FILES:
        payload = files.get(name.replace(".", "_"), (export / name).read_bytes())
        if payload is not None:
            (copy / name).write_bytes(payload)
    return copy


def run_sample(export_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """sample.py in a process of its own: what a user sees on the terminal."""
    return subprocess.run([sys.executable, str(REPO / "sample.py"), "--export", str(export_dir),
                           "--max_new_tokens", "4", "--num_samples", "1", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def assert_one_line_error(returncode: int, stderr: str, *fragments: str) -> str:
    """Exit status 2 and one `error: ...` line on stderr that names what is wrong: that line."""
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def sample_error(capsys, export_dir: Path, *fragments: str) -> str:
    """sample.main in this process (importing torch per case would take seconds each)."""
    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--export", str(export_dir), "--max_new_tokens", "4", "--num_samples", "1"])
    return assert_one_line_error(exit_info.value.code, capsys.readouterr().err, *fragments)


def test_missing_export_directory_in_a_real_process(tmp_path):
    missing = tmp_path / "out" / "export"
    result = run_sample(missing)
    assert_one_line_error(result.returncode, result.stderr,
                          f"--export {missing}: no such directory",
                          f"write one with: python export.py {tmp_path / 'out'}, which "
                          f"writes {missing}")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        sample.main(["--export", str(tmp_path / "export"), "--debug"])


def test_export_without_its_files(export, tmp_path, capsys):
    bad = damaged_copy(export, tmp_path, model_pt=None, tokenizer_json=None)
    sample_error(capsys, bad, f"--export {bad} has no model.pt, tokenizer.json",
                 f"write one with: python export.py {bad.parent}")


@pytest.mark.parametrize("config_json", [b"{not json", b'{"vocab_size": 280, "colour": 1}',
                                         b'{"vocab_size": 280, "d_model": 33}'])
def test_bad_config_json(export, tmp_path, capsys, config_json):
    bad = damaged_copy(export, tmp_path, config_json=config_json)
    sample_error(capsys, bad, f"{bad / 'config.json'} is not a model config",
                 f"write one with: python export.py {bad.parent}")


def test_weights_that_do_not_fit_the_config(export, tmp_path, capsys):
    cfg = {**json.loads((export / "config.json").read_text()), "d_model": 64}
    bad = damaged_copy(export, tmp_path, config_json=json.dumps(cfg).encode())
    sample_error(capsys, bad, f"{bad / 'model.pt'} does not fit")


def test_unreadable_weights_and_tokenizer(export, tmp_path, capsys):
    bad = damaged_copy(export, tmp_path, model_pt=(export / "model.pt").read_bytes()[:100])
    sample_error(capsys, bad, f"{bad / 'model.pt'} is not a readable torch.save file")
    (bad / "model.pt").write_bytes((export / "model.pt").read_bytes())
    (bad / "tokenizer.json").write_text("{")
    sample_error(capsys, bad, f"{bad / 'tokenizer.json'} is not a tokenizer")
    sample.load_export(str(export))  # the good export still loads


def test_a_public_tokenizers_end_of_text_is_read_from_tokenizer_config_json(tmp_path, capsys):
    """An export of a tokenizer without <|endoftext|> (a public model's, whose end of text is
    </s>): sampling opens a completion with the token its tokenizer_config.json names.
    Without that file, the one line names it and export.py, which writes it, not
    prepare.py's --tokenizer."""
    folder = write_export(tmp_path / "run" / "export", "</s>")
    line = sample_error(capsys, folder, f"--export {folder} has no tokenizer_config.json",
                        f"write one with: python export.py {folder.parent}")
    assert "--tokenizer" not in line
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    _, tokenizer, eos_id = sample.load_export(str(folder))
    assert eos_id is not None and eos_id == tokenizer.token_to_id("</s>")


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device gpu is not a device torch knows; use auto, cpu, cuda (cuda:N) or mps"),
    ("cuda", "--device cuda: this machine has no CUDA GPU; use --device auto or cpu"),
    ("mps", "--device mps: this machine has no Apple GPU (MPS); use --device auto or cpu")])
def test_a_device_this_machine_lacks_is_named_not_blamed_on_the_export(export, capsys,
                                                                      monkeypatch, device,
                                                                      message):
    """torch.load's own error for it read "model.pt is not a readable torch.save file",
    with a fix (export again) that cannot help."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        sample.main(["--export", str(export), "--device", device])
    assert_one_line_error(exit_info.value.code, capsys.readouterr().err, message)


class RunsCode:
    """Unpickling this runs a shell command: what a crafted model.pt would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_runs_code_is_refused_unrun(export, tmp_path, writer):
    marker = tmp_path / "pwned"
    payload_path = tmp_path / "payload"
    with open(payload_path, "wb") as f:
        if writer == "torch.save":
            torch.save({"embed.weight": RunsCode(marker)}, f)
        else:
            pickle.dump(RunsCode(marker), f)
    bad = damaged_copy(export, tmp_path, model_pt=payload_path.read_bytes())
    if writer == "torch.save":  # the whole command line, as a user would run it
        result = run_sample(bad)
        assert not marker.exists()  # nothing in the file ran
        assert_one_line_error(result.returncode, result.stderr,
                              f"{bad / 'model.pt'} holds objects other than tensors")
    else:
        with pytest.raises(ValueError, match="holds objects other than tensors") as refused:
            sample.load_export(str(bad))
        assert not marker.exists()
        assert str(bad / "model.pt") in str(refused.value)


def test_help_describes_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--max_new_tokens", "--num_samples", "--seed", "--device", "--top_k",
                   "--temperature", "--prompt"):
        described = text.split(option)[-1].split("--")[0]
        assert "(default:" in described and len(described.split()) > 3, option
    assert "(default: 50)" in text.split("--top_k")[-1]  # as the end-of-run sample
    assert "(default: 0.8)" in text.split("--temperature")[-1]
