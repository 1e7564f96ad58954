"""The GPU benchmarks' code paths, run where CI can run them: the GPU call
(bench/gpu_check.sh, bench/gpu_sweep.py) as a dry run at micro shapes on the CPU, and its
command lines against the current CLI."""

import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config
import model
import optim
from plumbing import overrides

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import cpu_speed  # noqa: E402
import downstream_cost  # noqa: E402
import gpu_sweep  # noqa: E402


def gpu_call_bounds() -> dict[str, int]:
    """bench/gpu_check.sh's bound on each stage of the GPU call, in seconds, and the call's."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    gpu = script[script.index("  preset=stack100m"):]
    bounds = [int(b) for b in re.search(r"bounds=\(([\d ]+)\)", gpu)[1].split()]
    names = ("versions", "prepare", "cuda_tests", "fsdp2_first", "fsdp2_resumed")
    return {**dict(zip(names, bounds, strict=True)),
            "call": int(re.search(r"call_s=(\d+)", script)[1])}


def test_the_gpu_call_dry_run_runs_every_stage_and_every_sweep_row(tmp_path):
    """`bash bench/gpu_check.sh --dry_run`: the GPU call's every stage on this CPU at micro
    shapes, each within its bound, ending with one JSON line: the versions first, the CUDA
    tests (skipped here), the FSDP2 production path's figures, its checkpoint and its
    resume (steps 1-2, then 3), and a row for every sweep variant in the docs' order, each
    with finite, positive figures (on the GPU a row may say why it has none, out of memory
    say; on this dry run an error is a bug: one such hid a changed train.Run for a while)."""
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry_run"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               # the script's `python` and `accelerate` are this interpreter's,
                               # as on the GPU image, whatever else PATH holds
                               "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                       f"{os.environ['PATH']}",
                               "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report["stages"]) == ["versions", "prepare", "cuda_tests", "fsdp2_first",
                                      "fsdp2_resumed", "sweep"]
    assert all(s["status"] == 0 for s in report["stages"].values()), report["stages"]
    assert report["versions"]["torch"] == torch.__version__
    assert "skipped" in report["cuda_tests"] or "passed" in report["cuda_tests"]
    assert report["saved"] and report["resumed"] and report["steps"] == [1, 2, 3]
    assert report["tokens_per_s"] > 0 and report["peak_memory_gib"] > 0
    assert report["memory_estimate_gib"] is not None
    assert [row["name"] for row in report["sweep"]] == [v.name for v in gpu_sweep.VARIANTS]
    full = json.loads((tmp_path / "out" / "sweep.log").read_text().strip().splitlines()[-1])
    rows = {row["name"]: row for row in full["variants"]}
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        for key in ("tokens_per_s", "peak_gib", "loss"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key, row[key])
        for key in ("mfu", "mfu_palm"):  # no known peak FLOP/s for a CPU: null, not made up
            assert row[key] is None if full["device"] == "cpu" else math.isfinite(row[key])
    assert rows["micro16"]["micro_batch_size"] * 2 == rows["default"]["micro_batch_size"]
    assert [rows[name]["ce_chunk_size"] for name in ("chunk1024", "chunk16384")] == [1024, 16384]


def test_the_gpu_call_fits_its_budget_and_the_docs_give_each_bound():
    """The stages' bounds leave the sweep time within the call (under the device tool's 9
    minutes), the sweep's rows come in the order the docs depend on them, and
    docs/figures.md's plan gives each stage's bound as the script has it."""
    bounds = gpu_call_bounds()
    stages = sum(v for k, v in bounds.items() if k != "call")
    assert bounds["call"] <= 540 and bounds["call"] - stages >= 90, bounds
    names = [v.name for v in gpu_sweep.VARIANTS]
    assert names[:5] == ["default", "recompute_selective", "recompute_full", "chunk1024",
                         "chunk16384"], names
    docs = (REPO / "docs" / "figures.md").read_text()
    for stage, seconds in bounds.items():
        if stage != "call":
            assert re.search(rf"\| `{stage}` \| {seconds} s \|", docs), stage
    for variant in gpu_sweep.VARIANTS:
        bound = gpu_sweep.row_bound(variant, steps=5, warmup=1)
        assert re.search(rf"\| `{variant.name}` \| {bound:.0f} s \|", docs), variant.name


def test_a_failing_variant_becomes_a_row_with_its_error(monkeypatch):
    """An out-of-memory (or compile) error in one variant is its row's error; the sweep
    goes on to the next variant instead of losing them all."""
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\n…")

    monkeypatch.setattr(gpu_sweep, "measure", out_of_memory)
    args = gpu_sweep.parse_args(["--dry-run"])
    base, steps, warmup = gpu_sweep.base_config(args)
    row = gpu_sweep.run_variant(gpu_sweep.VARIANTS[0], base, steps, warmup, args, left=60.0)
    assert row["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert row["tokens_per_s"] is None and row["loss"] is None


def test_gpu_check_uses_existing_knobs_and_scripts():
    """Every `--key=value` that gpu_check.sh gives train.py is a knob of today's CLI, and
    every `python X.py` it runs exists: a renamed flag or script fails here, not on a GPU."""
    path = REPO / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # syntax
    script = "\n".join(line for line in path.read_text().splitlines()
                       if not line.lstrip().startswith("#"))  # commands, not comments
    sweep_flags = {"preset", "budget_s", "steps", "warmup", "min_variant_s"}
    knobs = {key: "1" if "$" in value else value  # a shell variable's value: a step count
             for key, value in re.findall(r"--([a-z_.]+)=([^\s)]+)", script)
             if key not in sweep_flags}
    assert {"out_dir", "stop_at_step", "compile_model", "mixed_precision"} <= set(knobs)
    overrides.apply_overrides(config.tiny(), {**knobs, "out_dir": "x"})
    for path in re.findall(r"python ([\w/]+\.py)", script):
        assert (REPO / path).exists(), path
    gpu_sweep.parse_args(["--steps=5", "--warmup=1", "--min_variant_s=20", "--budget_s=300"])


def stand_ins(tmp_path) -> Path:
    """python and accelerate that say what they were asked and exit 1, but for `python -`
    (the versions check and the report), which runs the real python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/bash\n[[ $1 == - ]] && exec {sys.executable} "$@"'
                                    f'\necho "stand-in: python $*"; exit 1\n')
    (bin_dir / "accelerate").write_text('#!/bin/bash\necho "stand-in: accelerate $*"; exit 1\n')
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    return bin_dir


