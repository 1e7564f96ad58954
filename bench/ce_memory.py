"""Peak memory and time of the loss head, chunked versus full logits. Prints one JSON line.

    python bench/ce_memory.py                   # 16,384 and 32,768 rows, chunks of 1,024 and 4,096
    python bench/ce_memory.py --rows 65536 --chunks 4096   # a Stack-100M micro-batch (32 × 2,048)

V = 32,768 and d = 512 are Stack-100M's, and so is a chunk of 4,096 rows (ce_chunk_size).
65,536 rows is for a GPU: full logits there need about 24 GiB (twice 32,768 rows' 12 GiB).

"naive" is hidden @ weight.T in fp32 followed by F.cross_entropy (no z-loss, so the
comparison flatters it slightly), measured once per row count since it has no chunks;
"chunked" is loss.py's fused_ce_z_loss with z-loss, at each chunk size.
Both run loss + backward for the hidden states and the head weight. Each call runs in its own subprocess, so its peak
is its own, measured above the memory once the inputs exist: on a CPU the peak RSS (ru_maxrss,
a high-water mark), on a GPU torch.cuda.max_memory_allocated. The calls alternate for
`--rounds` rounds and the median time of each is reported, so a change in the machine's load
hits all alike. The line: {"results": [{"path", "rows", "chunk_size", "peak_mib", "seconds"},
...]}, where each chunked result also has memory_ratio (naive's peak over its own) and
time_ratio (its time over naive's), naive's at the same rows.
"""

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
from loss import fused_ce_z_loss  # noqa: E402
from plumbing import cli  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def peak_mib() -> float:
    """The process's high-water mark so far: allocated GPU memory, or the CPU's resident set."""
    if DEVICE == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def loss_and_backward(path, hidden, weight, targets, chunk_size):
    if path == "naive":
        loss = F.cross_entropy(hidden @ weight.T, targets)  # (N, V) fp32 logits
    else:
        loss, _, _ = fused_ce_z_loss(hidden, weight, targets, 1e-4, chunk_size)
    loss.backward()
    hidden.grad = weight.grad = None


def measure(path, rows, chunk_size, args) -> dict:
    """Run in a child process: one call's peak memory above the inputs, and its time."""
    torch.manual_seed(0)
    hidden = torch.randn(rows, args.d_model, device=DEVICE, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.d_model, device=DEVICE)).requires_grad_()
    targets = torch.randint(0, args.vocab, (rows,), device=DEVICE)
    if DEVICE == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as the trainer runs on a GPU
        # The first call pays for cuBLAS's set-up; a GPU's peak, unlike RSS, can be reset.
        loss_and_backward(path, hidden, weight, targets, chunk_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = peak_mib()
    start = time.perf_counter()
    loss_and_backward(path, hidden, weight, targets, chunk_size)
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock
    return {"peak_mib": peak_mib() - baseline, "seconds": time.perf_counter() - start}


def run_child(path, rows, chunk_size, args) -> dict:
    command = [sys.executable, __file__, "--child", path, str(rows), json.dumps(chunk_size),
               "--vocab", str(args.vocab), "--d_model", str(args.d_model)]
    child = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(child.stdout)


def summarise(calls, runs) -> list[dict]:
    """Per call: the peak over rounds, the median time, and chunked against naive."""
    results = []
    for (path, rows, chunk_size), measured in zip(calls, runs, strict=True):
        results.append({"path": path, "rows": rows, "chunk_size": chunk_size,
                        "peak_mib": round(max(m["peak_mib"] for m in measured), 1),
                        "seconds": round(statistics.median(m["seconds"] for m in measured), 2)})
    naive = {r["rows"]: r for r in results if r["path"] == "naive"}
    for r in results:
        if r["path"] == "chunked":
            r["memory_ratio"] = round(naive[r["rows"]]["peak_mib"] / r["peak_mib"], 1)
            r["time_ratio"] = round(r["seconds"] / naive[r["rows"]]["seconds"], 2)
    return results


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=cli.at_least(1), nargs="+", default=[16384, 32768],
                        help="B·T rows fed to the head, one or more")
    parser.add_argument("--chunks", type=cli.at_least(1), nargs="+", default=[1024, 4096],
                        help="the chunked head's rows per chunk (ce_chunk_size), one or more")
    parser.add_argument("--vocab", type=cli.at_least(1), default=32768)
    parser.add_argument("--d_model", type=cli.at_least(1), default=512)
    parser.add_argument("--rounds", type=cli.at_least(1), default=1,
                        help="calls of each (path, rows, chunk); one round of the defaults takes "
                             "~4 minutes on 2 CPU cores")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "ROWS", "CHUNK"),
                        help="(child process only)")
    args = parser.parse_args()
    if args.child:
        path, rows, chunk_size = args.child  # chunk_size "null" for naive
        print(json.dumps(measure(path, int(rows), json.loads(chunk_size), args)))
        return
    calls = [(path, rows, chunk_size) for rows in args.rows
             for path, chunk_size in [("naive", None)] + [("chunked", c) for c in args.chunks]]
    runs = [[] for _ in calls]
    for _ in range(args.rounds):
        for call, measured in zip(calls, runs, strict=True):
            measured.append(run_child(*call, args))
    print(json.dumps({"device": DEVICE, "threads": torch.get_num_threads(),
                      "vocab": args.vocab, "d_model": args.d_model, "rounds": args.rounds,
                      "results": summarise(calls, runs)}))


if __name__ == "__main__":
    main()
