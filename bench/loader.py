"""Loader throughput: tokens/s of producing (32, 2048) batches, all four tensors, on one
thread, from the built-in corpus (~8M tokens at vocab 32768; prepared first if missing).

    python bench/loader.py [--data_dir data/stdlib-32k] [--repeats 3]

Three loaders, timed in interleaved rounds in one process: the single-source reader
(PackedShardLoader), the training loader with one source (a MixtureLoader of one), and
the training loader mixing three sources 5:3:2 (the corpus behind three directories of
links to its files, so each source is as large as the corpus). Then the time to lay out
a mixture's order for 10M windows (data.interleave over 10M positions, 7:2:1).

Prints one JSON line. The shards are read once before timing, so this measures the
loaders' own work (gather, widen to int64, position/seq ids), not the disk.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import data  # noqa: E402
import prepare  # noqa: E402
from plumbing import cli, shards  # noqa: E402

B, T = 32, 2048


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=prepare.builtin_data_dir(32768),
                        help="prepared directory (the built-in corpus is made if missing)")
    parser.add_argument("--repeats", type=cli.at_least(1), default=7,
                        help="timed interleaved rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)

    prepare_s = None
    if not (Path(args.data_dir) / "manifest.json").exists():
        start = time.perf_counter()
        prepare.prepare(out_dir=args.data_dir, vocab_size=32768)
        prepare_s = round(time.perf_counter() - start, 1)

    links = tempfile.TemporaryDirectory()
    copies = [linked_copy(args.data_dir, Path(links.name) / f"source{i}") for i in range(3)]
    loaders = {"reader": data.PackedShardLoader(args.data_dir, "train", T, B),
               "mixture_of_one": data.MixtureLoader(
                   [data.Stage(0, ((args.data_dir, 1.0),))], T, B),
               "mixture_of_three": data.MixtureLoader(
                   [data.Stage(0, tuple(zip(copies, (0.5, 0.3, 0.2))))], T, B)}
    n = loaders["reader"].windows_per_epoch
    batches = n // B  # inside epoch 0 of every source: no wrap-around
    starts = {name: loader.state_dict() for name, loader in loaders.items()}
    rates = {name: [] for name in loaders}
    for repeat in range(args.repeats + 1):  # pass 0 warms the page cache, untimed
        for name, loader in loaders.items():
            loader.load_state_dict(starts[name])
            cpu = time.process_time()  # on a shared machine wall time counts others' work
            for _ in range(batches):
                batch = next(loader)
            if repeat:
                rates[name].append(batches * B * T / (time.process_time() - cpu))
            assert batch["seq_ids"].shape == (B, T)
    plan_s = []
    for _ in range(3):
        start = time.perf_counter()
        data.interleave([7, 2, 1], 0, 10_000_000)
        plan_s.append(time.perf_counter() - start)
    median = {name: round(statistics.median(r)) for name, r in rates.items()}
    print(json.dumps({"bench": "loader", "batch": [B, T], "batches": batches,
                      "data_tokens": loaders["reader"].manifest["splits"]["train"]["tokens"],
                      "tokens_per_cpu_s": median,
                      "three_over_one": round(median["mixture_of_three"]
                                              / median["mixture_of_one"], 3),
                      "plan_10M_windows_s": round(statistics.median(plan_s), 3),
                      "threads": 1, "prepare_s": prepare_s}))
    links.cleanup()


def linked_copy(data_dir: str, target: Path) -> str:
    """A directory of symbolic links to data_dir's files: another source, the same bytes."""
    target.mkdir()
    for path in Path(data_dir).iterdir():
        if path.name != shards.CHECKED:
            (target / path.name).symlink_to(path.resolve())
    return str(target)


if __name__ == "__main__":
    main()
