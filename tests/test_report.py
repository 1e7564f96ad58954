"""report.py: what the run report draws and says, read back from the figure's artists and the
markdown's table, against the records of metrics.jsonl as this test reads them itself."""

import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba

import config
import report
import train
from conftest import micro_config
from plumbing import checkpoint, log, overrides

REPO = Path(__file__).resolve().parent.parent


# --- helpers ----------------------------------------------------------------------------

def records(out_dir, kind: str) -> list[dict]:
    """The log's records of one kind, read with a strict JSON parser (no NaN, no Infinity)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(x, parse_constant=refuse) for x in lines) if r["kind"] == kind]


def series(fig, gid: str, panel: str | None = None) -> list:
    """The lines with this gid, on one panel (by title) or on all of them."""
    return [line for ax in fig.axes for line in ax.lines if line.get_gid() == gid
            and (panel is None or ax.get_title(loc="left") == panel)]


def table(markdown: str) -> dict[str, str]:
    """The two-column results table of report.md: name -> value."""
    return dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", markdown, re.M))


def start_record(step=0, tokens_seen=0, **config) -> dict:
    """A start record as log.start_record writes it, for a hand-made log."""
    cfg = {"global_batch_tokens": 100, "stop_at_step": 300, **config}
    return {"kind": "start", "step": step, "tokens_seen": tokens_seen, "time": "t",
            "preset": "tiny", "preset_changes": [["out_dir", "out/tiny", "x"]], "config": cfg,
            "revision": "abc", "plan": [{"start": 0, "source": "d", "weight": 1.0,
                                         "available": 10**6, "planned": 30_000}],
            "hardware": {"world": 1, "device": "cpu", "distributed": "NO", "precision": "no",
                         "compiled": False},
            "phases": {"warmup_steps": 30, "stable_steps": 210, "decay_steps": 60,
                       "decay_start": 240},
            "resumed_from": None, "resume_changes": []}


def hand_made_log(out_dir: Path, losses: list, val_loss: float = 4.2, last_step: int = 300):
    """A run of `len(losses)` train records ending at last_step, one eval at the end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = np.linspace(last_step / len(losses), last_step, len(losses)).astype(int)
    lines = [start_record()] + [
        {"kind": "train", "step": int(s), "loss": loss, "grad_norm": 1.0, "lr_muon": 1e-3,
         "tokens_seen": int(s) * 100, "tokens_per_s": 1000.0, "mfu": None, "memory_gib": 1.0,
         "elapsed_s": float(s)} for s, loss in zip(steps, losses)]
    lines += [{"kind": "eval", "step": last_step, "tokens_seen": last_step * 100,
               "val_loss": val_loss, "val_bpb": 1.8},
              {"kind": "end", "step": last_step, "outcome": "finished", "error": None,
               "elapsed_s": float(last_step)}]
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def write_log(out_dir: Path, lines: list[dict]):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def train_record(step: int, loss: float, tokens_per_s: float = 1000.0, mfu=None,
                 elapsed_s: float = 0.0, memory_gib: float = 1.0) -> dict:
    """A train record as log.py writes it, at 100 tokens per step, for a hand-made log."""
    return {"kind": "train", "step": step, "loss": loss, "grad_norm": 1.0, "lr_muon": 1e-3,
            "tokens_seen": step * 100, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "memory_gib": memory_gib, "elapsed_s": elapsed_s}


def run_report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "report.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


# --- a real run -------------------------------------------------------------------------

