"""Prepare: corpus -> byte-level BPE tokenizer -> packed token shards, once, offline.

    python prepare.py                                  # the built-in corpus -> data/stdlib-32k
    python prepare.py --source "corpus/*.txt" --out data/mycorpus
    python prepare.py --verify data/mycorpus           # sha256 of every shard and the tokenizer

A bad argument (a missing --source, an --out that is a file, a --verify directory that was
never prepared) is one line on stderr and exit status 2; --debug shows the traceback.

It writes the format data.py reads, into one directory per corpus:

    data/<name>/tokenizer.json      byte-level BPE with one special token, EOS_TOKEN
    data/<name>/train_00000.bin ... raw token ids, uint16 (uint32 if the vocab needs it)
    data/<name>/val_00000.bin ...
    data/<name>/manifest.json       counts, shard list with sha256, tokenizer hash, dtype

Each split is one stream of token ids with EOS written before every document; a hash of
each document's name picks its split; the tokenizer is trained on the train split only.
The manifest is written last, so an interrupted run leaves a directory that data.py refuses.

This file imports only data.py, and only for the format it writes: the EOS token, the file
names, the format version, the token dtype rule and the --verify check.
"""

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from config import user_errors
from data import EOS_TOKEN, FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, token_dtype, verify

DEFAULT_SHARD_TOKENS = 2**26  # 128 MiB of uint16 per file
ENCODE_CHUNK_CHARS = 4 << 20  # text handed to the parallel encoder at once
TEXT_SUFFIXES = {".txt", ".jsonl", ".json", ".py", ".md"}  # a --source with one is a path


# ---------------------------------------------------------------------------------------
# The pipeline: sources -> tokenizer -> shards, then the manifest that vouches for them.
# ---------------------------------------------------------------------------------------

def prepare(source=None, out_dir=None, vocab_size=32768, tokenizer=None, text_field="text",
            shard_tokens=DEFAULT_SHARD_TOKENS, val_fraction=0.01) -> dict:
    """Tokenize a corpus into out_dir and return its manifest. source None is the built-in
    standard-library corpus; tokenizer is a tokenizer.json to reuse instead of training."""
    start = time.time()
    if source is not None and out_dir is None:
        raise ValueError("prepare: with a --source, also pass --out DIR (the default "
                         "directory names the built-in corpus)")
    out_dir = Path(out_dir or builtin_data_dir(vocab_size))
    check_out_dir(out_dir)
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


def check_out_dir(out_dir: Path):
    """Fail before any work when out_dir cannot be a directory: it, or a parent, is a file."""
    for path in (out_dir, *out_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise NotADirectoryError(f"--out {out_dir}: {path} is a file, not a directory; "
                                         f"pass a directory path (created if missing)")
            return


def print_summary(out_dir, manifest: dict, tokenizer_s: float, total_s: float):
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    print(f"data: prepared {out_dir} in {total_s:.1f}s (tokenizer {tokenizer_s:.1f}s, encoding "
          f"{total_s - tokenizer_s:.1f}s): {train['documents']:,} train / {val['documents']:,} "
          f"val documents, {train['tokens']:,} train tokens ({train['bytes'] / train['tokens']:.2f}"
          f" bytes/token), vocab {manifest['vocab_size']:,}, {len(manifest['skipped_files'])} "
          f"files skipped (listed in manifest.json)")


# ---------------------------------------------------------------------------------------
# Sources: which documents a corpus holds, in a deterministic order.
# ---------------------------------------------------------------------------------------

def builtin_data_dir(vocab_size: int) -> str:
    """Where `python prepare.py --vocab_size N` puts the built-in corpus, e.g. data/stdlib-4k."""
    return f"data/stdlib-{vocab_size // 1024}k"


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
    if not path.exists() and looks_local(source):
        raise FileNotFoundError(f"--source {source}: no such file or directory; pass a "
                                f"directory of text files, a file, a quoted glob, or a Hugging "
                                f"Face dataset name such as org/name")
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--source {source!r} is not a file, directory or glob match, so it "
                         f"would be read as a Hugging Face dataset, but the optional `datasets` "
                         f"package is not installed; `pip install datasets` or fix the path")
    return None, []


def looks_local(source: str) -> bool:
    """A path, not a hub name: hub names are `name` or `org/name`, never absolute, never
    starting with . or ~, never with a backslash, two slashes or a text file's suffix."""
    return (Path(source).is_absolute() or source.startswith((".", "~")) or "\\" in source
            or source.count("/") > 1 or Path(source).suffix in TEXT_SUFFIXES)


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
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())  # no bars in a log
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
                         f"written by prepare.py, or train a new one (omit --tokenizer)")
    byte_symbols = set(pre_tokenizers.ByteLevel.alphabet())
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    if any(set(token) - byte_symbols for token in tokenizer.get_vocab() if token not in added):
        raise ValueError(f"--tokenizer {path} is not a byte-level BPE tokenizer; use one "
                         f"written by prepare.py, or train a new one (omit --tokenizer)")
    return tokenizer


def vocab_size_of(tokenizer: Tokenizer) -> int:
    # the largest id, not the entry count: an embedding needs a row for every id
    return max(tokenizer.get_vocab().values()) + 1


# ---------------------------------------------------------------------------------------
# Shards: fixed-size files of raw token ids, written atomically.
# ---------------------------------------------------------------------------------------

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
    # The bar only on a terminal: redirected to a log, its carriage returns are noise.
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode",
              disable=not sys.stderr.isatty()) as bar:
        for chunk in chunked(docs, ENCODE_CHUNK_CHARS):
            texts = [text for _, text in chunk]
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            for (key, text), encoding in zip(chunk, encodings, strict=True):
                n_bytes = len(text.encode())
                split = "val" if is_val(key, val_fraction) else "train"
                writers[split].add(encoding.ids, eos_id, n_bytes)
                bar.update(n_bytes)


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
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its message")
    args = parser.parse_args(argv)
    with user_errors(args.debug):  # a bad path or value: one line, no traceback
        if args.verify:
            verify(args.verify)
            print(f"data: {args.verify} verified: every shard and the tokenizer match "
                  f"manifest.json")
            return
        prepare(args.source, args.out, args.vocab_size, args.tokenizer, args.text_field,
                args.shard_tokens, args.val_fraction)


if __name__ == "__main__":
    main()
