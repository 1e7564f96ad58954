"""Data: corpus -> byte-level BPE tokenizer -> packed token shards -> a resumable loader.

Two halves. `prepare` (the CLI `python data.py ...`) runs once, offline, and writes

    data/<name>/tokenizer.json      byte-level BPE with one special token, EOS_TOKEN
    data/<name>/train_00000.bin ... raw token ids, uint16 (uint32 if the vocab needs it)
    data/<name>/val_00000.bin ...
    data/<name>/manifest.json       counts, shard list with sha256, tokenizer hash, dtype

`PackedShardLoader` memory-maps the shards and yields packed batches for the training loop.

The token stream. A split is one stream: its shards concatenated in order. EOS is written
*before* every document, `[EOS d1 EOS d2 EOS d3 ...]`, so it marks a boundary and doubles
as the next document's beginning-of-sequence token. The EOS token belongs to the document
that follows it: `seq_ids` increase at each EOS and `position_ids` are 0 there. Hence
every target is predicted, none is ignored (-100): the last token of a document predicts
EOS (the model learns where documents end), and EOS predicts the first token of the next
document with only itself as context (the model learns how documents open).

Windows. Window i is tokens [i*T, i*T + T + 1) of the stream: inputs are the first T,
targets the last T. The stride is T, so every token is a target exactly once per epoch.
A row starts wherever its window starts, usually mid-document: position 0 and seq_id 0 there.

Order and ranks. Epoch e visits the windows in a permutation seeded by (seed, e); the
global stream is those permutations end to end. One cursor counts the windows all ranks
have consumed together; a global micro-batch is the next micro_batch_size*world_size
windows and rank r takes the r-th block of micro_batch_size. So the sequence of global
batches depends on the seed alone, not on the number of ranks, and a saved cursor resumes
exactly under any world size. The val split is visited in stream order, unshuffled.

This file imports nothing else from stacklm.
"""

import argparse
import bisect
import glob
import hashlib
import importlib.util
import json
import os
import re
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

EOS_TOKEN = "<|endoftext|>"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 2**26  # 128 MiB of uint16 per file
ENCODE_CHUNK_CHARS = 4 << 20  # text handed to the parallel encoder at once


def builtin_data_dir(vocab_size: int) -> str:
    """Where `python data.py --vocab_size N` puts the built-in corpus, e.g. data/stdlib-4k."""
    return f"data/stdlib-{vocab_size // 1024}k"


def _prepare_hint(data_dir) -> str:
    """The command that (re)creates data_dir, for error messages."""
    builtin = re.fullmatch(r"stdlib-(\d+)k", Path(data_dir).name)
    if builtin:
        return f"python data.py --vocab_size {int(builtin[1]) * 1024} --out {data_dir}"
    return f"python data.py --source YOUR_CORPUS --out {data_dir}"


# ---------------------------------------------------------------------------------------
# Sources: which documents a corpus holds, in a deterministic order.
# ---------------------------------------------------------------------------------------

def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's own .py files: always present, so the default run needs no
    download. Installed packages (site-packages) differ between machines and are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    return root, sorted(files)


def find_source(source: str | None) -> tuple[Path | None, list[Path]]:
    """Resolve --source to (root, files) for local text, or (None, []) for a Hugging Face
    dataset. Fails here, before any expensive work, when nothing can be read."""
    if source is None:
        return stdlib_files()
    path = Path(source)
    if path.is_file():
        return path.parent, [path]
    saved_dataset = (path / "state.json").exists() or (path / "dataset_dict.json").exists()
    if path.is_dir() and not saved_dataset:  # those two files mark a HF `save_to_disk` folder
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"empty corpus: directory {source} holds no files; point --source "
                             f"at a directory of text files")
        return path, files
    if any(c in source for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"empty corpus: no file matches the glob {source!r}; check the "
                             f"pattern (quote it so the shell does not expand it)")
        return Path(os.path.commonpath([p.parent for p in files])), files
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--source {source!r} is not a file, directory or glob match, so it "
                         f"would be read as a Hugging Face dataset, but the optional `datasets` "
                         f"package is not installed; `pip install datasets` or fix the path")
    return None, []


