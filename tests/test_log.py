"""log.py: the peak-FLOP table, the memory estimate's activation constant, the log line, what
the banner says an evaluation reads, and what reaches wandb."""

import dataclasses
import io
import json
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import config
import data
import optim
import train
from conftest import KeptForBackward, micro_config
from model import Block, Transformer, document_dense_mask, rope_cos_sin
from train import StepResult
from plumbing import log, overrides, shards


def test_peak_flops_table():
    assert log.peak_flops("NVIDIA H200") == 989e12
    assert log.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert log.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert log.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert log.peak_flops("NVIDIA L4") == 121e12
    assert log.peak_flops("cpu") is None


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA RTX A1000 6GB Laptop GPU",
                                  "NVIDIA H100", "NVIDIA H200 NVL", "Tesla T4"])
def test_a_card_the_table_does_not_name_exactly_has_no_peak(name):
    """A card whose name only contains a known one is another card: its MFU is n/a, not
    the L4's (for the L40) or the A100's (for an RTX A1000)."""
    assert log.peak_flops(name) is None


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_activation_constants_of_the_memory_estimate(mode, bf16):
    """Recount the bytes a Stack-100M-shaped block's forward leaves for backward, per token,
    with each recomputation mode (conftest.KeptForBackward: the storages still alive; the
    slope between two batch sizes, so the weights' bf16 copies cancel out)."""
    cfg = dataclasses.replace(config.StackConfig(), n_layers=1, vocab_size=512)
    block = Block(cfg, layer=0)  # a RoPE layer, as three in four are
    block.recompute = mode

    def kept(batch_size: int, seq_len: int = 128) -> int:
        x = torch.randn(batch_size, seq_len, cfg.d_model, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(seq_len).expand(batch_size, seq_len),
                                cfg.head_size, cfg.rope_theta)
        mask = document_dense_mask(torch.zeros(batch_size, seq_len, dtype=torch.long))
        keeper = KeptForBackward(exclude=[*block.parameters(), x, cos, sin, mask])
        with keeper, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = block(x, cos, sin, mask)  # noqa: F841 (kept alive, as the loss keeps it)
        return keeper.bytes()
    per_token = (kept(4) - kept(2)) / (2 * 128)
    expected = log.ACTIVATION_BYTES_PER_D[mode][bf16] * cfg.d_model
    assert per_token == pytest.approx(expected, rel=0.05)


def test_memory_estimate_counts_optimizer_state_and_recomputed_blocks():
    """Plain arithmetic for the weights and optimizer terms: 8 bytes per parameter for fp32
    weights + grads, 4 per Muon parameter, 8 per AdamW parameter, divided by the ranks
    under FSDP; recomputing every block leaves one block's activations plus the inputs."""
    cfg = config.stack100m()
    n, n_muon, gib = 100_000_000, 80_000_000, 2**30
    plain = log.memory_estimate(cfg, n, n_muon, world=1, sharded=False, bf16=True)
    assert plain["weights+grads"] == pytest.approx(8 * n / gib)
    assert plain["optimizer"] == pytest.approx((4 * n_muon + 8 * 20_000_000) / gib)
    sharded = log.memory_estimate(cfg, n, n_muon, world=4, sharded=True, bf16=True)
    assert sharded["optimizer"] == pytest.approx(plain["optimizer"] / 4)
    full = log.memory_estimate(overrides.apply_overrides(cfg, {"activation_recompute": "full"}),
                                  n, n_muon, world=1, sharded=False, bf16=True)
    tokens, d = cfg.micro_batch_size * cfg.seq_len, cfg.model.d_model
    block, block_input, selective = tokens * 64 * d, tokens * d * 2, tokens * 16 * d
    assert full["activations"] == pytest.approx((30 * block_input + block) / gib)
    assert plain["activations"] == pytest.approx(30 * block / gib)
    # every-4 recomputes blocks 0, 4, …, 28 (model.py's rule, layer % 4 == 0): 8 of 30
    every4 = log.memory_estimate(overrides.apply_overrides(cfg, {"activation_recompute": "every-4"}),
                                 n, n_muon, world=1, sharded=False, bf16=True)
    assert every4["activations"] == pytest.approx((22 * block + 8 * block_input + block) / gib)
    selectively = overrides.apply_overrides(cfg, {"activation_recompute": "selective"})
    some = log.memory_estimate(selectively, n, n_muon, world=1, sharded=False, bf16=True)
    assert some["activations"] == pytest.approx((30 * selective + block) / gib)


