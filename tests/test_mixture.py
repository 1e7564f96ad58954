"""The recipe's data: weighted mixtures of prepared directories, in stages, exactly resumable
on any number of ranks; the anneal handoff from a stable checkpoint; what a resume may and
may not change; per-source validation and the run's data plan."""

import dataclasses
import json
from fractions import Fraction
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import config
import data
import export
import prepare
import report
import sample
import train
from conftest import micro_config
from model import Transformer
from test_data_at_scale import single_window_evaluation
from test_errors import run_cli
from test_report import records, series, table
from test_train import REPO, checkpoint_weights, train_records
from plumbing import overrides, resume, shards

T = 32


@pytest.fixture(scope="module")
def sources(small_data_dir, tmp_path_factory) -> list[str]:
    """Three prepared directories with one tokenizer: small_data_dir and two more packages
    of the standard library, encoded with small_data_dir's tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dirs = [small_data_dir]
    for package in ("xml", "multiprocessing"):
        text = tmp_path_factory.mktemp(f"{package}_text")
        for path in sorted((stdlib / package).rglob("*.py")):
            shutil.copy(path, text / f"{path.parent.name}_{path.stem}.txt")
        out = tmp_path_factory.mktemp(package) / package
        prepare.prepare(str(text), str(out), val_fraction=0.2,
                        tokenizer=str(Path(small_data_dir) / "tokenizer.json"))
        dirs.append(str(out))
    return dirs


@pytest.fixture(scope="module")
def foreign(small_data_dir, tmp_path_factory) -> str:
    """A source nothing like the others: 60 documents of random Greek words, encoded with
    small_data_dir's tokenizer (trained on Python, it spells Greek letters as bytes)."""
    rng = np.random.default_rng(0)
    letters = list("αβγδεζηθικλμνξοπρστυφχψω")
    text = tmp_path_factory.mktemp("greek_text")
    for i in range(60):
        words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(120)]
        (text / f"doc_{i:02d}.txt").write_text(" ".join(words), encoding="utf-8")
    out = tmp_path_factory.mktemp("greek") / "greek"
    prepare.prepare(str(text), str(out), val_fraction=0.2,
                    tokenizer=str(Path(small_data_dir) / "tokenizer.json"))
    return str(out)


# ---------------------------------------------------------------------------------------
# The interleaving rule and the loader, against plain counting
# ---------------------------------------------------------------------------------------

