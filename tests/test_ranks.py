"""What only several ranks show, on 3 ranks of one torchrun launch (DDP over gloo; the
worker is tests/dist_ranks.py): an evaluation counts each val window once wherever the
split ends among the ranks' rows; rank 0 hashes every split first and the other ranks trust
its record; the downstream scorer deals its rows across the ranks and counts each sequence
once; the memory check divides the machine's RAM among the ranks on it."""

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from conftest import copy_of, micro_config
from test_data_at_scale import single_window_evaluation
from test_downstream import GENERIC, write_jsonl
from plumbing import downstream, log, shards

ROOT = Path(__file__).resolve().parent.parent
WORLD = 3
T = 16  # the `prepared` corpus's val split holds 84 windows of 16 tokens
# (micro-batch, windows evaluated; None: all 84). Where the last window falls, as
# (rank, row) of the last global micro-batch, is worked out in boundary() below.
EVALUATIONS = [(5, None), (4, 31), (4, 22), (4, 13), (4, 20), (1, 2), (32, None), (3, None)]


def eval_config(data_dir, out_dir, micro_batch_size: int, windows: int | None):
    return micro_config(str(data_dir), str(out_dir), seq_len=T, micro_batch_size=micro_batch_size,
                        global_batch_tokens=T * micro_batch_size * WORLD,
                        eval_tokens=None if windows is None else T * windows)


def boundary(windows: int, micro_batch_size: int) -> tuple[int, int]:
    """The first padded row, as (rank, row within its micro-batch), of the last global
    micro-batch (WORLD × micro_batch_size rows) of an evaluation of `windows` windows."""
    last = windows % (WORLD * micro_batch_size)
    return divmod(last, micro_batch_size) if last else (WORLD, 0)