def test_each_loss_head_is_estimated_for_what_it_holds():
    """The plain head (tiny's, ce_chunk_size 0): all 16 × 256 rows of 4,096 logits, 4 bytes
    each in fp32 or 2 in bf16, beside the loss's fp32 log-probabilities. The chunked head:
    one chunk's fp32 buffer, and its gradient's bf16 copy with loss_head_dtype=bf16."""
    def loss_head(cfg, bf16):
        return log.memory_estimate(cfg, 4_000_000, 3_000_000, world=1, sharded=False,
                                   bf16=bf16)["loss_head"] * 2**30
    tiny = config.tiny()
    assert tiny.model.ce_chunk_size == 0
    assert loss_head(tiny, bf16=False) == 16 * 256 * 4096 * (4 + 4)
    assert loss_head(tiny, bf16=True) == 16 * 256 * 4096 * (2 + 4)
    chunked = overrides.apply_overrides(tiny, {"model.ce_chunk_size": 1024})
    assert loss_head(chunked, bf16=True) == 1024 * 4096 * 4
    chunked16 = overrides.apply_overrides(chunked, {"loss_head_dtype": "bf16"})
    assert loss_head(chunked16, bf16=True) == 1024 * 4096 * (4 + 2)
    whole = overrides.apply_overrides(tiny, {"model.ce_chunk_size": 100_000})
    assert loss_head(whole, bf16=False) == 16 * 256 * 4096 * 4  # a chunk past all the rows


def test_readmes_memory_table_is_the_banners_estimate():
    """docs/scale.md's overrides per GPU memory quote the start-up banner's estimate for Stack-100M
    on one bf16 GPU (per rank, unsharded: DDP's too), to the digits shown; "none" is the
    preset itself, micro-batch 32 without recomputation."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "scale.md").read_text()
    section = readme.split("| GPU memory | overrides | estimate |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| (.+?) \| ([\d.]+) GiB \|$", section, re.M)
    assert len(rows) == 5 and rows[0][0] == "none (micro 32, no recomputation)"
    preset = config.stack100m()
    assert (preset.micro_batch_size, preset.activation_recompute) == (32, "none")
    hardware = log.Hardware(1, "cuda:0", "NO", "bf16", True, "NVIDIA H100")
    for flags, quoted in rows:
        cfg = overrides.apply_overrides(preset, dict(re.findall(r"--([\w.]+)=([\w-]+)", flags)))
        with torch.device("meta"):  # the shapes alone: no memory, no time
            model = Transformer(cfg.model)
        facts = log.RunFacts(hardware, "abc", [], {cfg.data_dir: 1.0}, {cfg.data_dir: 10})
        text = log.banner(cfg, facts, model, optim.build_optimizers(model, cfg), "schedule",
                          {"causal": 1.0, "palm": 1.0})
        [total] = re.findall(r"^memory estimate per rank: .* = ([\d.]+) GiB", text, re.M)
        digits = len(quoted.partition(".")[2])
        assert f"{float(total):.{digits}f}" == quoted, flags


def logged_run(step: int, lrs: dict[str, float]):
    """What log_train reads of a train.Run: the step, the rates, the counters, the loader's
    per-source tokens and new epochs (none here)."""
    loader = types.SimpleNamespace(tokens_read=dict, take_new_epochs=dict)
    optimizers = types.SimpleNamespace(lrs=lambda: lrs)
    return types.SimpleNamespace(step=step, optimizers=optimizers, tokens_seen=step * 4096,
                                 skipped_steps=0, loader=loader)


def test_log_line_labels_each_learning_rate(tmp_path, monkeypatch):
    """The rates are labelled by optimizer, in the order given, and the metrics record
    carries the same numbers under lr_<name>."""
    cfg = overrides.apply_overrides(config.tiny(), {"out_dir": str(tmp_path), "write_report": False})
    flops = {"causal": 1e9, "palm": 2e9}
    printed = io.StringIO()
    monkeypatch.setattr("sys.stdout", printed)
    with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, flops, start_step=0) as logger:
        result = StepResult(4.0, 3.99, 0.01, 0.5, skipped=False, stop=False, seconds=2.0)
        logger.log_train(logged_run(10, {"muon": 6e-3, "adamw": 3e-3}), result,
                         train_seconds=2.0)
    assert "| lr muon 6.00e-03 adamw 3.00e-03 |" in printed.getvalue()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert (record["lr_muon"], record["lr_adamw"]) == (6e-3, 3e-3)
    # Independent arithmetic: 10 steps of 4,096 tokens in 2 s, 1e9 FLOP per token.
    assert record["tokens_per_s"] == pytest.approx(20480)
    assert record["tflops"] == pytest.approx(20480 * 1e9 / 1e12)


def test_wandb_gets_every_train_eval_and_skip_record_that_metrics_jsonl_gets(tmp_path,
                                                                            monkeypatch):
    """README: the val loss and each task's acc, acc_norm and acc_bytes are logged "on the
    eval line, in metrics.jsonl and wandb", as every train number is. wandb itself is stood
    in for (what the logger hands it is this project's promise): each train, eval and skip
    record of metrics.jsonl reaches wandb's log() whole, at its step, and nothing else."""
    logged, inits = [], []

    class Run:
        def log(self, record, step):
            logged.append((step, record))

        def finish(self):
            logged.append("finished")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kwargs: inits.append(kwargs) or Run()))
    cfg = overrides.apply_overrides(config.tiny(), {"out_dir": str(tmp_path), "write_report": False,
                                                 "wandb_mode": "offline"})
    monkeypatch.setattr("sys.stdout", io.StringIO())
    with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, {"causal": 1e9, "palm": 2e9},
                           start_step=0) as logger:
        logger.log_start({"step": 0, "tokens_seen": 0})
        logger.log_eval(0, 0, {"val_loss": 8.3, "val_bpb": 3.6, "acc/t": 0.31, "acc_norm/t": 0.3,
                               "acc_bytes/t": 0.32, "chance/t": 0.25})
        logger.log_train(logged_run(10, {"muon": 6e-3, "adamw": 3e-3}),
                         StepResult(4.0, 3.99, 0.01, 0.5, False, False, 2.0), train_seconds=2.0)
        logger.log_skipped(11, float("nan"), float("nan"), 1)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sent = [r for r in records if r["kind"] in ("train", "eval", "skip")]
    assert [r["kind"] for r in sent] == ["eval", "train", "skip"]
    assert logged == [(r["step"], {k: v for k, v in r.items() if k != "kind"}) for r in sent] \
        + ["finished"]
    assert logged[0][1]["acc_bytes/t"] == 0.32
    assert [(i["mode"], i["config"]["out_dir"]) for i in inits] == [("offline", str(tmp_path))]


