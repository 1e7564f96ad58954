"""Real corpora at scale, from train.py's side: evaluation that never counts a window twice
(on one process here; on 3 ranks, and the shard check rank 0 pays for all, in
tests/test_ranks.py), the epochs a run plans (warned past 4, refused past --max_epochs), and
the epoch lines of the log."""

import dataclasses
import math

import pytest
import torch

import config
import data
import train
from conftest import micro_config
from model import Transformer
from plumbing import shards

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
    n_windows = loader.windows_per_epoch if cfg.eval_tokens is None else \
        min(cfg.eval_tokens // cfg.seq_len, loader.windows_per_epoch)
    ce = tokens = n_bytes = 0.0
    with torch.no_grad():
        for _ in range(n_windows):
            batch = next(loader)
            ce += float(model(**batch, reduction="sum").ce)
            tokens += batch["targets"].numel()
            n_bytes += float(token_bytes[batch["targets"]].sum())
    return {"val_loss": ce / tokens, "val_bpb": ce / math.log(2) / n_bytes,
            "windows": n_windows}


# (micro-batch, windows evaluated; None: all 84 of `prepared`'s at seq_len 16): where the
# last window falls in its micro-batch, and what lies past it.
ONE_PROCESS = [
    (4, 7),  # mid-batch: the row past it is a real window of the split (eval_tokens)
    (4, 9),  # a last micro-batch of one window
    (5, None),  # mid-batch in all of val: the rows past it would wrap around to window 0
    (32, None),  # the same, the split not even three micro-batches
    (4, None),  # a whole number of micro-batches: no padding
    (1, 7),
]


@pytest.mark.parametrize("micro_batch_size, windows", ONE_PROCESS)
def test_one_process_evaluates_every_window_once(micro_batch_size, windows, prepared,
                                                 tmp_path):
    """train.val_loss on one process against the oracle; tests/test_ranks.py does the same
    on 3 ranks."""
    cfg = micro_config(str(prepared), str(tmp_path / "out"), seq_len=16,
                       micro_batch_size=micro_batch_size,
                       global_batch_tokens=16 * micro_batch_size,
                       eval_tokens=None if windows is None else 16 * windows)
    want = single_window_evaluation(cfg)
    assert want["windows"] == (windows or 84)
    torch.manual_seed(0)
    got = train.val_loss(cfg, train.Accelerator(cpu=True), Transformer(cfg.model),
                         data.token_bytes(cfg.data_dir), cfg.data_dir)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert got["val_bpb"] == pytest.approx(want["val_bpb"], rel=1e-6)


def test_a_plan_past_four_epochs_warns_once_and_max_epochs_refuses(small_data_dir, tmp_path):
    tokens = data.windows_per_epoch(shards.load_manifest(small_data_dir), "train", 64) * 64
    cfg = micro_config(small_data_dir, str(tmp_path), total_steps=10**5, warmup_steps=1)

    def plan(stop_at_step, **overrides):
        run = dataclasses.replace(cfg, stop_at_step=stop_at_step, **overrides)
        return run, config.data_plan(run, run.stages(None), {small_data_dir: tokens})

    assert config.check_epochs(*plan(4 * tokens // 512)) == []  # exactly the edge: no word
    warnings = config.check_epochs(*plan(math.ceil(4 * tokens / 512) + 1))
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: this run reads {small_data_dir} 4.0 times")
    assert "a mixture of corpora" in warnings[0] and "--max_epochs" in warnings[0]
    with pytest.raises(ValueError, match=r"more than max_epochs=4; prepare a real corpus"):
        config.check_epochs(*plan(math.ceil(4 * tokens / 512) + 1, max_epochs=4.0))
    assert config.check_epochs(*plan(4 * tokens // 512, max_epochs=4.0)) == []
    with pytest.raises(ValueError, match="max_epochs=0.0 must be a positive"):
        dataclasses.replace(cfg, max_epochs=0.0)


def test_by_default_a_plan_past_16_epochs_is_refused_as_the_gpus_bare_command_would_be():
    """Bare `python train.py` on a GPU is Stack-100M's reference run: on the built-in corpus
    (7.9M tokens of the Python standard library, 32k vocabulary) it would read it 2,275
    times, hours of a GPU spent on what repetition no longer teaches. The default refuses
    past 16 epochs and names the fix; --max_epochs=none accepts any repetition."""
    cfg, builtin = config.stack100m(), 7_913_000
    stages = cfg.stages(config.wsd_phases(cfg).decay_start)
    plan = config.data_plan(cfg, stages, {cfg.data_dir: builtin})
    epochs = cfg.stop_at_step * cfg.global_batch_tokens / builtin  # plain arithmetic
    assert cfg.max_epochs == 16 and round(epochs) == 2275
    with pytest.raises(ValueError) as refused:
        config.check_epochs(cfg, plan)
    assert str(refused.value) == (
        f"this run would read {cfg.data_dir} {epochs:,.1f} times "
        f"({cfg.stop_at_step * cfg.global_batch_tokens:,} tokens planned over {builtin:,} "
        f"tokens/epoch), more than max_epochs=16; prepare a real corpus with prepare.py "
        f"(docs/data.md), lower --stop_at_step or the source's weight, or pass "
        f"--max_epochs=none to accept it")
    accepted = dataclasses.replace(cfg, max_epochs=None)
    assert [w[:len("warning: this run reads")] for w in config.check_epochs(accepted, plan)] \
        == ["warning: this run reads"]
    sixteen = dataclasses.replace(cfg, stop_at_step=16 * builtin // cfg.global_batch_tokens)
    assert len(config.check_epochs(sixteen, config.data_plan(sixteen, stages,
                                                            {cfg.data_dir: builtin}))) == 1


def test_setup_prints_the_warning_once_and_max_epochs_refuses_before_any_step(
        small_data_dir, tmp_path, capsys):
    tokens = data.windows_per_epoch(shards.load_manifest(small_data_dir), "train", 64) * 64
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