def test_every_prefix_and_every_batch_holds_each_share(sources):
    """For random weights: each source's count in every prefix of the stream is within one
    window of prefix × share, and within two in every global batch; each source's windows
    come in their own order (j = 0, 1, 2, ...); a stretch computed alone equals the same
    stretch of a longer call."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        weights = rng.integers(1, 40, size=rng.integers(1, 6)).tolist()
        source, index = data.interleave(weights, 0, 4000)
        shares = np.array(weights) / sum(weights)
        counts = np.stack([np.cumsum(source == i) for i in range(len(weights))], axis=1)
        prefix = np.arange(1, 4001)[:, None]
        assert np.abs(counts - prefix * shares).max() <= 1.0, weights
        batch = int(rng.integers(1, 100))
        for first in range(0, 4000 - batch, batch):
            got = np.bincount(source[first:first + batch], minlength=len(weights))
            assert np.abs(got - batch * shares).max() <= 2.0, (weights, batch)
        for i in range(len(weights)):
            assert np.array_equal(index[source == i], np.arange((source == i).sum()))
        first, count = int(rng.integers(0, 3000)), int(rng.integers(1, 1000))
        alone = data.interleave(weights, first, count)
        assert np.array_equal(alone[0], source[first:first + count])
        assert np.array_equal(alone[1], index[first:first + count])


def test_the_stream_takes_every_sources_windows_in_key_order():
    """README's rule, by sorting: window j of source i has the key (j + 1/2) / w_i, and the
    stream is every window in key order, a tie going to the source listed first."""
    rng = np.random.default_rng(2)
    for weights in [[1, 1], [3, 1], [2, 3], [7, 2, 1], [5, 5, 2]] + [
            rng.integers(1, 12, size=rng.integers(2, 5)).tolist() for _ in range(20)]:
        keys = sorted((Fraction(2 * j + 1, 2 * w), i, j)
                      for i, w in enumerate(weights) for j in range(300 * w // sum(weights) + 2))
        source, index = data.interleave(weights, 0, 300)
        assert list(zip(source.tolist(), index.tolist())) == [(i, j) for _, i, j in keys[:300]], \
            weights


def test_weights_become_the_smallest_integers_in_the_same_ratio():
    assert data.integer_weights([7, 2, 1]) == [7, 2, 1]
    assert data.integer_weights([0.6, 0.3, 0.1]) == [6, 3, 1]
    assert data.integer_weights([0.5, 0.5]) == [1, 1]
    assert data.integer_weights([2 / 3, 1 / 3]) == [2, 1]


def rows_of(batch) -> list[tuple]:
    return [tuple(row) for row in batch["input_ids"].tolist()]


def stream_rows(stages, world, steps, windows_per_step, state=None, first_step=0):
    """Rows of `steps` optimizer steps of the mixture, every rank's rows in rank order, and
    the state after them (equal on every rank)."""
    B = windows_per_step // world
    loaders = [data.MixtureLoader(stages, T, B, rank, world, seed=5) for rank in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    rows = []
    for step in range(first_step, first_step + steps):
        for loader in loaders:
            loader.set_step(step)
        rows += [row for loader in loaders for row in rows_of(next(loader))]
    states = {json.dumps(loader.state_dict(), sort_keys=True) for loader in loaders}
    assert len(states) == 1  # one cursor for all ranks
    return rows, loaders[0].state_dict()


def test_resume_at_a_random_cursor_on_1_2_3_ranks_is_the_uninterrupted_stream(sources):
    stages = [data.Stage(0, ((sources[0], 0.5), (sources[1], 0.3), (sources[2], 0.2))),
              data.Stage(7, ((sources[2], 0.75), (sources[0], 0.25)))]
    whole, _ = stream_rows(stages, 1, 12, 6)
    rng = np.random.default_rng(1)
    for world in (1, 2, 3):
        cut = int(rng.integers(1, 11))
        head, state = stream_rows(stages, 1, cut, 6)
        tail, _ = stream_rows(stages, world, 12 - cut, 6, state, first_step=cut)
        assert head + tail == whole, (world, cut)


def test_a_source_continues_its_own_order_across_stages(sources):
    """Each source's rows are its own shuffled stream (a plain PackedShardLoader's), in
    order, whatever the other sources and stages: source 0 gives its windows 0.. in stage 0
    and goes on from there in stage 1, never restarting."""
    stages = [data.Stage(0, ((sources[0], 0.5), (sources[1], 0.5))),
              data.Stage(3, ((sources[1], 0.25), (sources[0], 0.75)))]
    rows, state = stream_rows(stages, 1, 6, 8)
    alone = data.PackedShardLoader(sources[0], "train", T, 1, seed=5)
    own = [rows_of(next(alone))[0] for _ in range(state["consumed"][sources[0]])]
    mine = set(own)
    assert [row for row in rows if row in mine] == own
    # 3 steps of 8 windows at 1:1, then 3 at 3:1 (each stage's 24 windows split exactly)
    assert state["consumed"] == {sources[0]: 12 + 18, sources[1]: 12 + 6}


def test_a_sources_order_does_not_depend_on_its_place_in_the_list(sources):
    a = data.MixtureLoader([data.Stage(0, ((sources[0], 0.5), (sources[1], 0.5)))], T, 8)
    b = data.MixtureLoader([data.Stage(0, ((sources[1], 0.5), (sources[0], 0.5)))], T, 8)
    rows_a, rows_b = rows_of(next(a)), rows_of(next(b))
    assert sorted(rows_a) == sorted(rows_b) and rows_a != rows_b  # same windows, other slots


# ---------------------------------------------------------------------------------------
# Configuration: the mixture syntax, stages, refusals
# ---------------------------------------------------------------------------------------

def test_mixture_syntax_and_stages():
    assert config.parse_mixture("a:7,b:2,c:1") == (("a", 0.7), ("b", 0.2), ("c", 0.1))
    assert config.parse_mixture("data/x") == (("data/x", 1.0),)
    cfg = dataclasses.replace(config.tiny(), data_dir="a:3,b:1", anneal_data_dir="p",
                              data_stages=({"start": 100, "data_dir": "b"},))
    assert cfg.stages(240) == [(0, (("a", 0.75), ("b", 0.25))), (100, (("b", 1.0),)),
                               (240, (("p", 1.0),))]
    for spec, message in [("a:0", "positive weight"), ("a:x", "positive weight"),
                          ("a:1,a:2", "names a directory twice"), (":3", "DIR:WEIGHT")]:
        with pytest.raises(ValueError, match=message):
            config.parse_mixture(spec)
    with pytest.raises(ValueError, match="anneal_data_dir and data_stages\\[0\\] both start "
                                         "at step 240"):
        dataclasses.replace(cfg, data_stages=({"start": 240, "data_dir": "b"},)).stages(240)
    with pytest.raises(ValueError, match="holds start = STEP"):
        dataclasses.replace(cfg, data_stages=({"start": "soon", "data_dir": "b"},))


def test_a_toml_file_lists_stages(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('data_dir = "a:2,b:1"\n[[data_stages]]\nstart = 50\ndata_dir = "c"\n')
    cfg, _ = overrides.parse_args(["--preset", "tiny", "--config", str(toml)])
    assert cfg.stages(240) == [(0, (("a", 2 / 3), ("b", 1 / 3))), (50, (("c", 1.0),))]


def test_the_recipe_file_holds_the_mixture_and_the_anneal_readme_names(monkeypatch):
    """configs/smollm_mixture.toml under the stack100m preset: the stable mix of README
    (0.86, 0.11, 0.03) from step 0, the anneal from decay_start, and a run that stops at the
    end of the stable phase, step 34,332, where the anneal's checkpoint is."""
    monkeypatch.chdir(REPO)
    cfg, _ = overrides.parse_args(["--preset", "stack100m", "--config",
                                "configs/smollm_mixture.toml"])
    assert cfg.stop_at_step == config.wsd_phases(cfg).decay_start == 34_332
    (start, stable), (anneal_start, anneal) = cfg.stages(34_332)
    assert (start, anneal_start) == (0, 34_332)
    assert dict(stable) == pytest.approx({"data/fwe-dedup": 0.86, "data/cosmo": 0.11,
                                          "data/finemath": 0.03})
    assert dict(anneal) == pytest.approx({"data/fwe-dedup": 0.4, "data/cosmo": 0.3,
                                          "data/finemath": 0.3})