def file_documents(path: Path, root: Path, text_field: str, skipped: list):
    """Yield (key, text) for one file: a .jsonl holds one document per line (in text_field),
    a .txt holds documents separated by EOS_TOKEN, any other file is one document.
    Unreadable or non-UTF-8 input is recorded in `skipped`, not fatal."""
    key = path.relative_to(root).as_posix()
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        skipped.append({"file": str(path), "reason": f"{type(e).__name__}: {e}"})
        return
    if path.suffix == ".jsonl":
        for line_number, line in enumerate(text.splitlines(), 1):
            try:
                document = json.loads(line)[text_field] if line.strip() else ""
            except (ValueError, KeyError, TypeError):
                document = None
            if not isinstance(document, str):
                skipped.append({"file": f"{path}:{line_number}",
                                "reason": f"not a JSON object with a string {text_field!r}"})
                continue
            yield f"{key}:{line_number}", document
    elif path.suffix == ".txt":
        for i, document in enumerate(text.split(EOS_TOKEN)):
            yield f"{key}:{i}", document
    else:
        yield key, text


def hf_documents(source: str, text_field: str):
    """Yield (key, text) from a Hugging Face dataset: a directory written by `save_to_disk`,
    or a hub name, streamed so a large corpus is never held in memory."""
    import datasets  # optional: only this source kind needs it

    if Path(source).is_dir():
        dataset = datasets.load_from_disk(source)
    else:
        dataset = datasets.load_dataset(source, split="train", streaming=True)
    if isinstance(dataset, dict):  # a DatasetDict: take its train split
        dataset = dataset["train"]
    for i, row in enumerate(dataset):
        if text_field not in row:
            raise ValueError(f"dataset {source!r} has no field {text_field!r} (fields: "
                             f"{sorted(row)}); pass --text_field")
        yield f"{source}:{i}", row[text_field]


def documents(source, root, files, text_field, skipped):
    """Every non-blank document of the corpus as (key, text), in a fixed order."""
    if root is None:
        stream = hf_documents(source, text_field)
    else:
        stream = (doc for path in files for doc in file_documents(path, root, text_field, skipped))
    for key, text in stream:
        if text.strip():
            yield key, text


def is_val(key: str, val_fraction: float) -> bool:
    """A hash of the document's key, not its position, picks the split: adding files to a
    corpus never moves an old document between train and val."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any UTF-8 text encodes losslessly, with no unknown
    token. The 256 byte symbols are seeded so even bytes unseen in training round-trip."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def check_reused_tokenizer(path: str) -> Tokenizer:
    """A --tokenizer must have EOS_TOKEN and be byte-level (token_bytes relies on it)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer {path} does not exist; pass a tokenizer.json, "
                                f"e.g. data/stdlib-32k/tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"--tokenizer {path} has no {EOS_TOKEN!r} token; use a tokenizer "
                         f"written by data.py, or train a new one (omit --tokenizer)")
    byte_symbols = set(pre_tokenizers.ByteLevel.alphabet())
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    if any(set(token) - byte_symbols for token in tokenizer.get_vocab() if token not in added):
        raise ValueError(f"--tokenizer {path} is not a byte-level BPE tokenizer; use one "
                         f"written by data.py, or train a new one (omit --tokenizer)")
    return tokenizer


def vocab_size_of(tokenizer: Tokenizer) -> int:
    # the largest id, not the entry count: an embedding needs a row for every id
    return max(tokenizer.get_vocab().values()) + 1


# ---------------------------------------------------------------------------------------
# Shards: fixed-size files of raw token ids, written atomically.
# ---------------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type holding every id: half the disk and page cache of uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size={vocab_size:,} does not fit uint32 token ids")


def write_atomic(path: Path, payload: bytes):
    """Write to a temporary name, then rename: a reader sees the whole file or none of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


class ShardWriter:
    """Appends one split's documents to `{split}_00000.bin, ...` of shard_tokens ids each."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.pending, self.pending_tokens = [], 0
        self.documents = self.tokens = self.bytes = 0
        self.shards = []

    def add(self, ids: list[int], eos_id: int, text_bytes: int):
        self.pending.append(np.array([eos_id, *ids], dtype=self.dtype))  # EOS opens the document
        self.pending_tokens += len(ids) + 1
        self.documents += 1
        self.tokens += len(ids) + 1
        self.bytes += text_bytes
        while self.pending_tokens >= self.shard_tokens:
            self.flush(self.shard_tokens)

    def flush(self, n: int):
        stream = np.concatenate(self.pending)
        payload = stream[:n].tobytes()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        write_atomic(self.out_dir / name, payload)
        self.shards.append({"file": name, "tokens": n,
                            "sha256": hashlib.sha256(payload).hexdigest()})
        self.pending = [stream[n:]]
        self.pending_tokens -= n

    def finish(self) -> dict:
        if self.pending_tokens:
            self.flush(self.pending_tokens)
        return {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
                "shards": self.shards}


