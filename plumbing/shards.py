"""A prepared data directory's files, checked: its manifest, its shards, its tokenizer.

`python prepare.py` writes a directory once, offline (its docstring lists the files):
tokenizer.json, manifest.json and {train,val}_NNNNN.bin shards of raw token ids. What
reads it comes through here, and every mistake is one line naming the file and the command
that fixes it:
- `load_manifest`: the manifest is there, complete and in the format read here;
- `shard_paths`, `check_shards`: each shard is the size the manifest says, and the first
  time it is opened its sha256 and largest id are checked against the manifest, so a
  flipped byte or a foreign shard fails at start-up, not as a quietly wrong run or an
  IndexError deep in the model. The check is recorded in checked.json beside the
  manifest, so that other ranks and later restarts do not hash the corpus again: the only
  file this module writes (`prepare.py --verify` always hashes);
- `check_sources`: the sources of a mixture share one tokenizer, no larger than the model's
  vocabulary; `tokenizer_path`: the tokenizer is the one the shards were encoded with;
- `fingerprint` names a prepared dataset; `token_dtype` picks the shards' dtype.

Imports from stacklm: nothing.
"""

import hashlib
import json
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# The on-disk format, shared with prepare.py, which writes it.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
# The keys of the val split's documents, a JSON list in stream order: what an outside
# evaluator scores, and what a benchmark is checked against for contamination.
VAL_KEYS_FILE = "val_documents.json"
CHECKED = "checked.json"  # shards already hashed and found good (see check_shards)

VERIFY_CHUNK_BYTES = 8 << 20  # read, hash and scan a shard this much at a time
VERIFY_THREADS = 8  # shards hashed at once: hashlib and numpy release the GIL


def load_manifest(data_dir, vocab_size: int | None = None, flag: str = "--data_dir=") -> dict:
    """data_dir's manifest.json, after checking it is complete and in the format read here.
    `vocab_size`, the model's, goes into the prepare command an error suggests, and `flag`
    (the one that named data_dir) before the folder that command prepares."""
    path = Path(data_dir) / MANIFEST
    if Path(data_dir).is_file():
        raise NotADirectoryError(f"data directory {data_dir} is a file, not the directory "
                                 f"`python prepare.py` writes; "
                                 f"{_raw_text_hint(data_dir, vocab_size, flag)}")
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist; create it with "
                                f"`{_prepare_hint(data_dir, vocab_size)}`")
    if not path.is_file() and any(Path(data_dir).iterdir()):
        raise FileNotFoundError(f"{path} is missing: {data_dir} holds files but was never "
                                f"prepared; {_raw_text_hint(data_dir, vocab_size, flag)}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (never prepared); run "
                                f"`{_prepare_hint(data_dir, vocab_size)}`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        version, vocab_size, dtype = (manifest["format_version"], manifest["vocab_size"],
                                      np.dtype(manifest["dtype"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}); rerun "
                         f"`{_prepare_hint(data_dir)}`") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version}, this data.py reads "
                         f"{FORMAT_VERSION}; rerun `{_prepare_hint(data_dir)}`")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"{path}: vocab_size={vocab_size:,} does not fit dtype {dtype.name} "
                         f"(ids up to {np.iinfo(dtype).max:,}); rerun "
                         f"`{_prepare_hint(data_dir)}`, which picks uint32 for large vocabularies")
    return manifest


def check_sources(sources: list[str], vocab_size: int) -> dict[str, dict]:
    """Each source's manifest, after checking that the sources can be trained on together
    by a model of `vocab_size`: one tokenizer for all (a mixture's tokens must mean one
    thing), no larger than the model's vocabulary."""
    manifests = {d: load_manifest(d, vocab_size) for d in sources}
    first, first_sha = sources[0], manifests[sources[0]]["tokenizer"]["sha256"]
    for d, manifest in manifests.items():
        if manifest["tokenizer"]["sha256"] != first_sha:
            raise ValueError(f"{first} and {d} were prepared with different tokenizers; a "
                             f"mixture needs one: prepare {d} again with `python prepare.py "
                             f"--tokenizer {first}/tokenizer.json`")
        if manifest["vocab_size"] > vocab_size:
            raise ValueError(f"{d}: the tokenizer has {manifest['vocab_size']:,} ids but "
                             f"model.vocab_size={vocab_size:,}; set --model.vocab_size="
                             f"{manifest['vocab_size']} or re-prepare the data")
    return manifests