def test_sources_with_different_tokenizers_are_refused_naming_both(sources, prepared,
                                                                   tmp_path, capsys):
    cfg = micro_config(f"{sources[0]}:1,{prepared}:1", str(tmp_path))
    err = run_cli(train_cli_args(cfg), capsys)
    assert f"{sources[0]} and {prepared} were prepared with different tokenizers" in err


def train_cli_args(cfg) -> list[str]:
    from test_train import cli_args
    return cli_args(cfg)


# ---------------------------------------------------------------------------------------
# The run: the handoff, what a resume may change, per-source validation, the plan
# ---------------------------------------------------------------------------------------

def tiny_run(data_dir: str, out_dir: str, **knobs) -> config.TrainConfig:
    """The `tiny` preset with 2 layers of width 64, shortened to 20 steps of 1,024 tokens
    whose decay leg begins at step 16, on the test sources (their 512-token vocabulary fits
    tiny's 4,096)."""
    cfg = overrides.apply_overrides(config.tiny(), {
        "micro_batch_size": 4, "global_batch_tokens": 1024, "model.n_layers": 2,
        "model.d_model": 64, "model.intermediate": 176,
        "data_dir": data_dir, "out_dir": out_dir, "total_steps": 20, "stop_at_step": 20,
        "warmup_steps": 2, "decay_fraction": 0.2, "log_every": 1, "eval_every": 10,
        "eval_tokens": 2048, "ckpt_every": 8, "sample_tokens": 4, "compile_model": "false",
        # fp32 on any CPU, as every in-process run of the suite: accelerate fixes a process's
        # precision at its first Accelerator, and auto picks bf16 on a CPU that computes it
        "mixed_precision": "no",
        "downstream": ""})  # the next-line task is tested in test_downstream.py
    return overrides.apply_overrides(cfg, knobs)