def test_gpu_check_runs_every_stage_whatever_one_does_and_reports_each(tmp_path):
    """On the one call a lent GPU gives, a failing stage must not stop the rest: here every
    command after the versions fails, and each stage still runs, and the JSON line says how
    each ended, with no figures where none were made; the script then exits 1."""
    bin_dir = stand_ins(tmp_path)
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs")})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    ran = re.findall(r"^stand-in: (\w+ \S+)", done.stdout, flags=re.M)
    assert ran == ["python -c", "python -m", "accelerate launch", "accelerate launch",
                   "python bench/gpu_sweep.py"], ran
    report = json.loads(done.stdout.strip().splitlines()[-1])
    stages = report.pop("stages")
    assert stages["versions"]["status"] == 0
    assert {stages[name]["status"] for name in stages if name != "versions"} == {1}, stages
    assert report["tokens_per_s"] is None and report["steps"] == [] and report["sweep"] is None
    assert not report["saved"] and not report["resumed"]


def test_a_missing_import_stops_the_gpu_call_in_one_line(tmp_path):
    """The versions stage imports all the call needs first: one that fails is one line that
    names it, and nothing after it runs (exit 2)."""
    bin_dir = stand_ins(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizers.py").write_text("raise ImportError('no tokenizers here')\n")
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "PYTHONPATH": str(broken), "OUT": str(tmp_path / "out"),
                               "RUNS": str(tmp_path / "runs")})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "stand-in" not in done.stdout
    assert done.stdout.strip().splitlines()[-1] == (
        "versions: cannot import tokenizers (ImportError: no tokenizers here); install it (pip "
        "install -r requirements.txt) and run the call again")


