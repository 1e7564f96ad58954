"""torchrun worker for tests/test_optim.py: sharded Muon (FSDP2, gloo, CPU) against
single-process Muon.

    python -m torch.distributed.run --nproc_per_node=N tests/dist_muon.py {save|resume} CKPT OUT

Every rank builds the same small model, shards a copy with `fully_shard` per block then
root, and trains it on the same batches as an unsharded copy (FSDP averages identical
gradients, so both see the same gradient). Rank 0 writes to OUT the largest relative weight
error after 5 steps of
  muon:             our Muon on the sharded model (with `save`, it also writes a distributed
                    checkpoint of model and optimizer to CKPT after step 3);
  local_shard_muon: the negative control, which orthogonalises each rank's rows alone;
  resumed:          (`resume` only) a sharded model loaded from CKPT, written by another
                    number of ranks, then trained for steps 3 and 4;
  resumed_without_momentum: the negative control for `resumed`: the same, loading only the
                    model, so that Muon restarts from zero momentum;
and the collectives one sharded Muon step makes (`collectives`: CommDebugMode counts every
one), with the model's matrices and their distinct shapes; and, with Newton–Schulz in bf16,
what the all-to-alls carry: the dtypes of the pieces (`traffic_dtypes`), the bytes this
rank sends in a step (`traffic_bytes`), how far the weights end from those of the same run
sending fp32 pieces (`bf16_against_fp32_traffic`, which must be 0.0: bitwise), and from
single-process Muon in bf16 (`bf16_muon`).
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from optim import Muon, orthogonalize_on_owners

STEPS = 5
SAVE_AFTER = 3


class LocalShardMuon(Muon):
    """The mistake the parity test must catch: orthogonalising each rank's rows alone."""

    def _orthogonalize_row_sharded(self, params, updates, group):
        return [self._orthogonalize(rows, group) for rows in updates]


class Float32TrafficMuon(Muon):
    """The pieces sent in fp32 whatever Newton–Schulz runs in (which casts them on arrival
    then): the bytes sent before, and the result the bf16 traffic must equal bit for bit."""

    def _orthogonalize_row_sharded(self, params, updates, group):
        return orthogonalize_on_owners(params, updates,
                                       lambda wholes: self._orthogonalize_bucket(wholes, group),
                                       torch.float32)


