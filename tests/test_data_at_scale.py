"""Real corpora at scale, from train.py's side: evaluation that never counts a window twice
at any rank count, a shard check paid once rather than by every rank, the epochs a run
plans (warned past 4, refused past --max_epochs), and the epoch lines of the log."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config
import data
import train
from conftest import micro_config
from model import Transformer

ROOT = Path(__file__).resolve().parent.parent


def single_window_evaluation(cfg, model=None, data_dir=None) -> dict:
    """The oracle: every val window once, one at a time (batch of 1, one process), summed by
    hand; val loss = total CE / targets, bits per byte = total CE / ln 2 / target bytes.
    `model` defaults to a fresh one seeded with 0, `data_dir` to cfg.data_dir."""
    if model is None:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
    model, data_dir = model.eval(), data_dir or cfg.data_dir
    token_bytes = data.token_bytes(data_dir)
    loader = data.PackedShardLoader(data_dir, "val", cfg.seq_len, 1)
    n_windows = min(cfg.eval_tokens // cfg.seq_len, loader.windows_per_epoch)
    ce = tokens = n_bytes = 0.0
    with torch.no_grad():
        for _ in range(n_windows):
            batch = next(loader)
            ce += float(model(**batch, reduction="sum").ce)
            tokens += batch["targets"].numel()
            n_bytes += float(token_bytes[batch["targets"]].sum())
    return {"val_loss": ce / tokens, "val_bpb": ce / math.log(2) / n_bytes,
            "windows": n_windows}


def evaluate_on_ranks(cfg, world: int, tmp_path) -> dict:
    config_json, out_json = tmp_path / f"cfg{world}.json", tmp_path / f"eval{world}.json"
    config_json.write_text(json.dumps(dataclasses.asdict(cfg)))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               str(ROOT / "tests" / "dist_eval.py"), str(config_json), str(out_json)]
    done = subprocess.run(command, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out_json.read_text())


@pytest.mark.distributed
def test_evaluation_on_three_ranks_counts_every_window_once(prepared, tmp_path):
    """A val split smaller than one global micro-batch (3 ranks × 32 rows): reading a whole
    global batch would wrap around and count windows twice."""
    cfg = micro_config(str(prepared), str(tmp_path / "out"), seq_len=16,
                       micro_batch_size=32, global_batch_tokens=1536, eval_tokens=10**6)
    want = single_window_evaluation(cfg)
    assert want["windows"] < cfg.micro_batch_size * 3  # smaller than one global micro-batch
    assert want["windows"] % cfg.micro_batch_size != 0  # a rank holds padding rows
    for world in (3, 1):
        got = evaluate_on_ranks(cfg, world, tmp_path)
        assert got["world"] == world
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
        assert got["val_bpb"] == pytest.approx(want["val_bpb"], rel=1e-6)


def test_eval_tokens_below_the_split_evaluate_that_many_windows(prepared, tmp_path):
    cfg = micro_config(str(prepared), str(tmp_path / "out"), seq_len=16,
                       micro_batch_size=4, global_batch_tokens=64, eval_tokens=16 * 7)
    want = single_window_evaluation(cfg)
    assert want["windows"] == 7  # not a multiple of the micro-batch: one padded row
    torch.manual_seed(0)
    got = train.val_loss(cfg, train.Accelerator(cpu=True), Transformer(cfg.model),
                         data.token_bytes(cfg.data_dir), cfg.data_dir)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)


def test_a_plan_past_four_epochs_warns_once_and_max_epochs_refuses(small_data_dir, tmp_path):
    tokens = data.windows_per_epoch(data.load_manifest(small_data_dir), "train", 64) * 64
    cfg = micro_config(small_data_dir, str(tmp_path), total_steps=10**5, warmup_steps=1)

    def plan(stop_at_step, **overrides):
        run = dataclasses.replace(cfg, stop_at_step=stop_at_step, **overrides)
        return run, config.data_plan(run, run.stages(None), {small_data_dir: tokens})

    assert config.check_epochs(*plan(4 * tokens // 512)) == []  # exactly the edge: no word
    warnings = config.check_epochs(*plan(math.ceil(4 * tokens / 512) + 1))
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: this run reads {small_data_dir} 4.0 times")
    assert "a mixture of corpora" in warnings[0] and "--max_epochs" in warnings[0]
    with pytest.raises(ValueError, match=r"more than max_epochs=4; prepare a larger corpus"):
        config.check_epochs(*plan(math.ceil(4 * tokens / 512) + 1, max_epochs=4.0))
    assert config.check_epochs(*plan(4 * tokens // 512, max_epochs=4.0)) == []
    with pytest.raises(ValueError, match="max_epochs=0.0 must be a positive"):
        dataclasses.replace(cfg, max_epochs=0.0)


def test_setup_prints_the_warning_once_and_max_epochs_refuses_before_any_step(
        small_data_dir, tmp_path, capsys):
    tokens = data.windows_per_epoch(data.load_manifest(small_data_dir), "train", 64) * 64
    cfg = micro_config(small_data_dir, str(tmp_path), total_steps=10**5, warmup_steps=1,
                       stop_at_step=5 * tokens // 512)
    train.setup(cfg)
    out = capsys.readouterr().out
    assert out.count("warning: this run reads") == 1
    with pytest.raises(ValueError, match="more than max_epochs=4.5"):
        train.main(dataclasses.replace(cfg, max_epochs=4.5))
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


def test_many_epochs_in_one_interval_are_one_log_line(prepared, tmp_path, capsys):
    """A tiny corpus passes several epochs per log interval: one line per interval, on the
    log's main process, naming the range."""
    cfg = micro_config(str(prepared), str(tmp_path), seq_len=16, micro_batch_size=256,
                       global_batch_tokens=16 * 1024, total_steps=4, stop_at_step=4,
                       log_every=2, eval_every=4, ckpt_every=4, eval_tokens=64)
    n = data.PackedShardLoader(str(prepared), "train", 16, 1).windows_per_epoch
    train.main(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("data: train")]
    begun = [(1024 * step - 1) // n for step in (2, 4)]  # the last epoch begun by then
    assert begun[0] >= 3 and begun[1] - begun[0] >= 3  # several per interval
    assert lines == [f"data: train epochs 1–{begun[0]} of {prepared} began",
                     f"data: train epochs {begun[0] + 1}–{begun[1]} of {prepared} began"]
