"""train.py's FSDP2 path on CPU: `train.shard_model` under torchrun with gloo (fully_shard
runs on CPU even though accelerate will not shard there)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import micro_config
from model import Transformer

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, action: str, data_dir: str, out: Path):
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               str(ROOT / "tests" / "dist_fsdp.py"), action, data_dir, str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.distributed
def test_sharded_training_equals_single_process(small_data_dir, tmp_path):
    """3 steps of the real model (Muon's sharded path, AdamW, chunked loss, every block's
    activations checkpointed and recomputed under FSDP2) on 2 ranks equal one process on
    the whole global batch without checkpointing. Tolerance 1e-5: the sharded run sums
    gradients in another order (reduce-scatter) and Newton-Schulz amplifies such
    differences a little; a wrong shard or scale is off by orders more."""
    torchrun(2, "train", small_data_dir, tmp_path)
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["n_weights"] > 10
    assert result["max_weight_diff"] < 1e-5, result
    for a, b in zip(result["losses"], result["ref_losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.distributed
def test_sharded_checkpoint_reloads_on_other_rank_counts(small_data_dir, tmp_path):
    """Saved at 2 ranks, loaded at 1 and at 3: every weight and every optimizer state
    (Muon momentum, AdamW moments and step) is bit-identical; and, as --export does, a
    plain unsharded model in a single process reads the same weights."""
    torchrun(2, "save", small_data_dir, tmp_path)
    # what --export does: one process, no process group, a plain model reads the shards
    model_cfg = micro_config(small_data_dir, str(tmp_path)).model
    plain = {"model": Transformer(model_cfg).state_dict()}
    dcp.load(plain, checkpoint_id=str(tmp_path / "ckpt"))
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert all(torch.equal(v, reference[f"model.{k}"]) for k, v in plain["model"].items())
    for world in (1, 3):
        torchrun(world, "load", small_data_dir, tmp_path)
        result = json.loads((tmp_path / f"load_{world}.json").read_text())
        assert result["compared"] > 20
        assert result["mismatched"] == [] and result["extra"] == [], result