def test_no_progress_bar_when_not_a_terminal(tmp_path, capsys):
    """Redirected output gets plain lines only: no carriage returns from a tqdm bar."""
    cfg = overrides.apply_overrides(config.tiny(), {"out_dir": str(tmp_path), "write_report": False})
    with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, {"causal": 1.0, "palm": 1.0},
                           start_step=0) as logger:
        for step in (10, 20):
            logger.log_train(logged_run(step, {"muon": 1e-3, "adamw": 1e-3}),
                             StepResult(1.0, 1.0, 0.0, 1.0, False, False, 1.0),
                             train_seconds=step)
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    assert out.out.count("step ") == 2


@pytest.mark.parametrize("device, says", [("cpu", "the process's peak resident memory"),
                                          ("cuda:0", "the measured peak of allocated tensors")])
def test_banner_names_the_loss_unit_and_what_the_mem_column_measures(device, says):
    cfg = config.tiny()
    model = Transformer(cfg.model)
    facts = log.RunFacts(log.Hardware(1, device, "NO", "no", False), "abc1234", [],
                         {cfg.data_dir: 1.0}, {cfg.data_dir: 262})
    text = log.banner(cfg, facts, model, optim.build_optimizers(model, cfg), "schedule",
                      {"causal": 1.0, "palm": 1.0})
    assert "loss: cross-entropy + z-loss in nats per target token" in text
    [line] = [line for line in text.splitlines() if line.startswith("memory estimate per rank")]
    assert says in line


def test_the_banner_says_what_an_evaluation_covers():
    """eval_tokens none reads all of a val split; a smaller eval_tokens reads that many
    whole windows of each source's split, and the banner gives the share. An evaluation
    that costs over half the training compute between evaluations is warned about."""
    tiny = config.tiny()  # eval_tokens none
    assert log.eval_coverage(tiny, {"data/a": 262}) == [
        "eval every 100 steps: all of data/a's val (262 windows of 256 tokens); 67,072 val "
        "tokens per evaluation"]
    part = overrides.apply_overrides(config.tiny(), {"eval_tokens": 65_536})  # 256 windows
    assert log.eval_coverage(part, {"data/a": 262, "data/b": 100}) == [
        "eval every 100 steps: 256 of data/a's 262 val windows (97.7%); all of data/b's val "
        "(100 windows of 256 tokens); 91,136 val tokens per evaluation"]
    # plain math: a forward is 2 of a trained token's 6 FLOPs per parameter, and 100 steps
    # train 409,600 tokens: 3,200 windows cost 819,200 / 3 / 409,600 = 67%; 2,400, half
    for windows, warned in ((3_200, ["warning: an evaluation costs ~67% of the training "
                                     "compute between evaluations; set eval_tokens (val "
                                     "tokens per source; now none: all of val) or a larger "
                                     "eval_every"]),
                            (2_400, []), (2_000_000, ["~41667%"])):
        lines = log.eval_coverage(tiny, {"data/big": windows})
        assert len(lines) == 1 + len(warned) and all(w in line for w, line in
                                                     zip(warned, lines[1:]))