class Block(torch.nn.Module):
    """Row counts 20, 8, 13 and 2: 13 splits unevenly over 2 and 3 ranks, and 2 rows over
    3 ranks leave the last rank an empty shard."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 20, bias=False), torch.nn.Linear(20, 8, bias=False)
        self.odd, self.back = torch.nn.Linear(8, 13, bias=False), torch.nn.Linear(13, 8, bias=False)
        self.narrow = torch.nn.Linear(8, 2, bias=False)

    def forward(self, x):  # (batch, 8)
        x = x + self.down(torch.tanh(self.up(x))) + self.back(torch.tanh(self.odd(x)))
        return x + self.narrow(x).sum(dim=1, keepdim=True)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block())


def shard(model):
    for block in model:
        fully_shard(block)
    return fully_shard(model)


def train(model, optimizer, steps):
    for step in steps:
        batch = torch.Generator().manual_seed(step)  # the same batch on every rank
        x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 8, generator=batch)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def make_muon(model, cls=Muon, ns_dtype=None):
    return cls(model.parameters(), lr=0.05, weight_decay=0.1, ns_dtype=ns_dtype)


def max_relative_error(sharded, reference) -> float:
    errors = [(p.full_tensor() - q).abs().max() / q.abs().max()
              for p, q in zip(sharded.parameters(), reference.parameters(), strict=True)]
    return max(errors).item()


def collectives_per_step() -> dict:
    """The collectives of one sharded Muon step (the backward's reduce-scatters before it
    are FSDP's, not counted), beside the matrices and shapes the model has."""
    model = shard(make_model())
    muon = make_muon(model)
    train(model, muon, range(1))  # the momentum buffers exist: a step like any later one
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    with CommDebugMode() as comm:
        muon.step()
    return {"collectives": comm.get_total_counts(),
            "matrices": len(list(model.parameters())),
            "shapes": len({p.shape for p in model.parameters()})}


def traffic(cls) -> tuple[torch.nn.Module, set, int]:
    """A sharded model trained by `cls` with Newton–Schulz in bf16, the dtypes its
    all-to-alls carried, and the bytes this rank sent in its last step."""
    sent, all_to_all_single = [], dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        sent.append((input.dtype, input.numel() * input.element_size()))
        return all_to_all_single(output, input, *args, **kwargs)
    model = shard(make_model())
    muon = make_muon(model, cls, ns_dtype=torch.bfloat16)
    dist.all_to_all_single = recording  # what optim.all_to_all calls
    try:
        train(model, muon, range(STEPS))
    finally:
        dist.all_to_all_single = all_to_all_single
    per_step = len(sent) // STEPS
    return model, {dtype for dtype, _ in sent}, sum(n for _, n in sent[-per_step:])


def bf16_traffic() -> dict:
    bf16, dtypes, sent = traffic(Muon)
    fp32, fp32_dtypes, fp32_sent = traffic(Float32TrafficMuon)
    difference = max((p.full_tensor() - q.full_tensor()).abs().max().item()
                     for p, q in zip(bf16.parameters(), fp32.parameters(), strict=True))
    reference = make_model()
    train(reference, make_muon(reference, ns_dtype=torch.bfloat16), range(STEPS))
    return {"bf16_muon": max_relative_error(bf16, reference),
            "traffic_dtypes": sorted(str(d) for d in dtypes),
            "fp32_traffic_dtypes": sorted(str(d) for d in fp32_dtypes),
            "traffic_bytes": sent, "fp32_traffic_bytes": fp32_sent,
            "bf16_against_fp32_traffic": difference}


def checkpoint_state(model, muon):
    model_state, optim_state = get_state_dict(model, [muon])
    return {"model": model_state, "optim": optim_state}


def resume(ckpt_dir, load_optimizer=True):
    """A sharded model and Muon loaded from a checkpoint, then trained to the end. Without
    load_optimizer (the negative control), only the weights are read and Muon restarts from
    zero momentum. (get_state_dict on the optimizer would not do: it creates the momentum
    buffers, and dcp.load fills them in place.)"""
    model = shard(make_model())
    muon = make_muon(model)
    if load_optimizer:
        state = checkpoint_state(model, muon)
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, [muon], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for p in model.parameters():
            if muon.state[p]["momentum_buffer"].placements != p.placements:
                raise RuntimeError("the reloaded momentum buffer is not sharded like its parameter")
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
    train(model, muon, range(SAVE_AFTER, STEPS))
    return model


def compare(action, ckpt_dir) -> dict:
    """The three relative errors of the module docstring (two with `save`)."""
    reference = make_model()
    train(reference, make_muon(reference), range(STEPS))

    model = shard(make_model())
    muon = make_muon(model)
    train(model, muon, range(SAVE_AFTER))
    if action == "save":
        dcp.save(checkpoint_state(model, muon), checkpoint_id=ckpt_dir)
    train(model, muon, range(SAVE_AFTER, STEPS))
    result = {"muon": max_relative_error(model, reference)}

    control = shard(make_model())
    train(control, make_muon(control, LocalShardMuon), range(STEPS))
    result["local_shard_muon"] = max_relative_error(control, reference)
    result.update(collectives_per_step())
    result.update(bf16_traffic())
    if action == "resume":
        result["resumed"] = max_relative_error(resume(ckpt_dir), reference)
        result["resumed_without_momentum"] = max_relative_error(
            resume(ckpt_dir, load_optimizer=False), reference)
    return result


def main(action, ckpt_dir, out_json):
    dist.init_process_group("gloo")
    result = compare(action, ckpt_dir)
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump(result, f)
    # The sharded models and their DTensors sit in reference cycles that outlive compare().
    # Left to the collector at interpreter exit, a rank aborted now and then (SIGABRT,
    # "terminate called without an active exception"; 4 of ~70 launches, 0 of 70 with
    # this collect): free them while the interpreter and the process group are alive.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