def too_big_for_a_share(data_dir, out_dir):
    """A plan whose memory estimate is half the machine's RAM (its vocabulary set to fit:
    the estimate is linear in it): within the RAM of one process, past the third of it
    each of 3 ranks has."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30

    def plan(vocab: int):
        cfg = micro_config(str(data_dir), str(out_dir), global_batch_tokens=64 * 4 * WORLD,
                           **{"model.vocab_size": vocab})
        return cfg, log.memory_estimate(cfg, *log.planned_params(cfg), WORLD, False, False)["total"]
    (_, small), (_, large) = plan(512), plan(512 + 2**20)
    cfg, need = plan(512 + round((ram / 2 - small) / (large - small) * 2**20))
    assert ram / WORLD < need < 0.9 * ram
    return cfg, ram


@pytest.fixture(scope="module")
def ranks(prepared, small_data_dir, tmp_path_factory):
    """One torchrun launch of dist_ranks.py on WORLD ranks: the plan's configs, and what
    each rank wrote."""
    tmp = tmp_path_factory.mktemp("ranks")
    fresh = copy_of(small_data_dir, tmp)
    (fresh / shards.CHECKED).unlink(missing_ok=True)  # no process has hashed it
    task = write_jsonl(tmp / "mine.jsonl", GENERIC)
    plan = {"too_big": too_big_for_a_share(tmp / "no-data", tmp / "big"),
            "run": micro_config(str(fresh), str(tmp / "run"), micro_batch_size=2,
                                global_batch_tokens=64 * 2 * WORLD, stop_at_step=2,
                                eval_every=2, downstream=f"mine:{task}"),
            "evaluations": [eval_config(prepared, tmp / "eval", b, n) for b, n in EVALUATIONS]}
    (tmp / "plan.json").write_text(json.dumps({
        "too_big": dataclasses.asdict(plan["too_big"][0]), "run": dataclasses.asdict(plan["run"]),
        "evaluations": [dataclasses.asdict(cfg) for cfg in plan["evaluations"]]}))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               str(ROOT / "tests" / "dist_ranks.py"), str(tmp / "plan.json"), str(tmp)]
    done = subprocess.run(command, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wrote = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [w["world"] for w in wrote] == [WORLD] * WORLD
    return plan, wrote


@pytest.mark.distributed
def test_every_val_window_counts_once_wherever_the_split_ends_among_the_ranks(ranks):
    """Against the oracle (every window once, one at a time, summed by hand), the same val
    loss and bits per byte on every rank, where the split's end falls inside each rank's
    rows in turn, at the first row of a rank (it and the ranks after it run padding only),
    with fewer windows than ranks, in all of val (the rows past its end would wrap around
    to window 0) and in part of it (the rows past the end are real windows)."""
    plan, wrote = ranks
    where = [boundary(windows or 84, b) for b, windows in EVALUATIONS]
    assert {rank for rank, row in where if row} == set(range(WORLD))  # inside each rank
    assert any(row == 0 and 0 < rank < WORLD for rank, row in where)  # at a rank's first row
    for (_, windows), cfg, got in zip(EVALUATIONS, plan["evaluations"],
                                      wrote[0]["evaluations"], strict=True):
        want = single_window_evaluation(cfg)
        assert want["windows"] == (windows or 84)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6), cfg
        assert got["val_bpb"] == pytest.approx(want["val_bpb"], rel=1e-6), cfg
    assert all(w["evaluations"] == wrote[0]["evaluations"] for w in wrote)


@pytest.mark.distributed
def test_rank_0_hashes_every_split_first_and_the_other_ranks_trust_its_record(ranks):
    """A corpus no process has checked: in setup, rank 0 hashes every shard of the train and
    val splits, once each, and the other ranks, opening them after it, hash none."""
    plan, wrote = ranks
    manifest = shards.load_manifest(plan["run"].data_dir)
    files = sorted(s["file"] for split in ("train", "val") for s in manifest["splits"][split]
                   ["shards"])
    assert wrote[0]["hashed"] == files
    assert [w["hashed"] for w in wrote[1:]] == [[]] * (WORLD - 1)


@pytest.mark.distributed
def test_the_scorer_deals_rows_across_ranks_and_scores_each_sequence_once(ranks):
    """train.main's first scoring (step 0, the seeded initial weights) on 3 ranks: every rank
    runs the same number of forwards; each sequence's log-likelihood comes from one rank
    alone; their sum is one process's scoring of the same model, to 1e-5; and the logged
    accuracies are the picks of that one-process scoring."""
    plan, wrote = ranks
    cfg = plan["run"]
    [task] = downstream.load_tasks(cfg, cfg.data_dir, 1)
    with torch.no_grad():
        one = downstream.loglikelihoods(task, train.build_model(cfg, False).eval(),
                                        torch.device("cpu"), cfg.micro_batch_size, 0, 1)
    shares = torch.tensor([w["scoring"]["lls"] for w in wrote], dtype=torch.float64)
    rows = len(task.rows["input_ids"])
    assert rows > cfg.micro_batch_size * WORLD  # more than one forward on each rank
    assert [w["scoring"]["forwards"] for w in wrote] == \
        [-(-rows // (cfg.micro_batch_size * WORLD))] * WORLD
    assert ((shares != 0).sum(0) == 1).all()
    torch.testing.assert_close(shares.sum(0), one, atol=1e-5, rtol=0)
    [first] = [r for r in map(json.loads, (Path(cfg.out_dir) / "metrics.jsonl").read_text()
                              .splitlines()) if r["kind"] == "eval" and r["step"] == 0]
    hits = downstream.predictions(task.items, one.tolist()) == \
        np.array([[item.gold] for item in task.items])
    assert [first[f"{m}/mine"] for m in ("acc", "acc_norm", "acc_bytes")] == hits.mean(0).tolist()


@pytest.mark.distributed
def test_the_memory_check_divides_the_machines_ram_among_its_ranks(ranks, monkeypatch):
    """A plan of half the machine's RAM passes the check in one process, and on 3 ranks
    (a third each) is refused on every rank, naming the RAM and its sharing, and --force;
    with force, setup goes on to the data (which this plan lacks)."""
    plan, wrote = ranks
    cfg, ram = plan["too_big"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one_process = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"),
                                        mixed_precision="no")  # what check_memory reads
    assert log.check_memory(cfg, one_process, sharded=False, force=False) == []
    for w in wrote:
        assert f"more than this machine's {ram:.1f} GiB of RAM, shared by {WORLD} ranks: it " \
               f"would run out of memory" in w["refused"] and "--force" in w["refused"]
        assert "does not exist" in w["forced"]
