"""prepare.py at scale: encoding speed beside the tokenizer library's own, and peak memory
as the corpus grows.

    python bench/prepare.py [--cores 1,2] [--rounds 5] [--memory_mb 24] [--only speed|memory]

Speed. The built-in corpus's documents (the standard library), a 32k tokenizer trained on
a 4M-character sample. On c cores (the process pinned to the first c), interleaved rounds:
  library   tokenizers' own `encode_batch_fast` on all documents in one call (the call
            prepare makes, with nothing else to do: the ceiling)
  prepare   prepare.encode_into: the same documents, read, encoded and written as shards
  serial    the part no core count speeds up, on one thread: reading the documents, then
            prepare's work per document on already-encoded ids (split by hash, ids -> uint16
            array -> shard files with sha256)
Best round of each; ratio = prepare / library. The 20B-token estimate for a 32-core node
takes the encoder's measured scaling from 1 to the largest core count (not linear) and
caps it at the serial part's single-thread rate, which no core count raises.

Memory. Synthetic text of distinct words (every word a random letter string, so more text
means a larger vocabulary of words: repeated text would hide growth), prepared at 1x and
4x the size with the same tokenizer budget and 4M-token shards, each in a fresh process;
peak RSS of each. (What stays in memory is bounded by those settings: the tokenizer's
sample, the chunks in flight, and one shard being filled; with the default 64M-token
shards the 1x corpus would not fill one, and the shard buffer alone would grow with it.)

Prints one JSON line.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import prepare  # noqa: E402
from data import EOS_TOKEN  # noqa: E402
from plumbing import cli  # noqa: E402

TARGET_TOKENS = 20e9  # the reference run's total_steps × global batch, rounded
NODE_CORES = 32


def speed_worker(cores: int, rounds: int) -> dict:
    """Run pinned to `cores` cores (set before tokenizers starts its thread pool)."""
    os.sched_setaffinity(0, set(range(cores)))
    root, files = prepare.stdlib_files()
    corpus = prepare.Corpus(None, root, files, "text")
    docs = list(corpus.documents([]))
    texts = [text for _, text in docs]
    tok = prepare.train_tokenizer(prepare.sample(corpus, 0.01, 4_000_000), 32768)
    tok.encode_special_tokens = True
    eos = tok.token_to_id(EOS_TOKEN)
    best = {"library": 1e9, "prepare": 1e9, "serial": 1e9}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            start = time.perf_counter()
            encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
            best["library"] = min(best["library"], time.perf_counter() - start)
            tokens = sum(len(e.ids) for e in encodings)

            writers = shard_writers(Path(tmp) / f"prepare{r}")
            start = time.perf_counter()
            prepare.encode_into(tok, iter(docs), writers, 0.01, eos, None)
            for writer in writers.values():
                writer.finish()
            best["prepare"] = min(best["prepare"], time.perf_counter() - start)

            writers = shard_writers(Path(tmp) / f"serial{r}")
            start = time.perf_counter()
            for (key, text), encoding in zip(corpus.documents([]), encodings, strict=True):
                split = "val" if prepare.is_val(key, 0.01) else "train"
                writers[split].add(key, encoding.ids, eos, len(text.encode()))
            for writer in writers.values():
                writer.finish()
            best["serial"] = min(best["serial"], time.perf_counter() - start)
    return {"cores": cores, "tokens": tokens,
            **{f"{k}_tokens_per_s": round(tokens / v) for k, v in best.items()},
            "ratio": round(best["library"] / best["prepare"], 3)}


def shard_writers(out: Path) -> dict:
    out.mkdir()
    return {split: prepare.ShardWriter(out, split, np.dtype(np.uint16),
                                       prepare.DEFAULT_SHARD_TOKENS) for split in ("train", "val")}


def memory_worker(megabytes: int, tokenizer_chars: int) -> dict:
    """Prepare `megabytes` of distinct synthetic text; report this process's peak RSS."""
    rng = np.random.default_rng(megabytes)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "corpus"
        source.mkdir()
        for i in range(megabytes):  # one 1 MB file of ~200 documents each
            source.joinpath(f"part_{i:04d}.txt").write_text(synthetic_text(rng, 1 << 20),
                                                            encoding="utf-8")
        baseline = peak_rss_mb()
        start = time.perf_counter()
        manifest = prepare.prepare(str(source), str(Path(tmp) / "out"), vocab_size=8192,
                                   tokenizer_chars=tokenizer_chars, shard_tokens=1 << 22)
        seconds = time.perf_counter() - start
    return {"text_mb": megabytes, "train_tokens": manifest["splits"]["train"]["tokens"],
            "seconds": round(seconds, 1), "peak_rss_mb": round(peak_rss_mb()),
            "rss_before_prepare_mb": round(baseline)}


