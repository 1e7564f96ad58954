"""train.py's FSDP2 path on CPU: `train.shard_model` and the loop's own `train.train_step`
under torchrun with gloo (fully_shard runs on CPU even though accelerate will not shard
there), against `train.main` in one process and against plain DCP reads."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import data
import dist_fsdp
import export
import train
from conftest import GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_TOL, micro_config
from model import Transformer
from test_cluster import processes_of, rank_of, wait_for_steps
from test_train import assert_weights, checkpoint_weights, free_port, launch_command
from plumbing import checkpoint, launch

ROOT = Path(__file__).resolve().parent.parent
# FSDP2 bf16 against DDP bf16 autocast, train losses over 4 steps: 4.8e-5 relative at most
# (measured, 2 ranks), from the bf16 residual stream and bf16-rounded norm gains; 10x that.
BF16_LOSS_RTOL = 5e-4


def torchrun(nproc: int, action: str, data_dir: str, out: Path):
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               str(ROOT / "tests" / "dist_fsdp.py"), action, data_dir, str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def torchrun_two_nodes(action: str, data_dir: str, out: Path, env: dict):
    """Two "nodes" of one rank on this machine: two torchrun agents with --nnodes 2 meeting
    at one c10d rendezvous on 127.0.0.1, as the multi-node launch config's agents do."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         f"--node_rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
         str(ROOT / "tests" / "dist_fsdp.py"), action, data_dir, str(out)],
        env=os.environ | {"OMP_NUM_THREADS": "1"} | env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    for agent in agents:
        output, _ = agent.communicate(timeout=300)
        assert agent.returncode == 0, output[-3000:]


def sharded_result(out: Path) -> dict:
    """What dist_fsdp.py's `train` wrote to `out` on 2 ranks: the losses, grad norms, full
    weights and what each rank reported."""
    result = json.loads((out / "train.json").read_text())
    result["weights"] = torch.load(out / "weights.pt", weights_only=True)
    result["world"] = [json.loads((out / f"world_{rank}.json").read_text()) for rank in (0, 1)]
    return result


def differences(run: dict, reference: dict) -> dict:
    """Largest weight difference (absolute) and loss and grad-norm differences (relative)."""
    weights = max(float((run["weights"][k] - v).abs().max())
                  for k, v in reference["weights"].items())
    loss, grad_norm = ([abs(a - b) / abs(b) for a, b in zip(run[key], reference[key], strict=True)]
                       for key in ("losses", "grad_norms"))
    return {"weights": weights, "loss": max(loss), "grad_norm": max(grad_norm)}