def tokenizer_path(data_dir) -> str:
    """The tokenizer the shards were encoded with, after checking it is that one."""
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / manifest["tokenizer"]["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; rerun `{_prepare_hint(data_dir)}`")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"{path} has sha256 {digest[:12]}... but {Path(data_dir) / MANIFEST} "
                         f"records {manifest['tokenizer']['sha256'][:12]}...: the shards were "
                         f"encoded with another tokenizer; restore it or rerun "
                         f"`{_prepare_hint(data_dir)}`")
    return str(path)


def shard_paths(data_dir, manifest: dict, split: str) -> list[tuple[Path, dict]]:
    """Each shard of a split with its manifest entry, after checking its size: a truncated
    or foreign file fails here, at start-up, not hours into a run."""
    if split not in manifest["splits"]:
        raise ValueError(f"split {split!r} is not in {Path(data_dir) / MANIFEST}; it has "
                         f"{sorted(manifest['splits'])}")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    shards = []
    for entry in manifest["splits"][split]["shards"]:
        path = Path(data_dir) / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} is missing; rerun `{_prepare_hint(data_dir)}`")
        expected, actual = entry["tokens"] * itemsize, path.stat().st_size
        if actual != expected:
            what = "truncated" if actual < expected else "larger than the manifest says"
            raise ValueError(f"shard {path} is {what}: {actual:,} bytes, manifest.json records "
                             f"{entry['tokens']:,} tokens = {expected:,} bytes; rerun "
                             f"`{_prepare_hint(data_dir)}`")
        shards.append((path, entry))
    return shards


# Shards checked in this process: the val loader, rebuilt at every evaluation, must not hash
# again. Keyed like the on-disk record below.
_verified_shards: set[tuple] = set()


def check_shards(data_dir, manifest: dict, shards: list[tuple[Path, dict]], remember=True):
    """Refuse a shard whose sha256 differs from the manifest's or that holds an id >=
    vocab_size: the first is a changed file, the second an IndexError deep in the model.
    One streaming pass per file, several files at once.

    With `remember`, a shard checked before and unchanged since (the same size and mtime,
    against the same manifest entry) is trusted: within this process, and across processes
    through data_dir/checked.json, which the first process to check a shard writes. So a
    corpus is hashed once, not by every rank at every (re)start: train.py lets rank 0
    check first, and the other ranks and later restarts read the record. (A same-size
    rewrite that keeps the mtime would pass; `prepare.py --verify` always hashes.)"""
    record = read_checked(data_dir) if remember else {}
    todo = []
    for path, entry in shards:
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns, entry["sha256"], manifest["vocab_size"],
               manifest["dtype"]]
        memory_key = (str(path.resolve()), *key)
        if not (remember and (memory_key in _verified_shards or record.get(entry["file"]) == key)):
            todo.append((path, entry, key, memory_key))
    if not todo:
        return
    dtype = np.dtype(manifest["dtype"])
    pool = ThreadPoolExecutor(min(len(todo), VERIFY_THREADS, os.cpu_count() or 1))
    try:
        scans = pool.map(lambda item: scan_shard(item[0], dtype), todo)
        for (path, entry, key, memory_key), (digest, largest) in zip(todo, scans, strict=True):
            check_shard(data_dir, manifest, path, entry, digest, largest)
            _verified_shards.add(memory_key)
            record[entry["file"]] = key
    finally:
        pool.shutdown(cancel_futures=True)  # a bad shard need not wait for the rest
    if remember:
        write_checked(data_dir, record)


