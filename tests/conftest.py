"""Shared fixtures: a small prepared dataset and a micro model config for loop tests."""

import shutil
import sysconfig
from pathlib import Path

import pytest

import config
import prepare


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory) -> str:
    """~750 KB of standard-library source, a 512-token BPE, prepared once per session."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("email", "json", "http", "importlib"):
        for path in sorted((stdlib / package).glob("*.py")):
            shutil.copy(path, root / f"{package}_{path.stem}.txt")
    out = tmp_path_factory.mktemp("data") / "small"
    prepare.prepare(source=str(root), out_dir=str(out), vocab_size=512, val_fraction=0.1)
    return str(out)


def micro_config(data_dir: str, out_dir: str, **overrides) -> config.TrainConfig:
    """A two-layer model that takes milliseconds per step: for testing the loop itself."""
    model = config.StackConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               intermediate=176, max_seq_len=64, nope_every=2, ce_chunk_size=96)
    cfg = config.TrainConfig(
        model=model, data_dir=data_dir, out_dir=out_dir, seq_len=64, micro_batch_size=4,
        global_batch_tokens=512, total_steps=8, stop_at_step=8, warmup_steps=2,
        decay_fraction=0.25, adamw_peak_lr=1e-2, muon_peak_lr=2e-2, log_every=1,
        eval_every=4, eval_tokens=1024, ckpt_every=4, keep_last_ckpts=5, compile_model="false",
        sample_tokens=8)
    return config.apply_overrides(cfg, overrides)
