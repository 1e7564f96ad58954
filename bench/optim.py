"""How much one Muon step costs next to one AdamW step, on Stack-100M's hidden matrices.

    python bench/optim.py [--repeats 1]   # ~3 minutes on 2 CPU cores

Prints one JSON line. Both optimizers step the same parameter set, the 2-D hidden matrices
that build_optimizers gives to Muon (attention and MLP projections of the default
StackConfig), with fixed random gradients; the first step of each is untimed (it allocates
state), then the fastest of `repeats` steps is reported. Muon's extra cost is Newton–Schulz:
per matrix 5 iterations of three matmuls on the short side m = min(A, B), n = max(A, B),
5·(4m²n + 2m³) flops, against AdamW's handful of elementwise passes.
"""

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import TrainConfig  # noqa: E402
from model import Transformer  # noqa: E402
from optim import build_optimizers  # noqa: E402


def fastest_step(optimizer, repeats: int) -> float:
    optimizer.step()  # allocates state; not timed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cfg = TrainConfig()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    muon = build_optimizers(model, cfg).named["muon"]
    matrices = muon.param_groups[0]["params"]
    for p in matrices:
        p.grad = torch.randn_like(p) * 1e-3
    adamw = torch.optim.AdamW(matrices, lr=cfg.adamw_peak_lr, betas=cfg.betas,
                              weight_decay=cfg.weight_decay)
    muon_s = fastest_step(muon, args.repeats)
    adamw_s = fastest_step(adamw, args.repeats)
    ns_flops = sum(5 * (4 * min(p.shape) ** 2 * max(p.shape) + 2 * min(p.shape) ** 3)
                   for p in matrices)
    print(json.dumps({
        "bench": "optim", "matrices": len(matrices),
        "params": sum(p.numel() for p in matrices),
        "muon_step_s": round(muon_s, 4), "adamw_step_s": round(adamw_s, 4),
        "muon_over_adamw": round(muon_s / adamw_s, 1),
        "newton_schulz_gflop": round(ns_flops / 1e9, 1),
        "newton_schulz_gflops_per_s": round(ns_flops / 1e9 / muon_s, 1),
        "newton_schulz_dtype": "float32 (the CPU default)", "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
