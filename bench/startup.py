"""Start-up cost of the shard check on 1 and 4 ranks over the same data.

    python bench/startup.py [--mb 1024] [--ranks 1,4]

A synthetic prepared directory (`--mb` of random uint16 token shards and their manifest)
is opened by train.py's own start-up path: ranks launched by torchrun (gloo, CPU), an
`accelerate.Accelerator`, and the train loader built under `main_process_first`, so rank
0 checks the shards first and the other ranks find its record (data/checked.json). For
each rank count:
  first     no record yet: rank 0 hashes the corpus, the others trust its record
  restart   the record is there: nobody hashes
  every     the check as it was before the record: every rank hashes every shard, all at
            once (shards.check_shards with remember=False, no main_process_first)
Seconds until the slowest rank's loader is ready, and the bytes hashed by all ranks. The
shards sit in the page cache here: on shared storage the bytes read cost more than the
hashing measured.

Prints one JSON line.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import data  # noqa: E402
from plumbing import cli, shards  # noqa: E402

SHARD_MB = 64


def make_data(root: Path, megabytes: int):
    """Random token shards of SHARD_MB each and a manifest data.py accepts."""
    rng = np.random.default_rng(0)
    shards = []
    for i in range(max(1, megabytes // SHARD_MB)):
        tokens = rng.integers(0, 32768, size=SHARD_MB << 19, dtype=np.uint16)
        name = f"train_{i:05d}.bin"
        (root / name).write_bytes(tokens.tobytes())
        shards.append({"file": name, "tokens": len(tokens),
                       "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
    manifest = {"format_version": shards.FORMAT_VERSION, "vocab_size": 32768, "eos_id": 0,
                "dtype": "uint16", "tokenizer": {"file": "tokenizer.json", "sha256": ""},
                "splits": {"train": {"tokens": sum(s["tokens"] for s in shards),
                                     "shards": shards}}}
    (root / shards.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


def worker(data_dir: str, mode: str, out: str):
    """One rank: time until this rank's train loader is ready; count the bytes it hashed."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    hashed = []
    real_scan = shards.scan_shard
    shards.scan_shard = lambda path, dtype: (hashed.append(path.stat().st_size),
                                           real_scan(path, dtype))[1]
    accelerator.wait_for_everyone()
    start = time.perf_counter()
    if mode == "every":
        manifest = shards.load_manifest(data_dir)
        shards.check_shards(data_dir, manifest, shards.shard_paths(data_dir, manifest, "train"),
                          remember=False)
    else:
        with accelerator.main_process_first():
            data.PackedShardLoader(data_dir, "train", 2048, 32, accelerator.process_index,
                                   accelerator.num_processes)
    seconds = time.perf_counter() - start
    Path(f"{out}.{accelerator.process_index}").write_text(json.dumps(
        {"seconds": seconds, "hashed_bytes": sum(hashed)}), encoding="utf-8")
    accelerator.wait_for_everyone()


def launch(data_dir: Path, mode: str, ranks: int) -> dict:
    out = data_dir.parent / f"{mode}_{ranks}"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", __file__, "--worker",
               str(data_dir), mode, str(out)]
    subprocess.run(command, check=True, capture_output=True,
                   env=os.environ | {"OMP_NUM_THREADS": "1"})
    results = [json.loads(Path(f"{out}.{r}").read_text(encoding="utf-8")) for r in range(ranks)]
    return {"mode": mode, "ranks": ranks,
            "seconds": round(max(r["seconds"] for r in results), 3),
            "hashed_mb": round(sum(r["hashed_bytes"] for r in results) / 2**20)}


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=cli.at_least(1), default=1024,
                        help="corpus size in MB of shards")
    parser.add_argument("--ranks", default="1,4", help="rank counts to launch")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        make_data(data_dir, args.mb)
        for ranks in map(int, args.ranks.split(",")):
            (data_dir / shards.CHECKED).unlink(missing_ok=True)
            rows += [launch(data_dir, mode, ranks) for mode in ("first", "restart", "every")]
    print(json.dumps({"corpus_mb": args.mb, "runs": rows}))


if __name__ == "__main__":
    main()