def test_a_run_draws_its_log_and_states_its_numbers(small_data_dir, tmp_path):
    """8 steps, logged every step: both files exist when main returns; every plotted series
    is the log's, point for point, against tokens seen; the warmup and decay boundaries sit
    at their steps on every panel; the results table quotes the log."""
    cfg = micro_config(small_data_dir, str(tmp_path), write_report=True)
    train.main(cfg)
    assert (tmp_path / "report.png").stat().st_size > 10_000
    text = (tmp_path / "report.md").read_text()
    trains, evals = records(tmp_path, "train"), records(tmp_path, "eval")

    fig = report.draw([report.read_run(tmp_path)])
    x = [r["tokens_seen"] for r in trains]
    assert x == [r["step"] * cfg.global_batch_tokens for r in trains]
    for gid, key in [("train loss raw", "loss"), ("grad_norm", "grad_norm"),
                     ("lr_muon", "lr_muon"), ("lr_adamw", "lr_adamw"),
                     ("tokens_per_s", "tokens_per_s")]:
        [line] = series(fig, gid)
        assert list(line.get_xdata()) == x and list(line.get_ydata()) == [r[key] for r in trains]
    [val] = series(fig, "val loss")
    assert list(val.get_xdata()) == [r["tokens_seen"] for r in evals] == [0, 2048, 4096]
    assert list(val.get_ydata()) == [r["val_loss"] for r in evals]
    for what, step in [("warmup end", cfg.warmup_steps), ("decay start", 6)]:
        lines = series(fig, f"boundary:{what}:{step}")
        assert len(lines) == 6 and all(  # one per panel
            list(line.get_xdata()) == [step * cfg.global_batch_tokens] * 2 for line in lines)

    facts = table(text)
    assert facts["train loss, step 8"] == f"{trains[-1]['loss']:.4f}"
    assert facts["val loss, step 8"] == f"{evals[-1]['val_loss']:.4f}"
    assert facts["val bits per byte"] == f"{evals[-1]['val_bpb']:.4f}"
    assert facts["tokens seen"] == f"{8 * cfg.global_batch_tokens:,}"
    assert facts["checkpoints written"] == "2 (steps 4, 8)"
    assert facts["skipped steps"] == "0"
    warm = trains[1:]  # the first interval left out; every interval is one step here
    seconds = [cfg.global_batch_tokens / r["tokens_per_s"] for r in warm]
    mean = sum(s * r["tokens_per_s"] for s, r in zip(seconds, warm)) / sum(seconds)
    assert facts["tokens/s"].startswith(f"{mean:,.0f}, mean")
    assert f"```text\n{records(tmp_path, 'sample')[0]['text']}\n```" in text
    [start] = records(tmp_path, "start")
    assert start["preset"] == "stack100m"  # the nearest: micro_config differs from both
    # the start: this checkout's commit, one CPU process in fp32, WSD's phases, no resume
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert start["revision"] in (head, f"{head}-dirty")
    assert start["phases"] == {"warmup_steps": 2, "stable_steps": 4, "decay_steps": 2,
                               "decay_start": 6}
    assert (start["resumed_from"], start["resume_changes"]) == (None, [])
    assert re.search(rf"^\| 0 \| {re.escape(start['time'])} \| {head[:12]} \| 1 × .* \(one "
                     rf"process, precision no, torch {re.escape(torch.__version__)}\) \| — \| "
                     rf"finished at step 8 \|$", text, re.M)
    assert "## Config: the differences from the preset stack100m" in text
    assert "| model.d_model | 512 | 64 |" in text and "| seed |" not in text


def test_a_resumed_run_after_a_kill_covers_the_whole_run(small_data_dir, tmp_path):
    """The first part stops at step 4. Then a kill -9 is simulated: what a run killed at
    step 6 leaves, a train record of step 5, an evaluation at step 6, and a last line cut
    mid-write. The resumed run logs steps 5-8 from the checkpoint of step 4 (it evaluates
    step 4 again, from the same weights, to the same value, and step 8): the report shows
    steps 1-8 once each, the resumed run's step 5, no evaluation at 6 (undone by the resume
    at 4), the resume marked at step 4 with the knob it changed, and one warning for the
    cut line. (A step logged twice with different records: test_a_step_logged_twice_….)"""
    first = micro_config(small_data_dir, str(tmp_path), stop_at_step=4, write_report=True)
    train.main(first)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for record in ({"kind": "train", "step": 5, "loss": 99.0, "tokens_seen": 2560},
                       {"kind": "eval", "step": 6, "val_loss": 99.0, "tokens_seen": 3072}):
            f.write(json.dumps(record) + "\n")
        f.write('{"kind": "train", "step": 6, "lo')
    cut_line = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    train.main(dataclasses.replace(first, stop_at_step=8))

    run = report.read_run(tmp_path)
    logged = [r for r in records_lenient(tmp_path) if r.get("kind") == "train"]
    assert [r["step"] for r in run.rows("train")] == list(range(1, 9))
    assert run.records["train"][5] == logged[-4] and run.records["train"][5]["loss"] != 99.0
    assert [r["step"] for r in run.rows("eval")] == [0, 4, 8]
    assert run.warnings == [f"{tmp_path / 'metrics.jsonl'}: line {cut_line} cannot be read "
                            f"(cut short by a kill -9?); reported without it"]
    fig = report.draw([run])
    assert len(series(fig, "boundary:resume:4")) == 6
    text = (tmp_path / "report.md").read_text()
    assert "| 4 | " in text and "stop_at_step 4 → 8" in text
    assert table(text)["train loss, step 8"] == f"{logged[-1]['loss']:.4f}"
    assert "over 2 starts" in table(text)["wall time"]