@pytest.fixture(scope="module")
def reference(small_data_dir, tmp_path_factory):
    """train.main, the whole loop in this one process, on the same global batches with the
    same masked targets, each as one micro-batch of 12 windows: no FSDP, no recomputation,
    no accumulation, so no normalisation across micro-batches or ranks to get wrong. Its
    per-step losses and grad norms from metrics.jsonl, its weights from its step-3 DCP
    checkpoint."""
    cfg = dist_fsdp.fsdp_config(small_data_dir, str(tmp_path_factory.mktemp("reference")),
                                micro_batch_size=12)
    assert cfg.grad_accum_steps(1) == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "MixtureLoader", dist_fsdp.MaskedLoader)
        train.main(cfg)
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [(r["step"], r["kind"]) for r in records] == [(1, "train"), (2, "train"), (3, "train")]
    weights = {"model": Transformer(cfg.model).state_dict()}
    dcp.load(weights, checkpoint_id=str(Path(cfg.out_dir) / "ckpt" / "step_0000003"))
    return {"losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records], "weights": weights["model"]}


@pytest.fixture(scope="module")
def two_nodes(small_data_dir, tmp_path_factory) -> Path:
    """dist_fsdp.py's `train` on 2 "nodes" × 1 rank under `torchrun --nnodes 2` (gloo over
    loopback), with the launch config's fsdp_reshard_after_forward: false as accelerate
    exports it: the real step, then the two negative controls, in one launch."""
    out = tmp_path_factory.mktemp("two_nodes")
    torchrun_two_nodes("train", small_data_dir, out, {"FSDP_RESHARD_AFTER_FORWARD": "false"})
    return out


@pytest.mark.distributed
def test_sharded_train_step_across_two_nodes_equals_single_process_main(two_nodes, reference):
    """train.train_step under FSDP2 on two nodes, accumulation 3, every block selectively
    recomputed (model.selective_recompute), Muon's sharded path, AdamW, the chunked loss, and each block's weights
    gathered from its forward to its backward (reshard_after_forward false): equal, within
    the tolerances, to train.main in one process on the same global batch as one
    micro-batch. Masked targets give the micro-batches 2 to 128 targets each, so only
    normalising by the global token count (summed over micro-batches and ranks) makes the
    two agree. (train.py itself under fsdp2.yaml, reshard_after_forward true: below.)"""
    run = sharded_result(two_nodes)
    for world in run["world"]:
        rank = world.pop("rank")
        assert world == {"world_size": 2, "process_index": rank, "num_processes": 2,
                         "distributed_type": "MULTI_CPU", "reduced_sum": 1.0 + 2.0,
                         "grad_accum": 3, "sharded_after_forward": False}
    assert sorted(world["process_index"] for world in run["world"]) == [0, 1]
    assert len(run["weights"]) == len(reference["weights"]) > 10
    assert not any(run["skipped"])
    diff = differences(run, reference)
    assert diff["weights"] < WEIGHT_TOL, diff
    assert diff["loss"] < LOSS_RTOL, diff
    assert diff["grad_norm"] < GRAD_NORM_RTOL, diff


@pytest.mark.distributed
@pytest.mark.parametrize("mistake", ["mean_of_means", "half_gradient"])
def test_sharded_comparison_catches_a_wrong_normalisation(two_nodes, reference, mistake):
    """Negative controls: a mean of per-micro-batch means (measured: weights 4.3e-2 off,
    grad norms 107%), and half the gradient (weights 4.6e-3, through the clip of step 3;
    grad norms 50%; the logged loss is right) each miss the reference by >= 10x the
    tolerances the real code passes."""
    diff = differences(sharded_result(two_nodes / mistake), reference)
    assert diff["weights"] > 10 * WEIGHT_TOL, diff
    assert diff["grad_norm"] > 10 * GRAD_NORM_RTOL, diff


@pytest.mark.distributed
def test_sharded_checkpoint_reloads_on_other_rank_counts(small_data_dir, tmp_path):
    """Saved at 2 ranks, loaded at 1 and at 3: every weight and every optimizer state
    (Muon momentum, AdamW moments and step) is bit-identical; and, as export.py does, a
    plain unsharded model in a single process reads the same weights. That plain model's
    logits and greedy generation equal the sharded model's (the paths that read the root's
    parameters outside its forward)."""
    torchrun(2, "save", small_data_dir, tmp_path)
    # what export.py does: one process, no process group, a plain model reads the shards
    model_cfg = micro_config(small_data_dir, str(tmp_path)).model
    plain = Transformer(model_cfg)
    weights = {"model": plain.state_dict()}
    dcp.load(weights, checkpoint_id=str(tmp_path / "ckpt"))
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert all(torch.equal(v, reference[f"model.{k}"]) for k, v in weights["model"].items())
    sharded = torch.load(tmp_path / "outputs.pt", weights_only=True)
    prompt = torch.arange(1, 9)[None]
    torch.testing.assert_close(sharded["logits"], plain.logits(prompt), rtol=0, atol=1e-5)
    assert torch.equal(sharded["generated"], plain.generate(prompt, 4, temperature=0))
    for world in (1, 3):
        torchrun(world, "load", small_data_dir, tmp_path)
        result = json.loads((tmp_path / f"load_{world}.json").read_text())
        assert result["compared"] > 20
        assert result["mismatched"] == [] and result["extra"] == [], result


# --- train.py itself under FSDP2: accelerate launch with the GPU's launch config ---------

def whole_run_config(data_dir: str, out_dir: str, **overrides):
    """12 sequences a step (2 per micro-batch: 3 accumulation steps on 2 ranks, 2 on 3, 6 on
    1), every phase of a run: evaluation with the built-in task, checkpoints, the sample,
    the report."""
    return dist_fsdp.fsdp_config(data_dir, out_dir, **{
        "total_steps": 8, "stop_at_step": 8, "eval_every": 4, "ckpt_every": 4,
        "downstream": f"nextline:{data_dir}", "downstream_items": 20, **overrides})


def launch_fsdp2(cfg, processes: int, outcome: Path) -> subprocess.Popen:
    """train.py under `accelerate launch --config_file accelerate_configs/fsdp2.yaml`, the
    file a GPU node uses, on CPU processes: train.py shards from the launch config, not from
    the device, so this is the GPU's path over gloo."""
    env = os.environ | {"OMP_NUM_THREADS": "1", launch.OUTCOME_FILE: str(outcome)}
    return subprocess.Popen(launch_command(cfg, processes, config_file="fsdp2.yaml"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def logged(cfg, kind: str) -> list[dict]:
    lines = (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def assert_within_fsdp_tolerance(run_cfg, reference_cfg, after: int = 0):
    """README's FSDP2 tolerances against one process: every train loss logged past step
    `after`, the gradient norms, and the final weights."""
    ours = {r["step"]: r for r in logged(run_cfg, "train") if r["step"] > after}
    theirs = {r["step"]: r for r in logged(reference_cfg, "train")}
    assert ours and max(ours) == reference_cfg.stop_at_step
    for step, record in ours.items():
        for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
            assert record[key] == pytest.approx(theirs[step][key], rel=rtol), (step, key)
    step = reference_cfg.stop_at_step
    assert_weights(checkpoint_weights(run_cfg, step), checkpoint_weights(reference_cfg, step),
                   atol=WEIGHT_TOL)


@pytest.mark.distributed
def test_train_py_runs_whole_under_fsdp2_and_matches_one_process(small_data_dir, tmp_path):
    """`train.main` on 2 FSDP2 ranks, start to finish: the banner, accumulation, evaluation
    (val and the next-line task), sharded checkpoints, the end-of-run sample (generation
    outside the root's forward), the `end` record, the report, exit 0 and the outcome file;
    its losses, weights and export within README's FSDP2 tolerance of one process."""
    cfg = whole_run_config(small_data_dir, str(tmp_path / "fsdp2"), write_report=True)
    reference = dataclasses.replace(cfg, out_dir=str(tmp_path / "one"), write_report=False)
    launcher = launch_fsdp2(cfg, 2, tmp_path / "outcome")
    train.main(reference)  # meanwhile, in this process
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-4000:]
    assert "batch: 768 tokens/step = 12 seqs × 64 = 2 micro × 3 accum × 2 ranks" in output
    assert "hardware: 2 × cpu:0 (FSDP2)" in output
    assert [r["step"] for r in logged(cfg, "eval")] == [0, 4, 8]
    assert all("acc/nextline" in r for r in logged(cfg, "eval"))
    # Sharded for real: each rank wrote its own half of the weights, not rank 0 all of them.
    shards = sorted((Path(cfg.out_dir) / "ckpt" / "step_0000008").glob("*.distcp"))
    sizes = [p.stat().st_size for p in shards]
    assert len(sizes) == 2 and min(sizes) > 0.3 * sum(sizes), sizes
    assert [p.name for p in checkpoint.complete_checkpoints(cfg.out_dir)] == \
        ["step_0000004", "step_0000008"]
    [sample] = logged(cfg, "sample")
    assert sample["text"].startswith(cfg.sample_prompt) and f"sample ('{cfg.sample_prompt}'" \
        in output
    assert logged(cfg, "end")[-1]["outcome"] == "finished"
    assert (tmp_path / "outcome").read_text() == "finished 8\n"
    assert (Path(cfg.out_dir) / "report.md").exists() and (Path(cfg.out_dir) / "report.png").exists()
    assert_within_fsdp_tolerance(cfg, reference)
    for got, want in zip(logged(cfg, "eval"), logged(reference, "eval"), strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=LOSS_RTOL)
    exported = [torch.load(export.export(c.out_dir) / "model.pt", weights_only=True)
                for c in (cfg, reference)]
    assert_weights(*exported, atol=WEIGHT_TOL)


# train.py's command on a CPU that stands in for one computing bf16 (so that auto is bf16
# on any CPU), watched: at each rank's first attention, the dtypes of what reaches it and of
# the q_proj weight it computes with (FSDP2's gathered parameter); and the mixed-precision
# policy each fully_shard call was given, by the class of the module it shards; into
# OUT/dtypes_<rank>.
BF16_TRAIN_PY = """\
import json, os, sys
import torch
import torch.distributed.fsdp as fsdp
import model, train
from plumbing import launch
launch.cpu_computes_bf16 = lambda: True
seen, policies, shard = {}, {}, fsdp.fully_shard
def watch(module, args):
    if isinstance(module, model.Attention) and not seen:
        x, cos, sin = args[:3]
        seen.update(x=str(x.dtype), cos=str(cos.dtype), sin=str(sin.dtype),
                    weight=str(module.q_proj.weight.dtype), policies=policies)
        with open(os.path.join(sys.argv[-1], f"dtypes_{os.environ['RANK']}"), "w") as f:
            json.dump(seen, f)
def watched_shard(module, **kwargs):
    policy = kwargs["mp_policy"]
    policies[type(module).__name__] = [str(policy.param_dtype), str(policy.reduce_dtype),
                                       policy.cast_forward_inputs]
    return shard(module, **kwargs)
torch.nn.modules.module.register_module_forward_pre_hook(watch)
fsdp.fully_shard = watched_shard
train.cli(sys.argv[1:-1])
"""


def launch_bf16(cfg, config_file: str, tmp_path: Path) -> dict:
    """train.py on 2 CPU ranks under `config_file`, mixed_precision auto, as BF16_TRAIN_PY
    watches it: what rank 0 saw reach its attention."""
    script = tmp_path / "bf16_train.py"
    script.write_text(BF16_TRAIN_PY)
    command = launch_command(dataclasses.replace(cfg, mixed_precision="auto"), 2, config_file)
    command[command.index("train.py")] = str(script)
    done = subprocess.run(command + [str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1",
                                                         "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "precision bf16 (auto: this CPU computes bf16 natively" in done.stdout
    return json.loads((tmp_path / "dtypes_0").read_text())


@pytest.mark.distributed
def test_fsdp2_under_auto_bf16_gathers_bf16_and_rotates_in_fp32_as_ddp_does(small_data_dir,
                                                                          tmp_path):
    """Where auto resolves to bf16, a sharded run computes in bf16: FSDP2 gathers bf16
    parameters (its mixed-precision policy is a sharded model's only bf16: no autocast),
    from the resolved precision, not the literal knob, and reduce-scatters gradients in
    fp32 (README). RoPE's cos and sin reach every block in fp32, as under DDP's autocast
    (FSDP2 would cast them to bf16 with the block's inputs). Its losses are DDP bf16's to
    within bf16's rounding (FSDP2's residual stream is bf16, as torchtitan's; DDP's
    autocast keeps it fp32)."""
    cfg = dist_fsdp.fsdp_config(small_data_dir, str(tmp_path / "fsdp2"), stop_at_step=4,
                                total_steps=8)
    ddp_cfg = dataclasses.replace(cfg, out_dir=str(tmp_path / "ddp"))
    (tmp_path / "f").mkdir(), (tmp_path / "d").mkdir()
    sharded, ddp = launch_bf16(cfg, "fsdp2.yaml", tmp_path / "f"), \
        launch_bf16(ddp_cfg, "cpu_ddp.yaml", tmp_path / "d")
    assert sharded.pop("policies") == {  # (param, reduce, cast the module's inputs)
        "Block": ["torch.bfloat16", "torch.float32", False],
        "Transformer": ["torch.bfloat16", "torch.float32", True]}
    assert sharded == {"x": "torch.bfloat16", "cos": "torch.float32", "sin": "torch.float32",
                       "weight": "torch.bfloat16"}, sharded
    assert ddp.pop("policies") == {}  # nothing sharded
    assert ddp == {"x": "torch.float32", "cos": "torch.float32", "sin": "torch.float32",
                   "weight": "torch.float32"}, ddp  # autocast casts at each matmul
    ours, theirs = logged(cfg, "train"), logged(ddp_cfg, "train")
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=BF16_LOSS_RTOL), (a["step"], a, b)


@pytest.fixture(scope="module")
def uninterrupted(small_data_dir, tmp_path_factory):
    """24 steps in this one process, never stopped: the run the stopped ones must continue."""
    cfg = dist_fsdp.fsdp_config(small_data_dir, str(tmp_path_factory.mktemp("uninterrupted")),
                                total_steps=24, stop_at_step=24, warmup_steps=4,
                                eval_every=1000, ckpt_every=1000)
    train.main(cfg)
    return cfg


@pytest.mark.distributed
def test_an_fsdp2_run_stopped_by_sigterm_resumes_on_one_rank_and_on_three(
        uninterrupted, tmp_path):
    """SIGTERM to both FSDP2 ranks mid-run (as SLURM signals every process): the step in
    flight is saved, sharded, each rank exits 0, the outcome file says stopped. Checkpoints
    are written in the background every 2 steps (ckpt_async), over the ranks' own gloo
    group: one in flight when the signal comes is completed first, and none is left .tmp.
    The checkpoint then continues on 1 process and on 3 FSDP2 ranks, each within README's
    FSDP2 tolerance of the run never stopped."""
    cfg = dataclasses.replace(uninterrupted, out_dir=str(tmp_path / "stopped"), ckpt_async=True,
                              ckpt_every=2)
    launcher = launch_fsdp2(cfg, 2, tmp_path / "outcome")
    wait_for_steps(cfg, 3, launcher)
    for pid in processes_of(cfg.out_dir):
        if rank_of(pid) is not None:
            os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-3000:]
    word, stopped_at = (tmp_path / "outcome").read_text().split()
    assert word == "stopped" and 3 <= int(stopped_at) < 24, output[-3000:]
    assert checkpoint.newest(cfg.out_dir).endswith(f"step_{int(stopped_at):07d}")
    assert not list(checkpoint.ckpt_root(cfg.out_dir).glob("*.tmp"))
    for ranks in (1, 3):
        resumed = dataclasses.replace(cfg, out_dir=str(tmp_path / f"on{ranks}"))
        shutil.copytree(cfg.out_dir, resumed.out_dir)
        if ranks == 1:
            train.main(resumed)
        else:
            launcher = launch_fsdp2(resumed, ranks, tmp_path / "outcome3")
            output, _ = launcher.communicate(timeout=300)
            assert launcher.returncode == 0, output[-3000:]
            assert "2 micro × 2 accum × 3 ranks" in output
        assert_within_fsdp_tolerance(resumed, uninterrupted, after=int(stopped_at))