def losses(cfg) -> list[tuple]:
    return [(r["step"], r["loss"]) for r in train_records(cfg)]


def test_the_handoff_trains_exactly_as_both_stages_from_the_start(sources, tmp_path):
    """The stable run stops at decay_start; resumed with --anneal_data_dir and a later
    stop, it trains bitwise as the run configured with both stages from the start. The
    stable folder is never altered by an anneal branched from it into a new out_dir."""
    stable_mix, anneal = f"{sources[0]}:3,{sources[1]}:1", sources[2]
    both = tiny_run(stable_mix, str(tmp_path / "both"), anneal_data_dir=anneal)
    train.main(both)

    stable = tiny_run(stable_mix, str(tmp_path / "stable"), stop_at_step=16)
    train.main(stable)
    before = {p: p.stat().st_mtime_ns for p in Path(stable.out_dir).rglob("*")}
    branch = dataclasses.replace(stable, out_dir=str(tmp_path / "branch"), stop_at_step=20,
                                 anneal_data_dir=anneal,
                                 resume=str(Path(stable.out_dir) / "ckpt" / "step_0000016"))
    metrics = train.main(branch)
    assert {p: p.stat().st_mtime_ns for p in Path(stable.out_dir).rglob("*")} == before
    assert metrics["sample"].startswith(branch.sample_prompt)  # the end-of-run sample works
    exported, _, _ = sample.load_export(str(export.export(branch.out_dir)))
    assert exported.cfg == branch.model  # and so does the export, after a mixture and anneal
    assert losses(branch) == [r for r in losses(both) if r[0] > 16]
    assert checkpoint_weights_equal(both, branch, 20)

    same_folder = dataclasses.replace(stable, stop_at_step=20, anneal_data_dir=anneal,
                                      ckpt_every=2)  # keep_last_ckpts=2 would prune step 16
    train.main(same_folder)  # continues in the stable run's own out_dir
    assert losses(same_folder) == losses(both)
    assert (Path(stable.out_dir) / "ckpt" / "step_0000016").is_dir()  # the branch point stays
    # the anneal's source was evaluated at the resume step, before its first step
    evals = [json.loads(line) for line in (Path(branch.out_dir) / "metrics.jsonl").open()
             if "val_loss" in line]
    assert evals[0]["step"] == 16 and f"val_loss/{anneal}" in evals[0]


def checkpoint_weights_equal(a, b, step) -> bool:
    wa, wb = checkpoint_weights(a, step), checkpoint_weights(b, step)
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_a_stage_begins_on_its_step_and_its_checkpoint_is_never_pruned(sources, tmp_path):
    """Two micro-batches a step; a [[data_stages]] table from step 2. Steps 1 and 2 read the
    first source only, steps 3 to 8 the second only: no global batch spans the switch. With
    keep_last_ckpts=1, the checkpoints where the stage begins (2) and where the decay leg
    begins (6) are kept beside the newest (8); step 4's is pruned."""
    a, b = sources[0], sources[1]
    cfg = dataclasses.replace(micro_config(a, str(tmp_path), ckpt_every=2, keep_last_ckpts=1),
                              data_stages=({"start": 2, "data_dir": b},))
    assert cfg.grad_accum_steps(1) == 2 and config.wsd_phases(cfg).decay_start == 6
    train.main(cfg)
    batch = cfg.global_batch_tokens
    read = [(r["step"], r[f"tokens/{a}"], r[f"tokens/{b}"]) for r in train_records(cfg)]
    assert read == [(step, min(step, 2) * batch, max(0, step - 2) * batch)
                    for step in range(1, 9)]
    kept = sorted(p.name for p in (Path(cfg.out_dir) / "ckpt").iterdir())
    assert kept == ["step_0000002", "step_0000006", "step_0000008"]