def records_lenient(out_dir) -> list[dict]:
    out = []
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_a_one_step_run_gets_a_report(small_data_dir, tmp_path):
    cfg = micro_config(small_data_dir, str(tmp_path), stop_at_step=1, total_steps=8,
                       write_report=True)
    train.main(cfg)
    text = (tmp_path / "report.md").read_text()
    [trained] = records(tmp_path, "train")
    assert table(text)["outcome"] == "finished at step 1 of 1"
    assert table(text)["train loss, step 1"] == f"{trained['loss']:.4f}"
    assert "no interval but the first" in table(text)["tokens/s"]
    [line] = series(report.draw([report.read_run(tmp_path)]), "train loss raw")
    assert list(line.get_ydata()) == [trained["loss"]]


def test_a_diverged_run_reports_why_it_ended(small_data_dir, tmp_path):
    wild = micro_config(small_data_dir, str(tmp_path), muon_peak_lr=1e6, adamw_peak_lr=1e6,
                        grad_clip=0.0, max_bad_steps=2, warmup_steps=0, write_report=True)
    with pytest.raises(checkpoint.TrainingDiverged):
        train.main(wild)
    [end] = records(tmp_path, "end")
    assert end["outcome"] == "error" and end["error"].startswith("TrainingDiverged: 2 consecutive")
    text = (tmp_path / "report.md").read_text()
    assert f"error at step {end['step']}: TrainingDiverged: 2 consecutive" in text
    skipped = [r["step"] for r in records(tmp_path, "skip")]
    [marks] = series(report.draw([report.read_run(tmp_path)]), "skipped")
    assert list(marks.get_xdata()) == [s * wild.global_batch_tokens for s in skipped]


# --- the log's background writer --------------------------------------------------------

def fake_report(tmp_path: Path, monkeypatch) -> Path:
    """report.py replaced by a script that reads the log, takes 0.3 s, then notes one JSON
    line in the file returned: its arguments and the kinds of the records it read. A note
    that is there when the run returns was waited for. (What the log holds when the script
    reads it depends on how fast training moves on, so tests ask only what must be there.)"""
    script, calls = tmp_path / "fake_report.py", tmp_path / "calls.jsonl"
    script.write_text("import json, sys, pathlib, time\n"
                      "log = (pathlib.Path(sys.argv[1]) / 'metrics.jsonl').read_text()\n"
                      "kinds = [json.loads(line)['kind'] for line in log.splitlines()]\n"
                      "time.sleep(0.3)\n"
                      f"with open({str(calls)!r}, 'a') as f:\n"
                      "    f.write(json.dumps({'args': sys.argv[2:], 'kinds': kinds}) + '\\n')\n")
    monkeypatch.setattr(log, "REPORT_SCRIPT", script)
    return calls


def notes(calls: Path) -> list[dict]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def test_the_report_is_redrawn_at_checkpoints_and_last_at_the_end(small_data_dir, tmp_path,
                                                                  monkeypatch):
    """It runs quietly at a checkpoint, then once more, loudly, after the end record, and
    the run returns only when that one is done."""
    calls = fake_report(tmp_path, monkeypatch)
    train.main(micro_config(small_data_dir, str(tmp_path / "run"), write_report=True))
    first, *_, final = notes(calls)
    assert first["args"] == ["--quiet"] and "checkpoint" in first["kinds"]  # step 4's
    assert final["args"] == [] and final["kinds"][-1] == "end"


@pytest.mark.parametrize("ending", ["stopped", "error"])
def test_a_stopped_or_failed_run_waits_for_its_final_report(tmp_path, monkeypatch, ending):
    """A run that stops at step 3 of 8 (a SIGTERM) or fails there: the checkpoint's report,
    then the final one after the end record, done before the log is left."""
    calls = fake_report(tmp_path, monkeypatch)
    cfg = micro_config("unused", str(tmp_path / "run"), write_report=True)
    with pytest.raises(RuntimeError) if ending == "error" else contextlib.nullcontext():
        with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, {"causal": 1.0, "palm": 1.0},
                               start_step=0) as logger:
            logger.log_checkpoints([(3, 0.1, 0.1)])
            if ending == "error":
                raise RuntimeError("a fault at step 3")
    checkpoint, final = notes(calls)
    assert (checkpoint["args"], final["args"]) == (["--quiet"], [])
    assert final["kinds"][-1] == "end"
    [end] = records(cfg.out_dir, "end")
    assert (end["step"], end["outcome"]) == (3, ending)


def test_a_checkpoint_starts_no_second_report_while_one_draws(tmp_path, monkeypatch):
    """Checkpoints at steps 2 and 3, the second while the first's report (0.3 s) still
    draws: one report for both, then the final one."""
    calls = fake_report(tmp_path, monkeypatch)
    cfg = micro_config("unused", str(tmp_path / "run"), write_report=True)
    with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, {"causal": 1.0, "palm": 1.0},
                           start_step=0) as logger:
        logger.log_checkpoints([(2, 0.1, 0.1)])
        logger.log_checkpoints([(3, 0.1, 0.1)])
    assert [note["args"] for note in notes(calls)] == [["--quiet"], []]


