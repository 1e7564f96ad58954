"""stacklm inside torchtitan 0.2.2 (integrations/torchtitan, docs/torchtitan.md): torchtitan's
own trainer, launched by its own command with configs/torchtitan/tiny_cpu.toml, trains
stacklm's model, optimizers, loader, loss and schedule, and computes the losses that
stacklm's train.py computes on the same data, shape and seed, bitwise, on 1 rank and on 2
FSDP2 ranks over gloo; a changed knob moves them; a DCP checkpoint resumes bitwise.

Each torchtitan launch costs tens of seconds of imports, so each test launches once and
checks all it can. Run them alone with `python -m pytest -q -m torchtitan`, in an
environment with `pip install -r requirements-torchtitan.txt`; without torchtitan they skip.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed: "
                                         "pip install -r requirements-torchtitan.txt")

import config  # noqa: E402
import train  # noqa: E402
from conftest import micro_config  # noqa: E402
from test_train import launch_command  # noqa: E402

pytestmark = pytest.mark.torchtitan

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8  # micro_config's: warmup 2, stable 4, decay 2


# What each TOML leaves at another value than its preset, and why: where the run writes;
# compilation and precision named where the preset says "auto"; and the knobs of train.py's
# own evaluation, which torchtitan does not run (the spec has no validator).
TOML_DIFFERENCES = {
    "stack100m.toml": ("stack100m", {"out_dir", "compile_model", "mixed_precision"}),
    "tiny_cpu.toml": ("tiny", {"out_dir", "compile_model", "mixed_precision", "eval_every",
                               "eval_tokens", "downstream", "downstream_items",
                               "sample_tokens"}),
}


@pytest.mark.parametrize("toml", sorted(TOML_DIFFERENCES))
def test_each_toml_is_its_preset_key_for_key(toml):
    """configs/torchtitan's TOMLs, as torchtitan's own parser reads them and the spec turns
    them into a stacklm TrainConfig, are the presets they are named for: the chapter's
    stack100m.toml is `python train.py --preset stack100m`, knob for knob, on a GPU."""
    from torchtitan.config import ConfigManager

    from integrations.torchtitan import spec

    job = ConfigManager().parse_args(["--job.config_file", f"configs/torchtitan/{toml}"])
    preset, expected = TOML_DIFFERENCES[toml]
    differing = config.differences(spec.train_config(job),
                                   dataclasses.asdict(config.PRESETS[preset]()))
    assert {key for key, _, _ in differing} == expected
    assert spec.train_config(job).model == config.PRESETS[preset]().model


@pytest.mark.parametrize("flavor", ["tiny", "debugmodel"])
def test_the_loss_is_the_transformers_own_head(flavor):
    """The spec's loss (torchtitan's build_loss_fn) on what its model's forward returns
    equals model.Transformer's own forward with reduction="sum", bitwise, and so do the
    gradients: the plain head (tiny, ce_chunk_size 0) and the chunked one (debugmodel)."""
    import torch

    from integrations.torchtitan import spec

    torch.manual_seed(0)
    model_cfg = spec.FLAVORS[flavor]
    model = spec.Transformer(model_cfg)
    tokens = torch.randint(model_cfg.vocab_size, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    job = types.SimpleNamespace(model=types.SimpleNamespace(flavor=flavor))
    hidden = spec.Hidden(model.hidden_states(inputs, None, None),
                         model.embed.weight.view_as(model.embed.weight))
    loss = spec.build_loss_fn(job)(hidden, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    own = model(inputs, targets, reduction="sum").loss
    assert loss.item() == own.item()
    own_grads = torch.autograd.grad(own, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, own_grads, strict=True))


def titan_overrides(data_dir: str, out: Path, **changes) -> list[str]:
    """configs/torchtitan/tiny_cpu.toml set to micro_config's run, key by key (the
    debugmodel flavor is micro_config's model), plus `changes` (dotted keys, `__` for .)."""
    knobs = {"model.flavor": "debugmodel", "training.dataset_path": data_dir,
             "training.seq_len": 64, "training.local_batch_size": 4,
             "training.global_batch_size": 8, "training.steps": STEPS,
             "lr_scheduler.total_steps": STEPS, "lr_scheduler.warmup_steps": 2,
             "lr_scheduler.decay_ratio": 0.25, "optimizer.lr": 1e-2,
             "stacklm.muon_peak_lr": 2e-2, "metrics.log_freq": 1, "checkpoint.interval": 4,
             "checkpoint.keep_latest_k": 5, "job.dump_folder": str(out)}
    knobs |= {key.replace("__", "."): value for key, value in changes.items()}
    return [arg for key, value in knobs.items() for arg in (f"--{key}", str(value))]