def test_a_begun_stage_cannot_change_and_a_later_one_can(sources, tmp_path, capsys):
    cfg = micro_config(f"{sources[0]}:1,{sources[1]}:1", str(tmp_path), stop_at_step=4,
                       total_steps=8, decay_start=6)
    train.main(cfg)
    with pytest.raises(ValueError, match=f"the stage from step 0: {sources[0]}:0.5,"
                                         f"{sources[1]}:0.5 → {sources[0]}:0.75,"
                                         f"{sources[1]}:0.25: a stage that has begun"):
        train.main(dataclasses.replace(cfg, data_dir=f"{sources[0]}:3,{sources[1]}:1",
                                       stop_at_step=8))
    with pytest.raises(ValueError, match="the stage from step 2: none → "):
        train.main(dataclasses.replace(cfg, stop_at_step=8, data_stages=(
            {"start": 2, "data_dir": sources[2]},)))
    capsys.readouterr()
    train.main(dataclasses.replace(cfg, stop_at_step=8, data_stages=(
        {"start": 5, "data_dir": sources[2]},)))
    assert f"resume: data stage from step 5 added: {sources[2]}:1" in capsys.readouterr().out


def test_a_stage_that_has_not_begun_may_be_edited_and_the_run_says_so():
    """README: a stage that begins at the resume step or later may be added **or edited**.
    Saved: a then b from step 6; resumed at step 4 with c from step 6: not refused, and the
    line names the edit as a change (an added stage says "added")."""
    saved = [[0, [["a", 1.0]]], [6, [["b", 1.0]]]]
    ours = [(0, (("a", 1.0),)), (6, (("c", 1.0),))]
    assert resume.check_stages(saved, ours, 4) == ["resume: data stage from step 6 changed: c:1"]
    assert resume.check_stages(saved, ours, 6) == ["resume: data stage from step 6 changed: c:1"]
    with pytest.raises(ValueError, match="the stage from step 6: b:1 → c:1"):
        resume.check_stages(saved, ours, 7)  # begun at 6: refused


def test_a_checkpoint_from_before_mixtures_resumes_as_a_mixture_of_one(small_data_dir,
                                                                       tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=4)
    train.main(cfg)
    state_path = Path(cfg.out_dir) / "ckpt" / "step_0000004" / "train_state.json"
    state = json.loads(state_path.read_text())
    manifest = shards.load_manifest(small_data_dir)
    state.pop("stages")
    state["data_sha256"] = shards.fingerprint(manifest)
    state["loader"] = {"split": "train", "cursor": state["loader"]["cursor"], "seed": cfg.seed,
                       "seq_len": cfg.seq_len, "windows_per_epoch": 1, "data_sha256": "x",
                       "epoch": 0}
    state_path.write_text(json.dumps(state))
    train.main(dataclasses.replace(cfg, stop_at_step=8))
    assert [r["step"] for r in train_records(cfg)] == list(range(1, 9))


def test_each_source_is_validated_and_the_mixture_is_its_first_stage_mean(sources, tmp_path):
    cfg = micro_config(f"{sources[0]}:3,{sources[1]}:1", str(tmp_path), stop_at_step=2,
                       eval_every=2, anneal_data_dir=sources[2], total_steps=8)
    metrics = train.main(cfg)
    for source in sources:
        assert f"val_loss/{source}" in metrics and f"val_bpb/{source}" in metrics
    assert metrics["val_loss"] == pytest.approx(0.75 * metrics[f"val_loss/{sources[0]}"]
                                                + 0.25 * metrics[f"val_loss/{sources[1]}"])
    records = train_records(cfg)
    seen = sum(v for k, v in records[-1].items() if k.startswith("tokens/"))
    assert seen == records[-1]["tokens_seen"] == 2 * cfg.global_batch_tokens
    share = records[-1][f"tokens/{sources[0]}"] / seen
    assert abs(share - 0.75) <= 2 * cfg.seq_len / seen  # within two windows of its share


