"""torchrun worker for tests/test_fsdp.py: train.py's FSDP2 path on CPU with gloo.

    python -m torch.distributed.run --nproc_per_node=N tests/dist_fsdp.py ACTION DATA OUT

ACTION
  train  the real model, sharded by `train.shard_model` with every block's activations
         checkpointed, trains 3 steps with Muon + AdamW and the chunked loss next to an
         unsharded, uncheckpointed copy that sees the whole global batch in one process;
         rank 0 writes the largest weight and loss differences to OUT/train.json.
  save   trains the sharded model 3 steps, writes a sharded checkpoint to OUT/ckpt with
         checkpoint.py's own writer, and rank 0 writes the full weights and optimizer state to
         OUT/reference.pt.
  load   builds a fresh sharded model on this number of ranks, loads OUT/ckpt, and rank 0
         writes whether the full weights and optimizer state equal OUT/reference.pt to
         OUT/load_<N>.json.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import data  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from conftest import micro_config  # noqa: E402

STEPS = 3


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def make(cfg, sharded: bool):
    model = train.build_model(cfg, compile_model=False)
    if sharded:
        model = train.shard_model(model, torch.device("cpu"), bf16=False)
    return (model, *optim.build_optimizers(model, cfg).named.values())


def train_steps(cfg, model, muon, adamw, loader, group=None):
    """train.py's step without accelerate: the summed loss is scaled by world/global tokens
    so that FSDP's gradient average gives d(sum of token losses)/global tokens."""
    world = dist.get_world_size(group) if group is not None else 1
    losses = []
    for step in range(STEPS):
        for opt, peak in ((muon, cfg.muon_peak_lr), (adamw, cfg.adamw_peak_lr)):
            for g in opt.param_groups:
                g["lr"] = peak * optim.lr_multiplier(step, cfg)
        batch = next(loader)
        n_tokens = torch.tensor(float((batch["targets"] != -100).sum()))
        if group is not None:
            dist.all_reduce(n_tokens, group=group)
        loss = model(**batch, reduction="sum").loss
        (loss * world / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total / n_tokens))
    return losses


def full_state(model, muon, adamw) -> dict:
    model_sd, optim_sd = get_state_dict(model, [muon, adamw],
                                        options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": full(v) for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = full(torch.as_tensor(value))
    return flat


def main():
    action, data_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = micro_config(data_dir, str(out), micro_batch_size=2, global_batch_tokens=128 * 6)
    checkpointed = action == "train"  # recompute under FSDP2 must give the same gradients
    sharded = make(dataclasses.replace(cfg, activation_recompute="full") if checkpointed
                   else cfg, sharded=True)
    if action in ("train", "save"):
        loader = data.PackedShardLoader(data_dir, "train", cfg.seq_len, 2, rank, world)
        losses = train_steps(cfg, *sharded, loader, group=dist.group.WORLD)
    if action == "train":
        # The unsharded copy reads the whole global micro-batch (2 windows × world) at once.
        reference = make(cfg, sharded=False)
        ref_loader = data.PackedShardLoader(data_dir, "train", cfg.seq_len, 2 * world)
        ref_losses = train_steps(cfg, *reference, ref_loader)
        sharded_weights = {k: full(v) for k, v in sharded[0].state_dict().items()}
        diffs = {k: float((sharded_weights[k] - v).abs().max())
                 for k, v in reference[0].state_dict().items()}
        if rank == 0:
            (out / "train.json").write_text(json.dumps({
                "max_weight_diff": max(diffs.values()), "losses": losses,
                "ref_losses": ref_losses, "n_weights": len(diffs)}))
    elif action == "save":
        checkpoint.write_weights_and_optimizers(sharded[0], list(sharded[1:]), out / "ckpt")
        state = full_state(*sharded)
        if rank == 0:
            torch.save(state, out / "reference.pt")
    else:
        checkpoint.read_weights_and_optimizers(sharded[0], list(sharded[1:]), out / "ckpt")
        state = full_state(*sharded)
        if rank == 0:
            reference = torch.load(out / "reference.pt", weights_only=True)
            mismatched = [k for k in reference if k not in state
                          or not torch.equal(reference[k], state[k])]
            (out / f"load_{world}.json").write_text(json.dumps({
                "compared": len(reference), "mismatched": mismatched,
                "extra": sorted(set(state) - set(reference))}))
    dist.barrier()  # no rank tears down gloo while another still writes its files
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