def test_setup_says_what_an_evaluation_reads_and_warns_where_it_costs_most(small_data_dir,
                                                                          tmp_path, capsys):
    """What train.setup prints, not only eval_coverage's lines. A micro run trains 4 steps ×
    512 tokens between evaluations; all of small_data_dir's val (472 windows of 64, counted
    from the manifest here) is 472·64 forward tokens, each a third of a trained token's
    compute: ~492% of the training between evaluations, warned about. The fix the warning
    names, followed (eval_tokens 1,024), is not warned about."""
    windows = data.windows_per_epoch(shards.load_manifest(small_data_dir), "val", 64)
    cfg = micro_config(small_data_dir, str(tmp_path / "all"), eval_tokens=None)
    train.setup(cfg)
    printed = capsys.readouterr().out
    assert f"\neval every 4 steps: all of {small_data_dir}'s val ({windows:,} windows of 64 " \
           f"tokens); {windows * 64:,} val tokens per evaluation\n" in printed
    assert f"\nwarning: an evaluation costs ~{windows * 64 / 3 / (4 * 512):.0%} of the training " \
           f"compute between evaluations; set eval_tokens (val tokens per source; now none: " \
           f"all of val) or a larger eval_every\n" in printed
    train.setup(dataclasses.replace(cfg, eval_tokens=1024, out_dir=str(tmp_path / "part")))
    printed = capsys.readouterr().out
    assert f"\neval every 4 steps: 16 of {small_data_dir}'s {windows:,} val windows " \
           f"({16 / windows:.1%}); 1,024 val tokens per evaluation\n" in printed
    assert "warning: an evaluation" not in printed


def test_tensorboard_holds_every_number_of_the_train_and_eval_records(small_data_dir, tmp_path,
                                                                     monkeypatch):
    """--tensorboard=true: out_dir/tb/ gets one folder per start, and read back with
    tensorboard's own reader it holds each non-null number of metrics.jsonl's train and eval
    records (losses, lrs, tokens/s, TFLOP/s, memory, val losses per source, accuracies), at
    its step, to float32's rounding; MFU, null on a CPU, is absent. A resumed start writes a
    folder of its own. Each start's writer is closed when its run returns: the thread that
    writes its events to disk has written the last and ended (a writer left open may still
    hold events in its queue, lost when the process exits)."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing."
                                            "event_accumulator")
    from tensorboard.summary.writer.record_writer import RecordWriter
    write, writers = RecordWriter.write, set()

    def recorded(self, data):  # called on the writer's own thread
        writers.add(threading.current_thread())
        return write(self, data)
    monkeypatch.setattr(RecordWriter, "write", recorded)
    out = tmp_path / "run"
    train.main(micro_config(small_data_dir, str(out), tensorboard=True, stop_at_step=4,
                            downstream="nextline", downstream_items=4))
    train.main(micro_config(small_data_dir, str(out), tensorboard=True))  # resumes at 4
    assert len(writers) == 2 and not any(thread.is_alive() for thread in writers)
    starts = sorted((out / "tb").iterdir())
    assert [p.name.endswith(f"-step{s}") for p, s in zip(starts, (0, 4))] == [True, True]
    seen = {}
    for start in starts:
        events = event_accumulator.EventAccumulator(str(start), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            seen.update({(tag, e.step): e.value for e in events.Scalars(tag)})
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = {(f"{r['kind']}/{k}", r["step"]): v for r in records if r["kind"] in ("train", "eval")
            for k, v in r.items() if k not in ("kind", "step") and v is not None}
    assert {"train/loss", "train/lr_muon", "train/tflops", "eval/val_loss",
            "eval/acc/nextline"} <= {tag for tag, _ in want}
    assert set(seen) == set(want)
    for key, value in want.items():
        assert seen[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    assert not any(tag.startswith("train/mfu") for tag, _ in seen)


def test_tensorboard_missing_is_one_line_with_its_install_command(monkeypatch, tmp_path):
    """The package is optional: without it, --tensorboard=true is refused before any work,
    naming the install command."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    with pytest.raises(ValueError, match=r"needs the tensorboard package: pip install "
                                         r"tensorboard"):
        log.check_tensorboard(str(tmp_path))