def chunked(docs, max_chars: int):
    """Group documents so that each call to the parallel encoder has plenty of work."""
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc[1])
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def encode_into(tokenizer, docs, writers, val_fraction, eos_id, total_bytes):
    """Encode documents with the library's parallel batch encoder, each to its split."""
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode") as bar:
        for chunk in chunked(docs, ENCODE_CHUNK_CHARS):
            texts = [text for _, text in chunk]
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            for (key, text), encoding in zip(chunk, encodings):
                n_bytes = len(text.encode())
                split = "val" if is_val(key, val_fraction) else "train"
                writers[split].add(encoding.ids, eos_id, n_bytes)
                bar.update(n_bytes)


def prepare(source=None, out_dir=None, vocab_size=32768, tokenizer=None, text_field="text",
            shard_tokens=DEFAULT_SHARD_TOKENS, val_fraction=0.01) -> dict:
    """Tokenize a corpus into out_dir and return its manifest. source None is the built-in
    standard-library corpus; tokenizer is a tokenizer.json to reuse instead of training."""
    start = time.time()
    if source is not None and out_dir is None:
        raise ValueError("prepare: with a --source, also pass --out DIR (the default "
                         "directory names the built-in corpus)")
    out_dir = Path(out_dir or builtin_data_dir(vocab_size))
    if vocab_size < 257 or shard_tokens < 1 or not 0 <= val_fraction < 1:
        raise ValueError(f"prepare: need vocab_size >= 257 (256 bytes + EOS), got {vocab_size}; "
                         f"shard_tokens >= 1, got {shard_tokens}; 0 <= val_fraction < 1, got "
                         f"{val_fraction}")
    root, files = find_source(source)
    reused = check_reused_tokenizer(tokenizer) if tokenizer else None
    source_name = source or f"stdlib:{root}"
    if next(documents(source, root, files, text_field, []), None) is None:
        raise ValueError(f"empty corpus: {source_name} has no readable, non-blank document "
                         f"(files that are not UTF-8 are skipped); check --source and "
                         f"--text_field")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The old manifest goes first: if this run dies, no manifest points at half-new shards.
    (out_dir / MANIFEST).unlink(missing_ok=True)

    if reused is None:
        # trained on the train split only, so val stays unseen text in every sense
        tok = train_tokenizer((text for key, text in documents(source, root, files, text_field, [])
                               if not is_val(key, val_fraction)), vocab_size)
        tokenizer_json = tok.to_str().encode()
    else:
        tok, tokenizer_json = reused, Path(tokenizer).read_bytes()
    write_atomic(out_dir / TOKENIZER_FILE, tokenizer_json)
    tokenizer_s = time.time() - start

    # Document text that spells "<|endoftext|>" must stay text, not forge a boundary.
    tok.encode_special_tokens = True
    eos_id, vocab = tok.token_to_id(EOS_TOKEN), vocab_size_of(tok)
    dtype = token_dtype(vocab)
    writers = {split: ShardWriter(out_dir, split, dtype, shard_tokens)
               for split in ("train", "val")}
    skipped = []
    total_bytes = sum(p.stat().st_size for p in files) if files else None
    encode_into(tok, documents(source, root, files, text_field, skipped), writers,
                val_fraction, eos_id, total_bytes)
    splits = {split: writer.finish() for split, writer in writers.items()}
    if splits["train"]["documents"] == 0:
        raise ValueError(f"the train split of {source_name} is empty: every document went to "
                         f"val; lower val_fraction={val_fraction} or add documents")

    manifest = {"format_version": FORMAT_VERSION, "source": source_name,
                "text_field": text_field, "vocab_size": vocab, "eos_id": eos_id,
                "dtype": dtype.name, "shard_tokens": shard_tokens, "val_fraction": val_fraction,
                "tokenizer": {"file": TOKENIZER_FILE,
                              "sha256": hashlib.sha256(tokenizer_json).hexdigest()},
                "splits": splits, "skipped_files": skipped}
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    print_summary(out_dir, manifest, tokenizer_s, time.time() - start)
    return manifest


def print_summary(out_dir, manifest: dict, tokenizer_s: float, total_s: float):
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    print(f"data: prepared {out_dir} in {total_s:.1f}s (tokenizer {tokenizer_s:.1f}s, encoding "
          f"{total_s - tokenizer_s:.1f}s): {train['documents']:,} train / {val['documents']:,} "
          f"val documents, {train['tokens']:,} train tokens ({train['bytes'] / train['tokens']:.2f}"
          f" bytes/token), vocab {manifest['vocab_size']:,}, {len(manifest['skipped_files'])} "
          f"files skipped (listed in manifest.json)")


# ---------------------------------------------------------------------------------------
# Reading a prepared directory back, with errors that name the file and the fix.
# ---------------------------------------------------------------------------------------