def read_checked(data_dir) -> dict:
    """data_dir/checked.json: {shard file: [size, mtime_ns, sha256, vocab_size, dtype]} of
    shards hashed and found good; empty if absent or unreadable (then everything is hashed)."""
    try:
        record = json.loads((Path(data_dir) / CHECKED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_checked(data_dir, record: dict):
    """Write the record atomically (a name of this process's own, then a rename, so ranks
    writing at once never interleave). A read-only data_dir keeps no record: every process
    then hashes once, as before."""
    path = Path(data_dir) / CHECKED
    tmp = path.with_name(f"{CHECKED}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=0), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def scan_shard(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(sha256 hex digest, largest token id or -1 if empty) of one shard file, reading it
    once: each chunk is hashed and scanned while it is in the CPU cache."""
    digest, largest = hashlib.sha256(), -1
    buffer = bytearray(VERIFY_CHUNK_BYTES)  # a multiple of every itemsize
    with open(path, "rb") as f:
        while n := f.readinto(buffer):  # buffered readinto fills up to EOF
            chunk = memoryview(buffer)[:n]
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype, count=n // dtype.itemsize)
            if len(ids):
                largest = max(largest, int(ids.max()))
    return digest.hexdigest(), largest


def check_shard(data_dir, manifest: dict, path: Path, entry: dict, digest: str, largest: int):
    if digest != entry["sha256"]:
        raise ValueError(f"{path}: sha256 does not match {MANIFEST} (the file changed after it "
                         f"was prepared: {digest[:12]}... vs {entry['sha256'][:12]}...); rerun "
                         f"`{_prepare_hint(data_dir)}` or restore the file")
    vocab_size = manifest["vocab_size"]
    if largest >= vocab_size:
        raise ValueError(f"{path} holds token id {largest} but the tokenizer has "
                         f"{vocab_size:,} ids (0..{vocab_size - 1:,}), so the model's embedding "
                         f"has no row for it: the shard was encoded with another tokenizer or "
                         f"{MANIFEST} was edited; rerun `{_prepare_hint(data_dir)}`")


def verify(data_dir):
    """Check every shard (sha256 and id range) and the tokenizer's sha256 against the
    manifest, hashing every file again even if this process checked it already."""
    manifest = load_manifest(data_dir)
    for split in manifest["splits"]:
        check_shards(data_dir, manifest, shard_paths(data_dir, manifest, split), remember=False)
    tokenizer_path(data_dir)


def fingerprint(manifest: dict) -> str:
    """The identity of a prepared dataset: a sha256 over the tokenizer's hash and every
    shard's (split, file, sha256, tokens) in manifest order. Equal fingerprints mean the
    same token streams under the same tokenizer; the loader compares it on resume."""
    shards = [[split, shard["file"], shard["sha256"], shard["tokens"]]
              for split, info in manifest["splits"].items() for shard in info["shards"]]
    identity = json.dumps([manifest["tokenizer"]["sha256"], shards])  # unambiguous framing
    return hashlib.sha256(identity.encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding every id: half the disk and page cache of uint32.
    prepare.py picks the shards' dtype with it; load_manifest checks the vocabulary fits."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size={vocab_size:,} does not fit uint32 token ids")


def _prepare_hint(data_dir, vocab_size: int | None = None) -> str:
    """The command that (re)creates data_dir, for error messages; with the model's
    `vocab_size` where it is known, so that the data it makes fits the model."""
    builtin = re.fullmatch(r"stdlib-(\d+)k", Path(data_dir).name)
    if builtin:
        return f"python prepare.py --vocab_size {int(builtin[1]) * 1024} --data_dir {data_dir}"
    size = f" --vocab_size {vocab_size}" if vocab_size else ""
    return f"python prepare.py --source YOUR_CORPUS --data_dir {data_dir}{size}"


def _raw_text_hint(data_dir, vocab_size: int | None, flag: str) -> str:
    """For a data_dir that holds raw text: the command that prepares it, and the flag that
    names the result (`--data_dir=`, or where a task reads it, `--downstream=nextline:`).
    prepare refuses to write into (or inside) its source, so the result goes to data/NAME,
    or beside the source where that lies inside it or exists."""
    source = Path(data_dir).resolve()
    name = source.stem if source.is_file() else source.name
    target = Path("data", name).resolve()
    if target.is_relative_to(source) or target.exists():
        target = source.with_name(f"{name}-prepared")
    target = shlex.quote(os.path.relpath(target))
    size = f" --vocab_size {vocab_size}" if vocab_size else ""
    return (f"it looks like raw text: prepare it with `python prepare.py --source "
            f"{shlex.quote(str(data_dir))} --data_dir {target}{size}`, then pass "
            f"{flag}{target}")