def synthetic_text(rng, n_chars: int) -> str:
    """Words of 2-9 random lowercase letters: nearly every word is new, as in a growing
    web corpus, so the text has no fixed vocabulary of words."""
    letters = rng.integers(ord("a"), ord("z") + 1, size=n_chars, dtype=np.uint8)
    gaps = rng.integers(3, 11, size=n_chars // 3).cumsum()
    letters[gaps[gaps < n_chars]] = ord(" ")
    text = letters.tobytes().decode()
    step = 5000
    return EOS_TOKEN.join(text[i:i + step] for i in range(0, len(text), step))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def in_subprocess(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(speeds: list[dict]) -> dict:
    """Hours for TARGET_TOKENS on NODE_CORES cores: prepare's one-core rate scaled by the
    per-core efficiency measured at the largest core count (at most 1; it only falls with
    more cores, so this errs fast), on all cores but the serial thread's, and capped by the
    serial part's single-thread rate."""
    one, most = speeds[0], speeds[-1]
    efficiency = min(1.0, most["prepare_tokens_per_s"]
                     / (most["cores"] * one["prepare_tokens_per_s"]))
    encoder = one["prepare_tokens_per_s"] * (NODE_CORES - 1) * efficiency
    rate = min(encoder, most["serial_tokens_per_s"])
    return {"cores": NODE_CORES, "scaling_efficiency": round(efficiency, 3),
            "encoder_tokens_per_s": round(encoder),
            "serial_cap_tokens_per_s": most["serial_tokens_per_s"],
            "bound": "serial" if rate < encoder else "encoder",
            "hours_for_20B_tokens": round(TARGET_TOKENS / rate / 3600, 2)}


def main():
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", default="1,2", help="core counts to measure speed on")
    parser.add_argument("--rounds", type=cli.at_least(1), default=5,
                        help="interleaved rounds per count")
    parser.add_argument("--memory_mb", type=cli.at_least(1), default=24,
                        help="the 1x corpus, in MB")
    parser.add_argument("--tokenizer_chars", type=cli.at_least(1), default=4_000_000,
                        help="tokenizer budget of both memory runs (below the 1x corpus)")
    parser.add_argument("--only", choices=["speed", "memory"], help="one half of the bench")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, value = args.worker[0], int(args.worker[1])
        result = (speed_worker(value, args.rounds) if kind == "speed"
                  else memory_worker(value, args.tokenizer_chars))
        print(json.dumps(result))
        return
    result = {}
    if args.only != "memory":
        cores = [int(c) for c in args.cores.split(",") if int(c) <= len(os.sched_getaffinity(0))]
        speeds = [in_subprocess("--worker", "speed", str(c), "--rounds", str(args.rounds))
                  for c in cores]
        result.update(speed=speeds, estimate=estimate(speeds))
    if args.only != "speed":
        memory = [in_subprocess("--worker", "memory", str(m * args.memory_mb),
                                "--tokenizer_chars", str(args.tokenizer_chars)) for m in (1, 4)]
        result.update(memory=memory, memory_growth_4x=round(
            memory[1]["peak_rss_mb"] / memory[0]["peak_rss_mb"], 3))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