def load_manifest(data_dir) -> dict:
    path = Path(data_dir) / MANIFEST
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist; create it with "
                                f"`{_prepare_hint(data_dir)}`")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (never prepared, or prepare was "
                                f"interrupted); run `{_prepare_hint(data_dir)}`")
    try:
        manifest = json.loads(path.read_text())
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


def token_bytes(data_dir) -> torch.Tensor:
    """(vocab_size,) int64: the UTF-8 bytes each id stands for, 0 for special tokens, so
    bits per byte = sum(loss) / (ln 2 * sum(token_bytes[targets]))."""
    tokenizer = Tokenizer.from_file(tokenizer_path(data_dir))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    sizes = [0] * load_manifest(data_dir)["vocab_size"]
    for token, i in tokenizer.get_vocab().items():
        # byte-level BPE spells every byte as one symbol, so symbols = bytes
        sizes[i] = 0 if i in special else len(token)
    return torch.tensor(sizes, dtype=torch.int64)


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


def verify(data_dir):
    """Check the sha256 of every shard and of the tokenizer against the manifest."""
    manifest = load_manifest(data_dir)
    for split in manifest["splits"]:
        for path, entry in shard_paths(data_dir, manifest, split):
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != entry["sha256"]:
                raise ValueError(f"shard {path} has sha256 {digest[:12]}... but the manifest "
                                 f"records {entry['sha256'][:12]}... (corrupted or replaced); "
                                 f"rerun `{_prepare_hint(data_dir)}`")
    tokenizer_path(data_dir)


# ---------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------