def test_each_source_is_scored_on_its_own_val_split(sources, foreign, tmp_path):
    """Six steps on Python alone, then the anneal on Greek text from step 6 (decay_start).
    At step 6 the Python source's val loss is far below the Greek one's, and each equals the
    oracle on its own val split with the step-6 weights; at step 7, inside the anneal,
    `val_loss` is still the first stage's mean: the Python source's, not the Greek one's."""
    python = sources[0]
    cfg = micro_config(python, str(tmp_path), anneal_data_dir=foreign, eval_every=6,
                       ckpt_every=6, stop_at_step=7, decay_start=6)
    train.main(cfg)
    evals = {r["step"]: r for r in records(tmp_path, "eval")}
    assert sorted(evals) == [0, 6, 7]
    assert all(f"val_loss/{d}" in evals[0] and f"val_bpb/{d}" in evals[0]
               for d in (python, foreign))  # from step 0, the anneal's source too
    at6 = evals[6]
    assert at6[f"val_loss/{foreign}"] > at6[f"val_loss/{python}"] + 0.3  # 0.59 apart
    model = Transformer(cfg.model)
    model.load_state_dict(checkpoint_weights(cfg, 6))
    for source in (python, foreign):
        want = single_window_evaluation(cfg, model, source)
        assert at6[f"val_loss/{source}"] == pytest.approx(want["val_loss"], rel=1e-5)
        assert at6[f"val_bpb/{source}"] == pytest.approx(want["val_bpb"], rel=1e-5)
    at7 = evals[7]
    assert at7[f"val_loss/{foreign}"] > at7[f"val_loss/{python}"] + 0.1
    assert at7["val_loss"] == pytest.approx(at7[f"val_loss/{python}"], rel=1e-12)
    assert at7["val_bpb"] == pytest.approx(at7[f"val_bpb/{python}"], rel=1e-12)


def test_the_report_draws_each_source_marks_the_stage_and_states_the_plan(sources, tmp_path):
    """A 3:1 mixture, then the anneal source from step 4: the report draws the mixture's val
    loss and each source's as the log has them, marks the stage on every panel at its step,
    and report.md gives each source's final val loss and the plan's rows as the start
    record holds them."""
    cfg = micro_config(f"{sources[0]}:3,{sources[1]}:1", str(tmp_path), eval_every=2,
                       anneal_data_dir=sources[2], decay_start=4, write_report=True)
    train.main(cfg)
    evals, [start] = records(tmp_path, "eval"), records(tmp_path, "start")
    fig = report.draw([report.read_run(tmp_path)])
    for gid, key in [("val loss", "val_loss"), *((f"val loss/{s}", f"val_loss/{s}")
                                                 for s in sources)]:
        [line] = series(fig, gid, "val loss")
        assert list(line.get_xdata()) == [r["tokens_seen"] for r in evals]
        assert list(line.get_ydata()) == [r[key] for r in evals]
    stage = series(fig, "boundary:data stage:4")
    assert len(stage) == 6 and all(list(line.get_xdata()) == [4 * cfg.global_batch_tokens] * 2
                                   for line in stage)
    text = (tmp_path / "report.md").read_text()
    val = table(text)["val loss, step 8"]
    assert val.startswith(f"{evals[-1]['val_loss']:.4f} (the mixture; ")
    assert all(f"{s} {evals[-1][f'val_loss/{s}']:.4f}" in val for s in sources)
    assert [(r["start"], r["source"]) for r in start["plan"]] == [
        (0, sources[0]), (0, sources[1]), (4, sources[2])]
    for row in start["plan"]:
        assert (f"| {row['start']:,} | {row['source']} | {row['weight']:g} | "
                f"{row['available']:,} | {row['planned']:,} | "
                f"{row['planned'] / row['available']:.2f} |") in text