def test_a_stop_waits_for_the_report_only_so_long(tmp_path, monkeypatch, capsys):
    """A report that hangs is waited for STOP_REPORT_WAIT_S after a stop, then left to
    finish in the background, with one line on how to draw it again: a SIGTERM stop is
    never held past the launcher's patience."""
    script = tmp_path / "slow_report.py"
    script.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(log, "REPORT_SCRIPT", script)
    monkeypatch.setattr(log, "STOP_REPORT_WAIT_S", 0.5)
    cfg = micro_config("unused", str(tmp_path), write_report=True)
    t0 = time.perf_counter()
    with log.MetricsLogger(cfg, True, torch.device("cpu"), 1, {"causal": 1.0, "palm": 1.0},
                           start_step=0) as logger:
        logger.log_checkpoints([(3, 0.1, 0.1)])  # starts the slow report; stopped at 3 of 8
    took = time.perf_counter() - t0
    still_drawing = logger.report.process.poll() is None
    logger.report.process.kill()
    logger.report.process.wait()
    assert took < 5 and still_drawing
    assert f"report: still drawing 0.5 s after the stop; it finishes in the background " \
           f"(`python report.py {tmp_path}` draws it again)" in capsys.readouterr().out


def test_the_report_reads_the_log_without_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, report; print('torch' in "
                          "sys.modules)"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- bad and partial input, through the command -----------------------------------------

def test_a_cut_last_line_is_left_out_with_one_warning(tmp_path):
    hand_made_log(tmp_path, [5.0, 4.5, 4.0])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 301, "loss": 3.')
    out = run_report(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == (f"warning: {tmp_path / 'metrics.jsonl'}: line 7 cannot be read (cut "
                          f"short by a kill -9?); reported without it\n")
    facts = table((tmp_path / "report.md").read_text())
    assert facts["train loss, step 300"] == "4.0000"
    # then, last, the line on the reference seeds of its precision (fp32's): this hand-made
    # log is the tiny preset, unchanged, finished, in fp32
    assert out.stdout.splitlines() == [
        f"report: {tmp_path / 'report.md'} and {tmp_path / 'report.png'}",
        "reference: final val loss 4.2000 is outside the fp32 reference seeds' spread "
        "(4.2257–4.2492, 3 seeds): 0.0257 below it"]


def test_a_step_logged_twice_counts_once_as_its_last_record(tmp_path):
    """A kill -9 and a resume, by hand. The first start logs steps 1-6, evaluates at 0, 4
    and 6, checkpoints at 4, and is killed. The second resumes from step 4 with a source
    added, so it evaluates step 4 again, now with both sources (the mixture's value differs
    too), then trains 5-8. Each step counts once, as its last record: step 4's evaluation is
    the second start's, steps 5 and 6 are the second start's, and the evaluation at 6 is
    gone (no checkpoint kept it)."""
    cfg = {"stop_at_step": 8, "data_dir": "a,b"}
    resumed = start_record(step=4, tokens_seen=400, **cfg) | {
        "resumed_from": str(tmp_path / "ckpt" / "step_0000004"),
        "resume_changes": [["data_dir", "a", "a,b"]]}
    write_log(tmp_path, [
        start_record(**cfg | {"data_dir": "a"}),
        {"kind": "eval", "step": 0, "tokens_seen": 0, "val_loss": 5.5, "val_bpb": 2.5},
        *(train_record(s, loss) for s, loss in zip(range(1, 5), (5.0, 4.8, 4.6, 4.4))),
        {"kind": "eval", "step": 4, "tokens_seen": 400, "val_loss": 4.5, "val_bpb": 2.0},
        {"kind": "checkpoint", "step": 4, "seconds": 0.1},
        train_record(5, 9.5), train_record(6, 9.6),
        {"kind": "eval", "step": 6, "tokens_seen": 600, "val_loss": 9.9, "val_bpb": 4.0},
        resumed,  # killed above: no end record
        {"kind": "eval", "step": 4, "tokens_seen": 400, "val_loss": 4.3, "val_bpb": 1.9,
         "val_loss/a": 4.2, "val_loss/b": 4.6},
        *(train_record(s, loss) for s, loss in zip(range(5, 9), (4.2, 4.1, 4.0, 3.9))),
        {"kind": "eval", "step": 8, "tokens_seen": 800, "val_loss": 3.8, "val_bpb": 1.7,
         "val_loss/a": 3.7, "val_loss/b": 4.1},
        {"kind": "checkpoint", "step": 8, "seconds": 0.1},
        {"kind": "end", "step": 8, "outcome": "finished", "error": None, "elapsed_s": 8.0}])
    run = report.read_run(tmp_path)
    assert [(r["step"], r["loss"]) for r in run.rows("train")] == [
        (1, 5.0), (2, 4.8), (3, 4.6), (4, 4.4), (5, 4.2), (6, 4.1), (7, 4.0), (8, 3.9)]
    assert [(r["step"], r["val_loss"]) for r in run.rows("eval")] == [(0, 5.5), (4, 4.3),
                                                                      (8, 3.8)]
    fig = report.draw([run])
    [val] = series(fig, "val loss", "val loss")
    assert list(val.get_xdata()) == [0, 400, 800] and list(val.get_ydata()) == [5.5, 4.3, 3.8]
    [added] = series(fig, "val loss/b", "val loss")  # the new source's curve has a before
    assert list(added.get_xdata()) == [400, 800] and list(added.get_ydata()) == [4.6, 4.1]
    report.write([tmp_path])
    text = (tmp_path / "report.md").read_text()
    hardware = "1 × cpu (one process, precision no, torch ?)"  # as start_record has it
    assert f"| 0 | t | abc | {hardware} | — | no end record (killed?) |" in text
    assert f'| 4 | t | abc | {hardware} | data_dir "a" → "a,b" | finished at step 8 |' in text
    assert table(text)["checkpoints written"] == "2 (steps 4, 8)"


def test_the_results_of_a_log_of_two_starts_by_hand(tmp_path):
    """Two starts, logged every 2 steps at 100 tokens per step. Each start's first interval
    is slow (compilation) and left out of tokens/s and MFU: the rest are 0.2 s each at
    1,000 tokens/s and 40% MFU, then 0.1 s each at 2,000 and 50%, so the means weighted by
    time are 1,333 tokens/s and 43.3%. Wall time adds each start's own clock (30 s + 20 s);
    the peak memory is the largest logged; the skipped step is counted and marked in red."""
    cfg = {"stop_at_step": 12}
    write_log(tmp_path, [
        start_record(**cfg),
        train_record(2, 5.0, tokens_per_s=10.0, mfu=0.01, elapsed_s=20.0),
        train_record(4, 4.8, tokens_per_s=1000.0, mfu=0.4, elapsed_s=25.0, memory_gib=3.5),
        train_record(6, 4.6, tokens_per_s=1000.0, mfu=0.4, elapsed_s=30.0),
        {"kind": "checkpoint", "step": 6, "seconds": 0.1},
        {"kind": "end", "step": 6, "outcome": "stopped", "error": None, "elapsed_s": 30.0},
        start_record(step=6, tokens_seen=600, **cfg),
        train_record(8, 4.4, tokens_per_s=10.0, mfu=0.01, elapsed_s=15.0),
        {"kind": "skip", "step": 9, "loss": None, "grad_norm": None},
        train_record(10, 4.2, tokens_per_s=2000.0, mfu=0.5, elapsed_s=18.0, memory_gib=2.0),
        train_record(12, 4.0, tokens_per_s=2000.0, mfu=0.5, elapsed_s=20.0),
        {"kind": "eval", "step": 12, "tokens_seen": 1200, "val_loss": 4.1, "val_bpb": 1.75},
        {"kind": "end", "step": 12, "outcome": "finished", "error": None, "elapsed_s": 20.0}])
    report.write([tmp_path])
    facts = table((tmp_path / "report.md").read_text())
    assert facts["outcome"] == "finished at step 12 of 12"
    assert facts["train loss, step 12"] == "4.0000"
    assert (facts["val loss, step 12"], facts["val bits per byte"]) == ("4.1000", "1.7500")
    assert facts["tokens seen"] == "1,200"
    assert facts["tokens/s"] == "1,333, mean over the log intervals, the first of each start left out"
    assert facts["MFU"] == "43.3% (causal FLOPs)"
    assert facts["wall time"].startswith("0m50s over 2 starts")
    assert facts["peak memory"] == "3.50 GiB"
    assert facts["skipped steps"] == "1"
    [marks] = series(report.draw([report.read_run(tmp_path)]), "skipped", "gradient norm")
    assert list(marks.get_xdata()) == [900] and marks.get_color() == "red"


def test_the_smoothed_train_loss_is_a_debiased_average_over_a_40th_of_the_points(tmp_path):
    """400 noisy points: the smoothed curve is, at each point, the average of the points so
    far weighted by beta^age, beta = 1 - 1/(400/40), divided by the sum of those weights
    (debiased: no pull toward 0 at the start). Written out in closed form here."""
    losses = list(5 - np.linspace(0, 2, 400) + np.random.default_rng(0).normal(0, 0.3, 400))
    hand_made_log(tmp_path, losses, last_step=400)
    [smooth] = series(report.draw([report.read_run(tmp_path)]), "train loss smoothed")
    beta, y = 0.9, np.array(losses)
    age = np.arange(400)[:, None] - np.arange(400)[None, :]
    weights = np.where(age >= 0, beta ** np.maximum(age, 0), 0.0)
    assert np.allclose(smooth.get_ydata(), weights @ y / weights.sum(axis=1), rtol=1e-12)


def test_a_folder_without_metrics_is_one_line_and_a_failure(tmp_path):
    out = run_report(tmp_path)
    assert out.returncode == 2
    assert out.stderr == (f"error: {tmp_path}: no metrics.jsonl, so nothing to report; give the "
                          f"out_dir of a run (train.py writes metrics.jsonl there)\n")
    assert not (tmp_path / "report.md").exists()


def test_a_file_or_a_binary_log_is_one_line_naming_it(tmp_path, capsys):
    """The metrics.jsonl file itself, not its folder: one line whose command, followed,
    draws the report. A binary metrics.jsonl: one line naming it and the unreadable lines
    (not the codec's message alone). A file as --out: one line naming the flag. A binary
    line inside a good log is left out with the cut-short line's warning."""
    from test_errors import run_cli
    hand_made_log(tmp_path / "run", [5.0, 4.5, 4.0])
    err = run_cli([str(tmp_path / "run" / "metrics.jsonl")], capsys, report.cli)
    assert err == (f"error: {tmp_path / 'run' / 'metrics.jsonl'} is a file; report.py reads a "
                   f"run's out_dir, the folder that holds metrics.jsonl: python report.py "
                   f"{tmp_path / 'run'}")
    report.cli(err.rsplit("python report.py ", 1)[1].split())
    assert (tmp_path / "run" / "report.md").exists()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\x89PNG\x80\xff\n" * 12)
    err = run_cli([str(tmp_path / "binary")], capsys, report.cli)
    assert err.startswith(f"error: {tmp_path / 'binary' / 'metrics.jsonl'}: no start record "
                          f"(lines 1, 2, 3, 4, 5 and 7 more cannot be read)")
    (tmp_path / "taken").write_text("a file")
    assert run_cli([str(tmp_path / "run"), "--out", str(tmp_path / "taken")], capsys,
                   report.cli) == (f"error: --out {tmp_path / 'taken'} is a file; give a folder "
                                   f"for report.md and report.png (made if missing)")
    with open(tmp_path / "run" / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe{}\n")
    assert report.read_run(tmp_path / "run").warnings == [
        f"{tmp_path / 'run' / 'metrics.jsonl'}: line 7 cannot be read (cut short by a kill "
        f"-9?); reported without it"]


def test_a_non_finite_value_is_a_gap_and_n_a(tmp_path):
    """log.py writes a non-finite loss as null: the raw curve has a hole there (NaN), the
    smoothed one skips it, and a last loss that is null reads n/a."""
    hand_made_log(tmp_path, [5.0, None, 4.0, None])
    run = report.read_run(tmp_path)
    [raw] = series(report.draw([run]), "train loss raw")
    assert np.isnan(raw.get_ydata()[[1, 3]]).all() and list(raw.get_ydata()[[0, 2]]) == [5, 4]
    [smooth] = series(report.draw([run]), "train loss smoothed")
    assert np.isfinite(smooth.get_ydata()[2]) and np.isnan(smooth.get_ydata()[3])
    report.write([tmp_path])
    assert table((tmp_path / "report.md").read_text())["train loss, step 300"] == "n/a"


# --- runs compared ----------------------------------------------------------------------

def test_a_stable_run_and_two_anneals_from_its_checkpoint(small_data_dir, tmp_path):
    """The WSD case: the stable run stops where the decay begins (step 6); two anneals
    start from that checkpoint in folders of their own (sqrt and linear decay). In the
    overlay each run is labelled by its folder; each anneal carries the stable run's history
    up to step 6, where it is marked as a branch, and its own steps after; the tables give
    each run's finals and the knobs that differ."""
    stable = micro_config(small_data_dir, str(tmp_path / "stable"), stop_at_step=6)
    train.main(stable)
    branch = str(tmp_path / "stable" / "ckpt" / "step_0000006")
    for name, shape in (("sqrt", "sqrt"), ("linear", "linear")):
        train.main(dataclasses.replace(stable, out_dir=str(tmp_path / name), stop_at_step=8,
                                       resume=branch, decay_shape=shape))
    folders = [tmp_path / name for name in ("stable", "sqrt", "linear")]
    out, verdict, warnings = report.write(folders, tmp_path / "compare")
    assert (out, verdict, warnings) == (tmp_path / "compare", None, [])

    fig = report.draw([report.read_run(f) for f in folders])
    labels = {t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()}
    assert {"stable smoothed", "sqrt smoothed", "linear smoothed"} <= labels
    norms = [line.get_ydata() for line in series(fig, "grad_norm")]
    own = [[r["grad_norm"] for r in records(f, "train")] for f in folders]
    assert list(norms[0]) == own[0]
    for k in (1, 2):  # the stable run's steps 1-6, then the anneal's own 7-8
        assert list(norms[k]) == own[0] + own[k]
    lrs = [line.get_ydata()[-1] for line in series(fig, "lr_muon")]
    assert lrs[1] != lrs[2]  # sqrt and linear decay differ after the branch
    assert len(series(fig, "boundary:branched from stable:6")) == 12  # 2 anneals × 6 panels

    text = (tmp_path / "compare" / "report.md").read_text()
    assert "sqrt continues stable from its step 6" in text
    for folder in folders:
        last = records(folder, "eval")[-1]
        assert re.search(rf"^\| {folder.name} \| finished \| {last['step']} \| .* \| "
                         rf"{last['val_loss']:.4f} \| {last['val_bpb']:.4f} \|", text, re.M)
    assert '| decay_shape | "sqrt" | "sqrt" | "linear" |' in text
    assert "| stop_at_step | 6 | 8 | 8 |" in text

    # Copied elsewhere together (off a cluster, say), an anneal still finds its history.
    moved = tmp_path / "moved"
    for folder in folders[:2]:
        shutil.copytree(folder, moved / folder.name)
    shutil.rmtree(folders[0])
    copy = report.read_run(moved / "sqrt")
    assert copy.branch == ("stable", 6) and copy.warnings == []
    assert [r["grad_norm"] for r in copy.rows("train")] == own[0] + own[1]


def test_the_nearest_preset_and_the_differences_from_it():
    assert config.nearest_preset(config.tiny()) == ("tiny", [])
    cfg = overrides.apply_overrides(config.tiny(), {"out_dir": "x", "model.d_model": 128})
    assert config.nearest_preset(cfg) == ("tiny", [("out_dir", "out/tiny", "x"),
                                                   ("model.d_model", 256, 128)])
    assert config.nearest_preset(config.stack100m())[0] == "stack100m"


def test_comparing_needs_an_out_folder(tmp_path):
    hand_made_log(tmp_path / "a", [4.0])
    hand_made_log(tmp_path / "b", [4.0])
    out = run_report(tmp_path / "a", tmp_path / "b")
    assert out.returncode == 2 and out.stderr.startswith("error: comparing 2 runs needs --out")


# --- the reference ----------------------------------------------------------------------

def test_a_tiny_run_is_read_against_the_reference_seeds(tmp_path, monkeypatch):
    """Three hand-made fp32 seeds end at 4.20, 4.22 and 4.25: 4.21 is within, 4.30 is 0.05
    above; the report draws each seed's val loss under the run's; a run that changed a knob
    that matters is not compared, and no seed is drawn. (The bf16 seeds, far off, are
    another precision's: an fp32 run is never read against them.)"""
    for seed, final in zip((1, 2, 3), (4.20, 4.22, 4.25)):
        hand_made_log(tmp_path / "reference" / "fp32" / f"seed-{seed}", [5.0, 4.5],
                      val_loss=final)
        hand_made_log(tmp_path / "reference" / "bf16" / f"seed-{seed}", [5.0, 4.5],
                      val_loss=final + 1)
    monkeypatch.setattr(report, "REFERENCE", tmp_path / "reference")
    figures, draw = [], report.draw
    monkeypatch.setattr(report, "draw", lambda *a: figures.append(draw(*a)) or figures[-1])
    hand_made_log(tmp_path / "ours", [5.0, 4.4], val_loss=4.21)
    assert report.reference_verdict(report.read_run(tmp_path / "ours")) == (
        "reference: final val loss 4.2100 is within the fp32 reference seeds' spread "
        "(4.2000–4.2500, 3 seeds)")
    out, verdict, _ = report.write([tmp_path / "ours"])
    fig_text = (out / "report.md").read_text()
    assert "Reference: final val loss 4.2100 is within" in fig_text
    drawn = [list(line.get_ydata()) for line in series(figures[-1], "reference", "val loss")]
    assert drawn == [[4.20], [4.22], [4.25]]
    bf16 = tmp_path / "ours-bf16"
    hand_made_log(bf16, [5.0, 4.4], val_loss=5.21)
    lines = (bf16 / "metrics.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["hardware"]["precision"] = "bf16"
    (bf16 / "metrics.jsonl").write_text("\n".join([json.dumps(start)] + lines[1:]) + "\n")
    assert report.reference_verdict(report.read_run(bf16)) == (
        "reference: final val loss 5.2100 is within the bf16 reference seeds' spread "
        "(5.2000–5.2500, 3 seeds)")

    hand_made_log(tmp_path / "ours", [5.0, 4.4], val_loss=4.30)
    assert report.reference_verdict(report.read_run(tmp_path / "ours")) == (
        "reference: final val loss 4.3000 is outside the fp32 reference seeds' spread "
        "(4.2000–4.2500, 3 seeds): 0.0500 above it")
    changed = tmp_path / "ours" / "metrics.jsonl"
    start = json.loads(changed.read_text().splitlines()[0])
    start["preset_changes"].append(["muon_peak_lr", 0.006, 0.01])
    changed.write_text("\n".join([json.dumps(start)] + changed.read_text().splitlines()[1:]))
    assert report.reference_verdict(report.read_run(tmp_path / "ours")) is None
    report.write([tmp_path / "ours"])
    assert series(figures[-1], "reference") == []


# Where each precision's seed 1337 is quoted: README's run (bf16, on a CPU that computes
# it) and docs/report.md's fp32 figure (a CPU without bf16 arithmetic).
QUOTED_1337 = {"bf16": ("README.md", r"^eval    300 \| val_loss ([\d.]+) \| val_bpb ([\d.]+)"),
               "fp32": ("docs/report.md",
                        r"Seed 1337 in fp32 ended at\s+(\d+\.\d+), val_bpb\s+(\d+\.\d+)")}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_reference_runs_kept_in_the_repository(precision):
    """Three finished runs of the unmodified tiny preset in each precision, one per seed,
    strict JSON; the default seed's ends where the docs quote it, to the drift between
    machines docs/report.md states (5.3e-5 relative) and the fourth decimal it prints."""
    seeds = sorted((report.REFERENCE / precision).glob("seed-*"))
    assert len(seeds) == 3
    finals = {}
    for folder in seeds:
        [start], [end] = records(folder, "start"), records(folder, "end")
        assert start["preset"] == "tiny" and end["outcome"] == "finished"
        assert {k for k, *_ in start["preset_changes"]} <= report.UNCHANGED_BY
        assert report.REFERENCE_PRECISION[start["hardware"]["precision"]] == precision
        finals[start["config"]["seed"]] = records(folder, "eval")[-1]
    assert len(finals) == 3 and 1337 in finals
    page, pattern = QUOTED_1337[precision]
    [(loss, bpb)] = re.findall(pattern, (REPO / page).read_text(), re.M)
    assert abs(float(loss) - finals[1337]["val_loss"]) <= 5.3e-5 * float(loss) + 5e-5
    assert abs(float(bpb) - finals[1337]["val_bpb"]) <= 5.3e-5 * float(bpb) + 5e-5


def test_the_decay_marker_looks_like_no_curve(tmp_path):
    """Every panel marks the start of the decay leg; the line must not read as a curve (it
    once was the AdamW lr's orange dashes). Its colour and its line style both differ from
    every curve's: a run drawn alone (two learning rates, two sources' val losses) and ten
    runs compared (the whole colour cycle, each drawn solid and dashed)."""
    evals = {"kind": "eval", "step": 300, "tokens_seen": 30_000, "val_loss": 4.2,
             "val_bpb": 1.8, "val_loss/a": 4.1, "val_bpb/a": 1.7, "val_loss/b": 4.3,
             "val_bpb/b": 1.9}
    for k in range(10):
        write_log(tmp_path / f"run{k}", [start_record()] + [
            {**train_record(step, 4.0), "lr_adamw": 5e-4} for step in (100, 200, 300)] + [evals])
    runs = [report.read_run(tmp_path / f"run{k}") for k in range(10)]
    for drawn, drawn_gids in ((runs[:1], {"lr_adamw", "val loss/b"}), (runs, {"lr_adamw"})):
        fig = report.draw(drawn)
        markers = series(fig, "boundary:decay start:240")
        curves = [line for ax in fig.axes for line in ax.lines
                  if not str(line.get_gid()).startswith("boundary:")]
        assert len(markers) == 6 * len(drawn) and drawn_gids <= {c.get_gid() for c in curves}
        for marker in markers:
            for line in curves:
                assert to_rgba(marker.get_color()) != to_rgba(line.get_color()), line.get_gid()
                assert marker.get_linestyle() != line.get_linestyle(), line.get_gid()
