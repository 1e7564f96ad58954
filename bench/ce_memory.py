"""Peak memory and time of the loss head, chunked versus full logits. Prints one JSON line.

    python bench/ce_memory.py            # B·T=16384, V=32768, d=512, chunks of 1024 rows

"naive" is hidden @ weight.T in fp32 followed by F.cross_entropy (no z-loss, so the
comparison flatters it slightly); "chunked" is model.fused_ce_z_loss with z-loss. Both run
loss + backward for the hidden states and the head weight. Each call runs in its own
subprocess, so its peak RSS (ru_maxrss, a high-water mark) is its own, measured above the
RSS once the inputs exist. The two paths alternate for `--rounds` rounds and the median
time of each is reported, so a change in the machine's load hits both alike.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import fused_ce_z_loss  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def loss_and_backward(path, hidden, weight, targets, chunk_size):
    if path == "naive":
        loss = F.cross_entropy(hidden @ weight.T, targets)  # (N, V) fp32 logits
    else:
        loss, _, _ = fused_ce_z_loss(hidden, weight, targets, 1e-4, chunk_size)
    loss.backward()
    hidden.grad = weight.grad = None


def measure(path, args) -> dict:
    """Run in a child process: one call's peak memory above the inputs, and its time."""
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.d_model)).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,))
    baseline = peak_rss_mib()
    start = time.perf_counter()
    loss_and_backward(path, hidden, weight, targets, args.chunk_size)
    return {"peak_mib": peak_rss_mib() - baseline, "seconds": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="B·T rows of the head")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="calls of each path")
    parser.add_argument("--path", choices=["naive", "chunked"], help="(child process only)")
    args = parser.parse_args()
    if args.path:
        print(json.dumps(measure(args.path, args)))
        return
    result = {"tokens": args.tokens, "vocab": args.vocab, "d_model": args.d_model,
              "chunk_size": args.chunk_size, "threads": torch.get_num_threads()}
    runs = {"naive": [], "chunked": []}
    for _ in range(args.rounds):
        for path in runs:
            child = subprocess.run([sys.executable, __file__, "--path", path] + sys.argv[1:],
                                   capture_output=True, text=True, check=True)
            runs[path].append(json.loads(child.stdout))
    for path, calls in runs.items():
        result[f"{path}_peak_mib"] = round(max(c["peak_mib"] for c in calls), 1)
        result[f"{path}_seconds"] = round(statistics.median(c["seconds"] for c in calls), 2)
    result["memory_ratio"] = round(result["naive_peak_mib"] / result["chunked_peak_mib"], 1)
    result["time_ratio"] = round(result["chunked_seconds"] / result["naive_seconds"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