def test_the_banner_plans_each_stage_and_warns_per_source(sources, tmp_path, capsys):
    """40,000 steps of 512 tokens, decay from step 20,000: every source is read past 4
    epochs, and each gets its own warning."""
    cfg = micro_config(f"{sources[0]}:3,{sources[1]}:1", str(tmp_path), stop_at_step=40_000,
                       total_steps=40_000, warmup_steps=2, decay_start=20_000,
                       anneal_data_dir=sources[2])
    train.setup(cfg)
    out = capsys.readouterr().out
    assert f"data from step 0: {sources[0]} × 0.75, " in out
    assert f"data from step 0: {sources[1]} × 0.25, " in out
    assert f"data from step 20,000: {sources[2]} × 1, " in out
    tokens = {d: data.windows_per_epoch(shards.load_manifest(d), "train", cfg.seq_len)
              * cfg.seq_len for d in sources}
    plan = config.data_plan(cfg, cfg.stages(20_000), tokens)
    assert [(r["start"], r["source"], r["planned"]) for r in plan] == [
        (0, sources[0], 20_000 * 512 * 3 // 4), (0, sources[1], 20_000 * 512 // 4),
        (20_000, sources[2], 20_000 * 512)]
    for row in plan:  # each row: its share, the tokens it holds, planned, and the epochs
        assert (f"data from step {row['start']:,}: {row['source']} × {row['weight']:g}, "
                f"{row['available']:,} train tokens/epoch; this run reads {row['planned']:,} "
                f"tokens = {row['planned'] / row['available']:.2f} epochs") in out
    over = [r["source"] for r in plan if r["planned"] / r["available"] > 4]
    assert over == sources and out.count("warning: this run reads") == 3
    assert all(f"warning: this run reads {source} " in out for source in over)


# ---------------------------------------------------------------------------------------
# A source without a val split (prepare.py --val_fraction 0)
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_val(small_data_dir, tmp_path_factory) -> str:
    """The standard library's `email` package, with small_data_dir's tokenizer and no val."""
    text = tmp_path_factory.mktemp("email_text")
    for path in sorted((Path(sysconfig.get_paths()["stdlib"]) / "email").rglob("*.py")):
        shutil.copy(path, text / f"{path.parent.name}_{path.stem}.txt")
    out = tmp_path_factory.mktemp("no_val") / "no_val"
    prepare.prepare(str(text), str(out), val_fraction=0,
                    tokenizer=str(Path(small_data_dir) / "tokenizer.json"))
    return str(out)


def test_a_source_without_val_trains_unevaluated_and_the_mean_renormalises(sources, no_val,
                                                                          tmp_path, capsys):
    """prepare.py's advice for --val_fraction 0 holds: such a source is trained on (its
    tokens are read) and not evaluated, the banner says so, and the mixture's val_loss is
    the mean of the others under the first stage's shares renormalised: 0.5 and 0.25 of
    the three become 2/3 and 1/3."""
    cfg = micro_config(f"{sources[0]}:2,{sources[1]}:1,{no_val}:1", str(tmp_path),
                       stop_at_step=2, eval_every=2)
    metrics = train.main(cfg)
    out = capsys.readouterr().out
    assert f"val: {no_val} has no val split: trained on, not evaluated" in out
    assert f"val_loss/{no_val}" not in metrics
    assert metrics["val_loss"] == pytest.approx(2 / 3 * metrics[f"val_loss/{sources[0]}"]
                                                + 1 / 3 * metrics[f"val_loss/{sources[1]}"])
    assert train_records(cfg)[-1][f"tokens/{no_val}"] > 0


def test_a_run_with_no_val_split_at_all_is_refused_in_setup(no_val, tmp_path, capsys):
    err = run_cli([f"--data_dir={no_val}", f"--out_dir={tmp_path}", "--preset", "tiny",
                   "--model.vocab_size=512", "--downstream=", "--mixed_precision=no"], capsys)
    assert "no source of this run has a val split" in err and "--val_fraction" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the log opened
