"""How much one Muon step costs next to one AdamW step, on Stack-100M's hidden matrices, and
what Muon's step sends between ranks under FSDP2.

    python bench/optim.py [--repeats 1]     # ~3 minutes on 2 CPU cores
    python bench/optim.py --ranks 2         # sharded: FSDP2 over gloo, 2 CPU processes

Prints one JSON line. Both optimizers step the same parameter set, the 2-D hidden matrices
that build_optimizers gives to Muon (attention and MLP projections of the default
StackConfig), with fixed random gradients; the first step of each is untimed (it allocates
state), then the fastest of `repeats` steps is reported. Muon's extra cost is Newton–Schulz:
per matrix 5 iterations of three matmuls on the short side m = min(A, B), n = max(A, B),
5·(4m²n + 2m³) flops, against AdamW's handful of elementwise passes.

With --ranks N the model is sharded as train.shard_model shards it, on N gloo ranks of this
machine, and Muon's step is timed the same way while CommDebugMode counts its collectives:
two per distinct matrix shape (each owner gets its matrices' rows in one all-to-all and
sends the results back in another), not two per matrix. It also counts the bytes each rank
sends in those all-to-alls in one step, with Newton–Schulz in fp32 (an fp32 run) and in
bf16 (a bf16 run, whose pieces travel in bf16), side by side.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from config import TrainConfig  # noqa: E402
from model import Transformer  # noqa: E402
from optim import build_optimizers  # noqa: E402
from plumbing import cli  # noqa: E402


def fastest_step(optimizer, repeats: int) -> float:
    optimizer.step()  # allocates state; not timed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times)


def with_gradients(model, muon):
    """Muon's matrices, each with a fixed random gradient (the same on every rank)."""
    matrices = muon.param_groups[0]["params"]
    generator = torch.Generator().manual_seed(0)
    for p in matrices:
        grad = torch.randn(p.shape, generator=generator) * 1e-3
        sharded = isinstance(p, DTensor)  # then this rank holds its rows of it
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if sharded else grad
    return matrices


def newton_schulz_gflop(matrices) -> float:
    return sum(5 * (4 * min(p.shape) ** 2 * max(p.shape) + 2 * min(p.shape) ** 3)
               for p in matrices) / 1e9


def single_process(repeats: int) -> dict:
    cfg = TrainConfig()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    muon = build_optimizers(model, cfg).named["muon"]
    matrices = with_gradients(model, muon)
    adamw = torch.optim.AdamW(matrices, lr=cfg.adamw_peak_lr, betas=cfg.betas,
                              weight_decay=cfg.weight_decay)
    muon_s = fastest_step(muon, repeats)
    adamw_s = fastest_step(adamw, repeats)
    return {"bench": "optim", "matrices": len(matrices),
            "params": sum(p.numel() for p in matrices),
            "muon_step_s": round(muon_s, 4), "adamw_step_s": round(adamw_s, 4),
            "muon_over_adamw": round(muon_s / adamw_s, 1),
            "newton_schulz_gflop": round(newton_schulz_gflop(matrices), 1),
            "newton_schulz_gflops_per_s": round(newton_schulz_gflop(matrices) / muon_s, 1),
            "newton_schulz_dtype": "float32 (the CPU default)"}


def bytes_sent(muon, ns_dtype: torch.dtype) -> int:
    """The bytes this rank sends in the all-to-alls of one Muon step with Newton–Schulz in
    ns_dtype (what optim.all_to_all hands dist.all_to_all_single, padding included)."""
    sent, all_to_all_single = [], dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return all_to_all_single(output, input, *args, **kwargs)
    muon.ns_dtype, dist.all_to_all_single = ns_dtype, counting
    try:
        muon.step()
    finally:
        dist.all_to_all_single = all_to_all_single
    return sum(sent)


def sharded_worker(repeats: int):
    """One rank of --ranks: the sharded model's Muon step, timed and its collectives counted;
    rank 0 prints the line."""
    dist.init_process_group("gloo")
    cfg = TrainConfig()
    model = train.shard_model(train.build_model(cfg, compile_blocks=False),
                              torch.device("cpu"), bf16=False)
    muon = build_optimizers(model, cfg).named["muon"]
    matrices = with_gradients(model, muon)
    muon_s = fastest_step(muon, repeats)
    with CommDebugMode() as comm:
        muon.step()
    sent = {str(dtype).removeprefix("torch."): bytes_sent(muon, dtype)
            for dtype in (torch.float32, torch.bfloat16)}
    if dist.get_rank() == 0:
        print(json.dumps({
            "bench": "optim_sharded", "ranks": dist.get_world_size(),
            "matrices": len(matrices), "shapes": len({p.shape for p in matrices}),
            "collectives_per_step": comm.get_total_counts(),
            "collectives": {str(op): n for op, n in comm.get_comm_counts().items()},
            "muon_step_s": round(muon_s, 4),
            "all_to_all_bytes_per_rank_per_step": sent,
            "newton_schulz_gflop": round(newton_schulz_gflop(matrices), 1)}))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=cli.at_least(1), default=1)
    parser.add_argument("--ranks", type=cli.at_least(2), default=None,
                        help="shard over this many gloo ranks (FSDP2) instead")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return sharded_worker(args.repeats)
    if args.ranks:
        command = [sys.executable, "-m", "torch.distributed.run",
                   f"--nproc_per_node={args.ranks}", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=localhost:0", __file__, "--worker",
                   f"--repeats={args.repeats}"]
        sys.exit(subprocess.run(command, env=os.environ | {"OMP_NUM_THREADS": "1"}).returncode)
    print(json.dumps({**single_process(args.repeats), "threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