def run_torchtitan(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun -m torchtitan.train --job.config_file configs/torchtitan/tiny_cpu.toml …`."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "torchtitan.train",
               "--job.config_file", "configs/torchtitan/tiny_cpu.toml", *args]
    done = subprocess.run(command, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def train_records(out: Path) -> dict[int, dict]:
    """metrics.jsonl's train records by step (torchtitan's spec and train.py write one)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r for r in records if r.get("kind") == "train"}


def curves(records: dict[int, dict], lr_key: str) -> dict[str, list[float]]:
    steps = sorted(records)
    return {"loss": [records[s]["loss"] for s in steps],
            "grad_norm": [records[s]["grad_norm"] for s in steps],
            "lr": [records[s][lr_key] for s in steps]}


@pytest.fixture(scope="module")
def one_rank_train_py(small_data_dir, tmp_path_factory) -> dict:
    """train.py's loop in this process: micro_config's 8 steps, 2 micro-batches each."""
    out = tmp_path_factory.mktemp("stacklm_1")
    train.main(micro_config(small_data_dir, str(out)))
    return curves(train_records(out), "lr_muon")


@pytest.mark.distributed
def test_one_rank_matches_train_py_and_resumes_bitwise(small_data_dir, one_rank_train_py,
                                                       tmp_path):
    """1 rank, 2 micro-batches a step: every loss, grad norm and lr of the 8 steps (warmup,
    stable, decay) as train.py's, bitwise; then a second launch resumes from torchtitan's
    DCP checkpoint of step 4 and logs steps 5–8 bitwise as the first."""
    first = tmp_path / "first"
    run_torchtitan(1, titan_overrides(small_data_dir, first))
    assert curves(train_records(first), "lr") == one_rank_train_py
    assert sorted(p.name for p in (first / "checkpoint").iterdir()) == ["step-4", "step-8"]

    assert_resumes_bitwise(1, small_data_dir, first, tmp_path / "resumed")


def assert_resumes_bitwise(ranks: int, data_dir: str, first: Path, resumed: Path):
    """A launch whose dump folder holds only `first`'s step-4 checkpoint logs steps 5–8 as
    `first` did, bitwise (tokens seen aside: torchtitan counts a launch's own)."""
    shutil.copytree(first / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    run_torchtitan(ranks, titan_overrides(data_dir, resumed))
    after, before = train_records(resumed), train_records(first)
    assert sorted(after) == [5, 6, 7, 8]
    assert [after[s] | {"n_tokens_seen": 0} for s in after] == \
        [before[s] | {"n_tokens_seen": 0} for s in after]


@pytest.mark.distributed
def test_two_fsdp2_ranks_match_train_py(small_data_dir, tmp_path):
    """2 ranks sharded with FSDP2 over gloo, one micro-batch each a step: torchtitan's
    losses, grad norms and lrs are train.py's under its fsdp2 launch config, bitwise; and
    its sharded step-4 checkpoint (Muon's momentum by rows, the loader's one cursor)
    resumes on 2 ranks bitwise."""
    stacklm_out = tmp_path / "stacklm"
    cfg = micro_config(small_data_dir, str(stacklm_out))
    done = subprocess.run(launch_command(cfg, 2, "fsdp2.yaml"), cwd=ROOT,
                          env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    titan_out = tmp_path / "titan"
    run_torchtitan(2, titan_overrides(small_data_dir, titan_out))
    assert curves(train_records(titan_out), "lr") == \
        curves(train_records(stacklm_out), "lr_muon")
    assert_resumes_bitwise(2, small_data_dir, titan_out, tmp_path / "resumed")


@pytest.mark.distributed
def test_a_changed_knob_moves_the_losses(small_data_dir, one_rank_train_py, tmp_path):
    """The negative control: Muon's peak lr halved in the TOML's [stacklm] section. The
    first loss (before any update) stays; every later one moves, by far more than the
    comparisons' tolerance (none: they are bitwise)."""
    out = tmp_path / "half_muon_lr"
    run_torchtitan(1, titan_overrides(small_data_dir, out, stacklm__muon_peak_lr=1e-2,
                                      training__steps=3))
    losses, reference = curves(train_records(out), "lr")["loss"], one_rank_train_py["loss"]
    assert losses[0] == reference[0]
    assert all(abs(a - b) / b > 1e-4 for a, b in zip(losses[1:], reference[1:3], strict=True))
