"""Loader throughput: tokens/s of producing (32, 2048) batches, all four tensors, on one
thread, from the built-in corpus (~8M tokens at vocab 32768; prepared first if missing).

    python bench/loader.py [--data_dir data/stdlib-32k] [--repeats 3]

Prints one JSON line. The shards are read once before timing, so this measures the
loader's own work (gather, widen to int64, position/seq ids), not the disk.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import data  # noqa: E402
import prepare  # noqa: E402

B, T = 32, 2048


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=prepare.builtin_data_dir(32768),
                        help="prepared directory (the built-in corpus is made if missing)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over one epoch")
    args = parser.parse_args()
    torch.set_num_threads(1)

    prepare_s = None
    if not (Path(args.data_dir) / "manifest.json").exists():
        start = time.perf_counter()
        prepare.prepare(out_dir=args.data_dir, vocab_size=32768)
        prepare_s = round(time.perf_counter() - start, 1)

    loader = data.PackedShardLoader(args.data_dir, "train", T, B)
    batches = loader.windows_per_epoch // B  # stay inside epoch 0: no wrap-around message
    start_state = loader.state_dict()
    wall_rates, cpu_rates = [], []
    for repeat in range(args.repeats + 1):  # pass 0 warms the page cache, untimed
        loader.load_state_dict(start_state)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            batch = next(loader)
        if repeat:
            wall_rates.append(batches * B * T / (time.perf_counter() - wall))
            # CPU time too: on a shared machine wall time also counts other people's work
            cpu_rates.append(batches * B * T / (time.process_time() - cpu))
    assert batch["seq_ids"].shape == (B, T)
    print(json.dumps({"bench": "loader", "batch": [B, T], "batches": batches,
                      "data_tokens": loader.manifest["splits"]["train"]["tokens"],
                      "tokens_per_s": round(statistics.median(wall_rates)),
                      "tokens_per_cpu_s": round(statistics.median(cpu_rates)),
                      "threads": 1, "prepare_s": prepare_s}))


if __name__ == "__main__":
    main()