def test_ce_memory_reports_the_grid_and_chunked_never_holds_the_full_logits():
    """bench/ce_memory.py at small shapes: one result per (rows, path, chunk), naive once per
    row count. Naive's peak holds at least its fp32 logits (rows·V·4 bytes); chunked stays
    below them, and its memory_ratio is naive's peak over its own at the same rows."""
    vocab = 8192
    result = subprocess.run([sys.executable, "bench/ce_memory.py", "--rows", "1024", "2048",
                             "--chunks", "256", "--vocab", str(vocab), "--d_model", "64"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # one line, nothing else
    got = [(r["rows"], r["path"], r["chunk_size"]) for r in report["results"]]
    assert got == [(1024, "naive", None), (1024, "chunked", 256),
                   (2048, "naive", None), (2048, "chunked", 256)]
    naive = {r["rows"]: r["peak_mib"] for r in report["results"] if r["path"] == "naive"}
    for r in report["results"]:
        logits_mib = r["rows"] * vocab * 4 / 2**20
        if r["path"] == "naive":
            assert r["peak_mib"] >= logits_mib, r
        else:
            assert 0 < r["peak_mib"] < logits_mib, r
            assert r["memory_ratio"] == round(naive[r["rows"]] / r["peak_mib"], 1)


# bench/recipe.py: the stages' logic with a stand-in for training, checked by plain math

import recipe  # noqa: E402


def fake_training(monkeypatch, final_loss):
    """recipe.train_once replaced by `final_loss(cfg)`; returns the configs it was given."""
    trained = []

    def train_once(cfg):
        trained.append(cfg)
        return {"cfg": cfg, "final": final_loss(cfg),
                "tokens": cfg.stop_at_step * cfg.global_batch_tokens}

    monkeypatch.setattr(recipe, "train_once", train_once)
    return trained


def test_recipe_lr_sweep_grows_the_grid_until_the_best_lr_is_inside(monkeypatch):
    """A loss whose minimum lies two factors of two above Muon's grid: the sweep adds 2.4e-2
    (1.2e-2 won at the edge), then 4.8e-2 (2.4e-2 won at the edge), and stops there."""
    fake_training(monkeypatch, lambda cfg: math.log2(cfg.muon_peak_lr / 2.4e-2) ** 2)
    args = recipe.parse_args(["--runs_dir", "/nonexistent"])
    runs = recipe.lr_sweep(args, "muon_wsd", adamw_lr=1.5e-3)
    assert list(runs) == pytest.approx([3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2])
    assert recipe.best_lr(runs) == pytest.approx(2.4e-2)
    assert {r["cfg"].adamw_peak_lr for r in runs.values()} == {1.5e-3}  # AdamW's winner


def test_recipe_token_ratio_interpolates_separately_scheduled_muon_runs(monkeypatch):
    """Muon's final loss falling linearly with its budget, 10 - tokens/250,000, at 4,096
    tokens per step: AdamW's 8.0 at 300 steps is Muon's loss at 500,000 tokens, so the ratio
    is 1,228,800 / 500,000. The ladder runs Muon at 0.75, 0.5 and 0.35 of the budget and stops
    at the first run that ends above 8.0: 105 steps, 430,080 tokens, loss 8.28."""
    trained = fake_training(monkeypatch, lambda cfg: 10 - cfg.stop_at_step * 4096 / 250_000)
    args = recipe.parse_args(["--runs_dir", "/nonexistent"])
    adamw = {"cfg": recipe.run_config(args, "adamw_wsd", 3e-3, None, 7, 300),
             "final": 8.0, "tokens": 300 * 4096}
    muon = recipe.train_once(recipe.run_config(args, "muon_wsd", 6e-3, 3e-3, 7, 300))
    result = recipe.token_ratio(args, 6e-3, 3e-3, 7, muon, adamw)
    assert [cfg.stop_at_step for cfg in trained] == [300, 225, 150, 105]
    assert {(cfg.seed, cfg.muon_peak_lr) for cfg in trained} == {(7, 6e-3)}
    assert result["muon_tokens_needed"] == pytest.approx(500_000)
    assert result["ratio"] == pytest.approx(300 * 4096 / 500_000)


@pytest.mark.parametrize("muon_loss, runs", [(9.0, 1), (7.0, 5)])
def test_recipe_token_ratio_is_none_outside_the_ladder(monkeypatch, muon_loss, runs):
    """Muon above AdamW's 8.0 at the same budget: nothing to interpolate, and no ladder.
    Muon below it even at a quarter of the budget: the ratio is over 4, not measured."""
    trained = fake_training(monkeypatch, lambda cfg: muon_loss)
    args = recipe.parse_args(["--runs_dir", "/nonexistent"])
    adamw = {"cfg": recipe.run_config(args, "adamw_wsd", 3e-3, None, 7, 300),
             "final": 8.0, "tokens": 300 * 4096}
    muon = recipe.train_once(recipe.run_config(args, "muon_wsd", 6e-3, 3e-3, 7, 300))
    assert recipe.token_ratio(args, 6e-3, 3e-3, 7, muon, adamw)["ratio"] is None
    assert len(trained) == runs


def test_prepare_estimate_scales_by_measured_efficiency_and_caps_at_the_serial_part():
    """bench/prepare.py's 32-core estimate against plain arithmetic: 1-core rate × 31 cores
    × the efficiency from 1 to 2 cores (at most 1), capped by the serial thread's rate."""
    import importlib.util  # bench/prepare.py by path: `import prepare` is the repo's own

    spec = importlib.util.spec_from_file_location("bench_prepare", REPO / "bench" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    speeds = [{"cores": 1, "prepare_tokens_per_s": 1000, "serial_tokens_per_s": 10**9},
              {"cores": 2, "prepare_tokens_per_s": 1800, "serial_tokens_per_s": 10**9}]
    got = module.estimate(speeds)
    assert got["scaling_efficiency"] == 0.9 and got["bound"] == "encoder"
    assert got["encoder_tokens_per_s"] == 1000 * 31 * 0.9
    assert got["hours_for_20B_tokens"] == round(20e9 / (1000 * 31 * 0.9) / 3600, 2)
    speeds[1]["prepare_tokens_per_s"] = 2200  # faster than linear (noise): counted as 1.0
    speeds[1]["serial_tokens_per_s"] = 20_000
    got = module.estimate(speeds)
    assert got["scaling_efficiency"] == 1.0 and got["bound"] == "serial"
    assert got["hours_for_20B_tokens"] == round(20e9 / 20_000 / 3600, 2)


def test_report_cost_counts_the_reports_of_the_log_it_times():
    """bench/report_cost.py on a 2,500-step log: a train record every 10 steps, evaluations
    at 0, 1,000, 2,000 and the last step, a report per checkpoint (1,000, 2,000 and the
    last step, which train.py saves too) and a final one; the shares are the timings over
    the wall time at the given throughput."""
    result = subprocess.run([sys.executable, "bench/report_cost.py", "--steps=2500",
                             "--rounds=1", "--tokens_per_s=1e6"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert (figures["train_records"], figures["evals"], figures["reports_per_run"]) == (250, 4, 4)
    wall = 2500 * config.stack100m().global_batch_tokens / 1e6
    assert figures["reference_wall_s_one_gpu"] == round(wall)
    paid = 3 * figures["spawn_s"] + figures["cold_s"]
    assert figures["training_process_share_one_gpu"] == pytest.approx(paid / wall, rel=1e-2)
    assert 0 < figures["spawn_s"] < figures["cold_s"]


def test_downstream_cost_arithmetic_within_the_goals():
    """bench/downstream_cost.py's figures recomputed by hand from the presets' defaults.
    stack100m: 500 items per task × 16 choices (hellaswag 4, ARC 5 and 5, PIQA 2) = 8,000
    sequences, each at most a row of 2,048, rounded up to global micro-batches of 32 × 8
    ranks = 8,192 rows; a forward costs a third of a trained token; one scoring per 1,000
    steps of 524,288 tokens: 8,192 × 2,048 / 3 / 524,288,000 = 1.07% <= 2%. tiny: the
    share is the scoring's seconds over eval_every steps' seconds."""
    bound = downstream_cost.stack100m_bound(config.stack100m())
    assert (bound["items_per_task"], bound["rows"], bound["forward_tokens"]) == (
        500, 8192, 8192 * 2048)
    assert bound["share_bound"] == pytest.approx(8192 * 2048 / 3 / (1000 * 524_288))
    assert bound["share_bound"] <= bound["goal"] == 0.02
    tiny = downstream_cost.tiny_share(config.tiny(), step_s=1.5, score_s=9.0)
    assert tiny["share"] == pytest.approx(9.0 / (100 * 1.5)) and tiny["goal"] == 0.10


def test_cpu_speed_times_every_eager_variant_and_lever_on_the_same_batches():
    """bench/cpu_speed.py's smoke run: one JSON line with a finite speed for each eager
    variant and each lever undone, and each one's first loss near ln(vocab), what a
    near-uniform initial model scores (plain math: a variant fed other data, or a stacklm
    loss left as a sum over the batch's tokens, lands far from it); the ratios are those of
    the speeds."""
    # 2 windows a step: on a CPU without bf16 arithmetic, bf16 is emulated ~19x slower
    result = subprocess.run([sys.executable, "bench/cpu_speed.py", "--steps", "1", "--warmup",
                             "0", "--rounds", "1", "--no-compile", "--micro_batch_size", "2"],
                            cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    precision = report["goal"]["precision"]
    eager = {f"{m}_{p}_eager" for m in ("stacklm", "nanogpt") for p in ("fp32", "bf16")}
    levers = {f"stacklm_{precision}_eager_without_{n}" for n in cpu_speed.LEVERS} | \
        {f"stacklm_{precision}_eager_with_{n}" for n in cpu_speed.ALTERNATIVES}
    assert set(report["tokens_per_s"]) == set(report["first_loss"]) == eager | levers
    assert all(math.isfinite(v) and v > 0 for v in report["tokens_per_s"].values())
    for name, loss in report["first_loss"].items():
        assert loss == pytest.approx(math.log(config.tiny().model.vocab_size), abs=0.25), name
    speed = report["tokens_per_s"]
    # Each ratio is rounded to 3 decimals (up to 5e-4 off) from the exact speeds, which the
    # report rounds to 0.1 token/s: the ratio of two rounded speeds a/b is off by up to
    # (0.05/a + 0.05/b) of itself (emulated bf16 runs at a few tokens/s).
    def rounded_ratio(a, b):
        return pytest.approx(a / b, abs=5e-4 + a / b * (0.05 / a + 0.05 / b))
    assert report["vs_fp32_eager"]["stacklm_bf16_eager"] == rounded_ratio(
        speed["stacklm_bf16_eager"], speed["stacklm_fp32_eager"])
    assert report["goal"]["eager"] == report["vs_nanogpt"][f"stacklm_{precision}_eager"] == \
        rounded_ratio(speed[f"stacklm_{precision}_eager"], speed[f"nanogpt_{precision}_eager"])
    assert set(report["levers"]) == set(cpu_speed.LEVERS)
    assert report["nanogpt_best"]["tokens_per_s"] == max(
        v for n, v in speed.items() if n.startswith("nanogpt"))
    assert report["compile"] == {}


def test_each_levers_undoing_computes_what_the_lever_computes():
    """cpu_speed.py's levers are undone with the code they replaced: each must compute what
    the lever computes (else a lever's "gain" would compare two different things)."""
    torch.manual_seed(0)
    norm, x = model.RMSNorm(16, 1e-6), torch.randn(3, 7, 16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    torch.testing.assert_close(cpu_speed.torch_rms_norm(norm, x), norm(x))
    G = torch.randn(2, 24, 40)
    torch.testing.assert_close(cpu_speed.separate_multiplies(G), optim.newton_schulz(G),
                               rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    tiny = model.Transformer(config.tiny_model())
    hidden, targets = torch.randn(600, 256), torch.randint(0, 4096, (600,))
    targets[:7] = -100
    head = tiny.plain_head(hidden, targets, "mean")
    for undone in (cpu_speed.whole_logits, cpu_speed.fp32_head):
        for got, want in zip(undone(tiny, hidden, targets, "mean"), head, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# One bad value for each benchmark, and cpu_speed's that ended in a traceback or, with
# --warmup -1, timed only each round's last step and reported it as the timed steps.
BAD_BENCH_ARGS = [
    ("cpu_speed.py", ["--steps", "0"], "argument --steps: expected a whole number >= 1, got '0'"),
    ("cpu_speed.py", ["--rounds", "0"], "argument --rounds: expected a whole number >= 1"),
    ("cpu_speed.py", ["--warmup", "-1"], "argument --warmup: expected a whole number >= 0"),
    ("cpu_speed.py", ["--steps", "ten"], "argument --steps: expected a whole number >= 1, "
                                         "got 'ten'"),
    ("lever_losses.py", ["--seeds", "x"], "argument --seeds: expected a whole number"),
    ("ce_memory.py", ["--rows", "0"], "argument --rows: expected a whole number >= 1"),
    # --preset tiny: a refusal that fails to come costs a smoke run, not Stack-100M's
    ("ckpt_async.py", ["--preset", "tiny", "--tokens_per_s", "0"],
     "argument --tokens_per_s: expected a number > 0, got '0'"),
    ("ckpt_async.py", ["--preset", "tiny", "--tokens_per_s", "-1"],
     "argument --tokens_per_s: expected a number > 0, got '-1'"),
    ("ckpt_async.py", ["--preset", "tiny", "--tokens_per_s", "nan"],
     "argument --tokens_per_s: expected a number > 0, got 'nan'"),
    ("continue_public.py", ["--continue_steps", "0"],
     "argument --continue_steps: expected a whole number >= 1, got '0'"),
    ("crash_resume.py", ["--kills", "-1"], "argument --kills: expected a whole number >= 0"),
    ("downstream_cost.py", ["--rounds", "0"], "argument --rounds: expected a whole number"),
    ("gpu_sweep.py", ["--budget_s", "soon"], "argument --budget_s: invalid float value"),
    ("loader.py", ["--repeats", "0"], "argument --repeats: expected a whole number >= 1"),
    ("optim.py", ["--repeats", "0"], "argument --repeats: expected a whole number >= 1"),
    ("prepare.py", ["--memory_mb", "0"], "argument --memory_mb: expected a whole number"),
    ("recipe.py", ["--steps", "0"], "argument --steps: expected a whole number >= 1"),
    ("report_cost.py", ["--rounds", "0"], "argument --rounds: expected a whole number"),
    ("startup.py", ["--mb", "0"], "argument --mb: expected a whole number >= 1"),
    ("throughput.py", ["--steps", "0"], "argument --steps: expected a whole number >= 1"),
]


@pytest.mark.parametrize("script, args, message", BAD_BENCH_ARGS)
def test_a_bad_benchmark_argument_is_one_line(script, args, message, monkeypatch, capsys):
    """Each benchmark's parser is the commands' own (cli.ArgumentParser): one line, exit 2,
    before any work."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "bench" / script), run_name="__main__")
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line