class PackedShardLoader:
    """An endless iterator of packed (B, T) batches for one rank; see the module docstring
    for the window order. state_dict() is the global cursor: it resumes exactly, under any
    world_size or micro_batch_size."""

    def __init__(self, data_dir, split, seq_len, micro_batch_size, rank=0, world_size=1,
                 seed=1337):
        if seq_len < 1 or micro_batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"PackedShardLoader: need seq_len >= 1, micro_batch_size >= 1 and "
                             f"0 <= rank < world_size; got {seq_len}, {micro_batch_size}, "
                             f"rank {rank} of {world_size}")
        self.data_dir, self.split, self.seq_len, self.seed = str(data_dir), split, seq_len, seed
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.manifest = load_manifest(data_dir)
        self.eos_id = self.manifest["eos_id"]
        shards = shard_paths(data_dir, self.manifest, split)
        # plain ndarray views of the maps: slicing the np.memmap subclass costs µs per row
        self.shards = [np.memmap(path, dtype=self.manifest["dtype"], mode="r").view(np.ndarray)
                       for path, _ in shards]
        sizes = [entry["tokens"] for _, entry in shards]
        self.shard_starts = [sum(sizes[:i]) for i in range(len(sizes))]  # stream offsets
        # Identifies the data in state_dict: a cursor means nothing on other tokens.
        self.data_sha256 = hashlib.sha256("".join(e["sha256"] for _, e in shards).encode()) \
            .hexdigest()
        # window i needs tokens up to i*T + T, the last of which is only ever a target
        self.windows_per_epoch = (sum(sizes) - 1) // seq_len
        if self.windows_per_epoch < 1:
            raise ValueError(f"seq_len={seq_len} is longer than split {split!r} of {data_dir}, "
                             f"which has {sum(sizes):,} tokens (a window needs seq_len+1); "
                             f"lower seq_len or prepare a larger corpus")
        self.tokens_per_epoch = self.windows_per_epoch * seq_len
        self.shuffle = split != "val"  # evaluation must see the same tokens every time
        self.cursor = 0  # windows consumed by all ranks together
        self._permutation_epoch, self._permutation = None, None
        self._positions = np.arange(seq_len)

    @property
    def epoch(self) -> int:
        """The epoch of the next window of the global stream."""
        return self.cursor // self.windows_per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch_windows = self.micro_batch_size * self.world_size
        mine = self.cursor + self.rank * self.micro_batch_size  # this rank's block
        windows = self.window_indices(np.arange(mine, mine + self.micro_batch_size))
        self.report_new_epochs(self.cursor, self.cursor + batch_windows)
        self.cursor += batch_windows
        return self.batch(windows)

    def window_indices(self, global_positions: np.ndarray) -> np.ndarray:
        """Global stream position k -> window index: perm_{k // N}[k % N]."""
        n = self.windows_per_epoch
        if not self.shuffle:
            return global_positions % n
        windows = np.empty_like(global_positions)
        epochs = global_positions // n
        for epoch in np.unique(epochs):  # usually one; several if a batch outgrows an epoch
            at = epochs == epoch
            windows[at] = self.permutation(int(epoch))[global_positions[at] % n]
        return windows

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._permutation_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._permutation_epoch = epoch
            self._permutation = rng.permutation(self.windows_per_epoch)
        return self._permutation

    def report_new_epochs(self, begin: int, end: int):
        """Announce each epoch whose first window lies in global positions [begin, end).
        Rank 0 speaks for all; val is exempt, as evaluation rereads it by design."""
        if self.rank != 0 or not self.shuffle:
            return
        n = self.windows_per_epoch
        for epoch in range(max(1, -(-begin // n)), (end - 1) // n + 1):
            print(f"data: {self.split} epoch {epoch} begins", flush=True)

    def read(self, start: int, out: np.ndarray):
        """Copy stream tokens [start, start + len(out)) into out, across shard boundaries."""
        shard = bisect.bisect_right(self.shard_starts, start) - 1
        filled = 0
        while filled < len(out):
            offset = start + filled - self.shard_starts[shard]
            piece = self.shards[shard][offset:offset + len(out) - filled]
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            shard += 1

    def batch(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        T = self.seq_len
        tokens = np.empty((len(windows), T + 1), dtype=self.shards[0].dtype)  # (B, T+1)
        for row, window in zip(tokens, windows):
            self.read(int(window) * T, row)
        inputs = tokens[:, :-1]  # (B, T)
        starts = inputs == self.eos_id  # an EOS opens the document that follows it
        starts[:, 0] = False  # the row's first segment is document 0, whatever opens it
        seq_ids = np.cumsum(starts, axis=1, dtype=np.int64)  # (B, T)
        # position = t - (latest segment start at or before t), computed in place: fresh
        # (B, T) int64 arrays cost more in page faults than the arithmetic does
        position_ids = np.multiply(starts, self._positions, dtype=np.int64)  # start t, else 0
        np.maximum.accumulate(position_ids, axis=1, out=position_ids)
        np.subtract(self._positions, position_ids, out=position_ids)  # (B, T)
        return {"input_ids": torch.from_numpy(inputs.astype(np.int64)),
                "targets": torch.from_numpy(tokens[:, 1:].astype(np.int64)),
                "position_ids": torch.from_numpy(position_ids),
                "seq_ids": torch.from_numpy(seq_ids)}

    def state_dict(self) -> dict:
        return {"split": self.split, "cursor": self.cursor, "seed": self.seed,
                "seq_len": self.seq_len, "windows_per_epoch": self.windows_per_epoch,
                "data_sha256": self.data_sha256, "epoch": self.epoch}

    def load_state_dict(self, state: dict):
        """Resume at a saved cursor. The stream is only the same if the data, split, seq_len
        and seed are, so any difference is an error rather than silently other windows."""
        mine = self.state_dict()
        for key in ("split", "seq_len", "seed", "data_sha256"):
            if state[key] != mine[key]:
                raise ValueError(f"loader state was saved with {key}={state[key]!r}, this loader "
                                 f"has {mine[key]!r}; resume with the same data_dir, split, "
                                 f"seq_len and seed, or start the data stream afresh")
        self.cursor = int(state["cursor"])


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Prepare token shards for stacklm (default: the Python standard "
                    "library's .py files, no download), or verify a prepared directory.")
    parser.add_argument("--source", help="a directory of text files, a file (.txt, .jsonl or "
                        "other text), a quoted glob, or a Hugging Face dataset name or "
                        "save_to_disk directory (needs `datasets`); default: built-in corpus")
    parser.add_argument("--out", help="output directory (default for the built-in corpus: "
                        "data/stdlib-<vocab_size/1024>k)")
    parser.add_argument("--vocab_size", type=int, default=32768,
                        help="BPE vocabulary size to train, including EOS (default 32768)")
    parser.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one, "
                        "so corpora share a vocabulary")
    parser.add_argument("--text_field", default="text",
                        help="field holding the text in .jsonl lines and datasets")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--val_fraction", type=float, default=0.01,
                        help="share of documents, picked by a hash of their name, for val")
    parser.add_argument("--verify", metavar="DIR",
                        help="check the sha256 of DIR's shards and tokenizer, then exit")
    args = parser.parse_args(argv)
    if args.verify:
        verify(args.verify)
        print(f"data: {args.verify} verified: every shard and the tokenizer match manifest.json")
        return
    prepare(args.source, args.out, args.vocab_size, args.tokenizer, args.text_field,
            args.shard_tokens, args.val_fraction)


if __name__ == "__main__":
    main()
