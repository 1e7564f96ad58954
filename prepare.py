"""Prepare: corpus -> byte-level BPE tokenizer -> packed token shards, once, offline.

    python prepare.py                                  # the built-in corpus -> data/stdlib-32k
    python prepare.py --source "data/raw/corpus/*.txt" --data_dir data/mycorpus
    python prepare.py --source "data/raw/shards/*.parquet" --data_dir data/shards  # pyarrow
    python prepare.py --source HuggingFaceFW/fineweb-edu --subset sample-10BT \
        --max_tokens 2_000_000_000 --data_dir data/fwe # a bounded slice of a streamed dataset
    python prepare.py --verify data/mycorpus           # sha256 of every shard and the tokenizer

A bad argument (a missing --source, a --data_dir that is a file, a --verify directory that was
never prepared) is one line on stderr and exit status 2; --debug shows the traceback.

It writes the format data.py reads, into one directory per corpus:

    data/<name>/tokenizer.json      byte-level BPE with one special token, EOS_TOKEN (or a
                                    --tokenizer reused, with its own end-of-text token)
    data/<name>/train_00000.bin ... raw token ids, uint16 (uint32 if the vocab needs it)
    data/<name>/val_00000.bin ...
    data/<name>/manifest.json       counts, shard list with sha256, tokenizer hash, dtype
    data/<name>/val_documents.json  the keys of the val split's documents, in stream order

Each split is one stream of token ids with EOS written before every document; a hash of
each document's name picks its split; the tokenizer is trained on the train split only.

Bounded. Memory does not grow with the corpus: sources are streamed (a .jsonl or .txt file
line by line or in pieces, a .parquet file a batch of rows of its text column at a time, a
Hugging Face dataset row by row), the tokenizer is trained on the first `tokenizer_chars`
characters of the train split (nanochat's bounded sample), and `max_tokens` stops a source
after that many training tokens. Encoding runs the library's parallel batch encoder on
several chunks at once while this thread reads the next documents and writes shards, so no
core waits for the others' tail.

Safe. Everything is written into `<out>.tmp` and renamed to `<out>` when complete, so an
interrupted run leaves no directory that data.py would read, and a prepared directory (or
the source folder itself) is never written into: a rerun there is refused.

Imports from stacklm: data (the EOS token), shards (the format it writes: the file names,
the format version, the token dtype rule; and the --verify check), cli (the one-line
errors) and checkpoint (set_aside: a built-in corpus it cannot use is renamed, as a damaged
checkpoint is).
"""

import collections
import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from data import EOS_TOKEN
from plumbing.checkpoint import set_aside
from plumbing.cli import ArgumentParser, user_errors
from plumbing.shards import (FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, VAL_KEYS_FILE, token_dtype,
                             verify)

DEFAULT_SHARD_TOKENS = 2**26  # 128 MiB of uint16 per file
DEFAULT_VAL_FRACTION = 0.01  # the built-in corpus's too (builtin_val_documents relies on it)
# The tokenizer's training sample, in characters. nanochat trains on 2B; 1B keeps the
# trainer's word counts within a few GB. It exceeds the built-in corpus (~31.5M), so the
# built-in data, and every figure measured on it, is trained on all of its train split.
DEFAULT_TOKENIZER_CHARS = 1_000_000_000
ENCODE_CHUNK_CHARS = 4 << 20  # text handed to the parallel encoder at once
# Chunks being encoded at once: while one finishes its longest documents, the next keeps the
# other cores busy. Each holds ~4M characters and their encodings: memory stays bounded.
ENCODE_CHUNKS_IN_FLIGHT = 3
READ_CHARS = 1 << 20  # a .txt file is read and split this much at a time
# A .parquet file's text column is read a row group at a time and handed on this many rows
# at a time, as Python strings.
PARQUET_BATCH_ROWS = 1024
# A --source with one of these suffixes is a file path, never a hub name.
LOCAL_SUFFIXES = {".txt", ".jsonl", ".json", ".parquet", ".py", ".md"}


# ---------------------------------------------------------------------------------------
# The pipeline: sources -> tokenizer -> shards, then the manifest that vouches for them.
# ---------------------------------------------------------------------------------------

def prepare(source=None, out_dir=None, vocab_size=32768, tokenizer=None, text_field="text",
            shard_tokens=DEFAULT_SHARD_TOKENS, val_fraction=DEFAULT_VAL_FRACTION, max_tokens=None,
            tokenizer_chars=DEFAULT_TOKENIZER_CHARS, subset=None, split="train") -> dict:
    """Tokenize a corpus into out_dir and return its manifest. source None is the built-in
    standard-library corpus; tokenizer is a tokenizer.json to reuse instead of training;
    subset and split name a Hugging Face dataset's configuration and split; max_tokens stops
    after that many train tokens (whole documents); tokenizer_chars bounds the tokenizer's
    training sample."""
    start = time.time()
    if source is not None and out_dir is None:
        raise ValueError("prepare: with a --source, also pass --data_dir DIR (the default "
                         "directory names the built-in corpus)")
    out_dir = Path(out_dir or builtin_data_dir(vocab_size))
    check_numbers(vocab_size, shard_tokens, val_fraction, max_tokens, tokenizer_chars)
    root, files = find_source(source)
    check_parquet(files, text_field)
    check_out_dir(out_dir, Path(source) if source and Path(source).is_dir() else None)
    # (tokenizer, separator, the file's bytes)
    reused = check_reused_tokenizer(tokenizer) if tokenizer else None
    source_name = source or f"stdlib:{root}"
    corpus = Corpus(source, root, files, text_field, subset, split)
    skipped = []
    if next(corpus.documents(skipped), None) is None:
        raise ValueError(empty_corpus(source_name, skipped))
    with building(out_dir) as build:
        manifest, tokenizer_s = write_dataset(build, corpus, source_name, vocab_size, reused,
                                              shard_tokens, val_fraction, max_tokens,
                                              tokenizer_chars)
    print_summary(out_dir, manifest, tokenizer_s, time.time() - start,
                  asked=None if reused else vocab_size)
    return manifest


@contextlib.contextmanager
def building(out_dir: Path):
    """A fresh `<out_dir>.tmp` to write into, renamed to out_dir when the block completes
    and removed if it fails; what a killed run left there is cleared first."""
    build = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    try:
        yield build
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    if out_dir.is_dir():
        out_dir.rmdir()  # check_out_dir let it through only empty
    build.rename(out_dir)


def write_dataset(build: Path, corpus, source_name, vocab_size, reused, shard_tokens,
                  val_fraction, max_tokens, tokenizer_chars) -> tuple[dict, float]:
    """Tokenizer, shards and, last, the manifest that vouches for them, into `build`;
    returns the manifest and the seconds the tokenizer took."""
    start = time.time()
    if reused is None:
        # trained on the train split only, so val stays unseen text in every sense
        tok = train_tokenizer(sample(corpus, val_fraction, tokenizer_chars), vocab_size)
        tokenizer_json, separator = tok.to_str().encode(), EOS_TOKEN
    else:
        tok, separator, tokenizer_json = reused
    write_atomic(build / TOKENIZER_FILE, tokenizer_json)
    tokenizer_s = time.time() - start

    # Document text that spells a special token ("<|endoftext|>") must stay text, not forge
    # a boundary.
    tok.encode_special_tokens = True
    eos_id, vocab = tok.token_to_id(separator), vocab_size_of(tok)
    dtype = token_dtype(vocab)
    writers = {name: ShardWriter(build, name, dtype, shard_tokens) for name in ("train", "val")}
    skipped = []
    total_bytes = sum(text_bytes(p, corpus.text_field) for p in corpus.files) or None
    first_train_key = encode_into(tok, corpus.documents(skipped), writers, val_fraction, eos_id,
                                  total_bytes, max_tokens)
    splits = {name: writer.finish() for name, writer in writers.items()}
    check_splits(splits, source_name, val_fraction, first_train_key)
    manifest = {"format_version": FORMAT_VERSION, "source": source_name,
                "text_field": corpus.text_field, "subset": corpus.subset, "split": corpus.split,
                "vocab_size": vocab, "eos_id": eos_id, "eos_token": separator,
                "dtype": dtype.name,
                "shard_tokens": shard_tokens, "val_fraction": val_fraction,
                "max_tokens": max_tokens, "tokenizer_chars": tokenizer_chars,
                "tokenizer": {"file": TOKENIZER_FILE,
                              "sha256": hashlib.sha256(tokenizer_json).hexdigest()},
                "splits": splits, "skipped_files": skipped}
    write_atomic(build / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest, tokenizer_s


def empty_corpus(source_name: str, skipped: list[dict]) -> str:
    """Why a source gave no document: what was skipped, the first reason said (a damaged
    file's own error, on one line), or else that every document was blank."""
    if not skipped:
        return (f"empty corpus: every document of {source_name} is blank; check --source and "
                f"--text_field")
    more = f", and {len(skipped) - 1:,} more" if len(skipped) > 1 else ""
    reason = " ".join(skipped[0]["reason"].split())
    return (f"empty corpus: {source_name} has no readable, non-blank document (skipped "
            f"{skipped[0]['file']}: {reason}{more}); replace what cannot be read, or check "
            f"--source and --text_field")


def check_numbers(vocab_size, shard_tokens, val_fraction, max_tokens, tokenizer_chars):
    """Refuse impossible settings before any work, naming the flag."""
    problems = [f"--vocab_size must be >= 257 (256 bytes + EOS), got {vocab_size}"
                if vocab_size < 257 else None,
                f"--shard_tokens must be >= 1, got {shard_tokens}" if shard_tokens < 1 else None,
                f"--val_fraction must be in [0, 1), got {val_fraction}"
                if not 0 <= val_fraction < 1 else None,
                f"--max_tokens must be >= 1, got {max_tokens}"
                if max_tokens is not None and max_tokens < 1 else None,
                f"--tokenizer_chars must be >= 1, got {tokenizer_chars}"
                if tokenizer_chars < 1 else None]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"prepare: {'; '.join(problems)}")


def check_splits(splits: dict, source_name: str, val_fraction: float, first_train_key):
    """A split that came out empty is refused, naming the --val_fraction that fixes it
    (val_fraction=0 asks for no val split: said, not refused)."""
    if splits["train"]["documents"] == 0:
        raise ValueError(f"the train split of {source_name} is empty: every document went to "
                         f"val; lower --val_fraction={val_fraction} or add documents")
    if splits["val"]["documents"] == 0 and val_fraction > 0:
        # the train document whose hash is lowest is the first that a larger fraction moves
        needed = val_point(first_train_key) * 1.01
        raise ValueError(f"the val split of {source_name} is empty: none of its "
                         f"{splits['train']['documents']:,} documents hashed into "
                         f"--val_fraction={val_fraction}, and train.py evaluates on val; pass "
                         f"--val_fraction={needed:.3g} or more (that moves at least one "
                         f"document), or add documents")
    if val_fraction == 0:
        print("data: warning: --val_fraction=0 makes no val split; train.py trains on such a "
              "directory without evaluating it, so use it as a mixture's extra source beside "
              "one that has a val split")


def check_out_dir(out_dir: Path, source_dir: Path | None):
    """Fail before any work when out_dir cannot become a fresh prepared directory: it, or a
    parent, is a file; it already holds files (a prepared dataset, or anything else); or it
    lies inside `source_dir` (a folder --source), where a rerun would read its own shards as
    text."""
    for path in (out_dir, *out_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise NotADirectoryError(f"--data_dir {out_dir}: {path} is a file, not a "
                                         f"directory; pass a directory path (created if "
                                         f"missing)")
            break
    if source_dir and out_dir.resolve().is_relative_to(source_dir.resolve()):
        raise ValueError(f"--data_dir {out_dir} is, or lies inside, the source folder "
                         f"{source_dir}: its shards and tokenizer would become part of the "
                         f"corpus on a rerun; pass a --data_dir outside {source_dir}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        what = ("a prepared dataset (manifest.json)" if (out_dir / MANIFEST).exists()
                else "files")
        raise ValueError(f"--data_dir {out_dir} already holds {what}; nothing was changed. Pass a "
                         f"new --data_dir, or delete {out_dir} first to prepare it again")


def print_summary(out_dir, manifest: dict, tokenizer_s: float, total_s: float,
                  asked: int | None):
    """One line: what was prepared, how fast, and the vocabulary reached, beside the one
    `asked` for where the tokenizer's training text (the train split, up to tokenizer_chars)
    ran out of pairs to merge before reaching it."""
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    vocab = f"vocab {manifest['vocab_size']:,}"
    if asked and manifest["vocab_size"] < asked:
        vocab += f" (asked for {asked:,}: the tokenizer's training text has no more merges)"
    print(f"data: prepared {out_dir} in {total_s:.1f}s (tokenizer {tokenizer_s:.1f}s, encoding "
          f"{total_s - tokenizer_s:.1f}s): {train['documents']:,} train / {val['documents']:,} "
          f"val documents, {train['tokens']:,} train tokens ({train['bytes'] / train['tokens']:.2f}"
          f" bytes/token), {vocab}, {len(manifest['skipped_files'])} files skipped (listed in "
          f"manifest.json)")


# ---------------------------------------------------------------------------------------
# Sources: which documents a corpus holds, in a deterministic order.
# ---------------------------------------------------------------------------------------

def builtin_data_dir(vocab_size: int) -> str:
    """Where `python prepare.py --vocab_size N` puts the built-in corpus, e.g. data/stdlib-4k."""
    return f"data/stdlib-{vocab_size // 1024}k"


def ensure_builtin(sources: list[str], vocab_size: int):
    """Prepare the built-in corpus, if a run reads it and it is not there. This program made
    that folder itself, so a copy it cannot use is moved aside, never deleted, and the
    corpus prepared again: one without manifest.json (a preparation killed before its
    rename, or files put there by hand), or one an older stacklm prepared without
    val_documents.json (the same shards come out: its checkpoints resume)."""
    builtin = Path(builtin_data_dir(vocab_size))
    if str(builtin) not in sources or (builtin / VAL_KEYS_FILE).exists():
        return
    if not builtin.exists():
        print(f"data: {builtin} is missing; preparing the built-in corpus (the Python standard "
              f"library) with a {vocab_size:,}-token vocabulary")
    elif not (builtin / MANIFEST).exists():
        print(f"data: {builtin} has no {MANIFEST}, so it is not a prepared corpus (an "
              f"interrupted preparation?); moved it to {set_aside(builtin, 'incomplete')} and "
              f"preparing it again")
    else:
        print(f"data: {builtin} was prepared by an older stacklm (no {VAL_KEYS_FILE}); moved it "
              f"to {set_aside(builtin, 'old')} and preparing it again")
    prepare(out_dir=str(builtin), vocab_size=vocab_size)


def builtin_val_documents() -> list[str]:
    """The built-in corpus's val documents, in stream order, read from the standard library
    itself: the texts the val_documents.json of every data/stdlib-* directory lists (a hash
    of each file's name picks the split, whatever the vocabulary), with nothing prepared."""
    root, files = stdlib_files()
    val = [p for p in files if is_val(p.relative_to(root).as_posix(), DEFAULT_VAL_FRACTION)]
    return [text for _, text in Corpus(None, root, val, "text").documents([])]


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
    if path.is_dir() and not is_saved_dataset(path):
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


def is_saved_dataset(path: Path) -> bool:
    """A Hugging Face `save_to_disk` folder: one of these two files marks it."""
    return (path / "state.json").exists() or (path / "dataset_dict.json").exists()


def source_root(source: str) -> Path | None:
    """The folder a prepared local source's document keys are relative to (find_source's
    root; the built-in corpus's, from its `stdlib:ROOT`), found again where the source is;
    None where nothing of it is there now."""
    if source.startswith("stdlib:"):
        root = Path(source.removeprefix("stdlib:"))
        return root if root.is_dir() else None
    try:
        root, files = find_source(source)
    except (OSError, ValueError):
        return None
    return root if files else None


def from_dataset(source: str, keys: list[str]) -> bool:
    """Whether a corpus prepared from `source`, whose documents have these keys, came from a
    Hugging Face dataset (hf_documents' keys are SOURCE:N), not from local files (keys are
    paths under the source's folder), even where the source is no longer there."""
    if is_saved_dataset(Path(source)):
        return True
    if Path(source).exists() or looks_local(source) or any(c in source for c in "*?["):
        return False
    return bool(keys) and all(key.rpartition(":")[0] == source for key in keys)


def looks_local(source: str) -> bool:
    """A path, not a hub name: hub names are `name` or `org/name`, never absolute, never
    starting with . or ~, never with a backslash, two slashes or a text file's suffix."""
    return (Path(source).is_absolute() or source.startswith((".", "~")) or "\\" in source
            or source.count("/") > 1 or Path(source).suffix in LOCAL_SUFFIXES)


def check_parquet(files: list[Path], text_field: str):
    """A source's .parquet files, checked before any work from their footers alone: pyarrow
    is optional, as `datasets` is, so it may need installing; and every file must hold a
    text column text_field (in a folder of shards, a file without it means --text_field is
    wrong for the source). A footer pyarrow cannot read is left to the encode, which skips
    that file and lists it."""
    shards = [p for p in files if p.suffix == ".parquet"]
    if shards and importlib.util.find_spec("pyarrow") is None:
        raise ValueError("--source holds .parquet files, and reading them needs the optional "
                         "`pyarrow` package, which is not installed; `pip install pyarrow`")
    for path in shards:
        footer = parquet_footer(path)
        if footer is None:
            continue  # unreadable: the encode skips the file and lists it
        schema = footer.schema.to_arrow_schema()
        if not (text_field in schema.names and is_text(schema.field(text_field).type)):
            columns = ", ".join(f"{field.name} ({field.type})" for field in schema)
            raise ValueError(f"{path} has no text column {text_field!r} (its columns: "
                             f"{columns}); pass --text_field naming the column of documents")


def parquet_footer(path: Path):
    """The file's footer (its columns and row groups), or None where pyarrow cannot read it."""
    import pyarrow
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_metadata(path)
    except (OSError, pyarrow.ArrowException):
        return None


@dataclass(frozen=True)
class Corpus:
    """What --source names, resolved: local files under `root`, or (root None) a Hugging
    Face dataset with its subset and split."""
    source: str | None
    root: Path | None
    files: list[Path]
    text_field: str
    subset: str | None = None
    split: str = "train"

    def documents(self, skipped: list):
        """Every non-blank document as (key, text), in a fixed order, streamed; what cannot
        be read is recorded in `skipped`."""
        if self.root is None:
            stream = hf_documents(self.source, self.text_field, self.subset, self.split, skipped)
        else:
            stream = (doc for path in self.files
                      for doc in file_documents(path, self.root, self.text_field, skipped))
        for key, text in stream:
            if text.strip():
                yield key, text


def file_documents(path: Path, root: Path, text_field: str, skipped: list):
    """Yield (key, text) for one file: a .jsonl holds one document per line (in text_field),
    a .parquet one per row (in its column text_field), a .txt documents separated by
    EOS_TOKEN, any other file is one document. The first three are streamed, so a file
    larger than memory is fine. Unreadable or non-UTF-8 input is recorded in `skipped`, not
    fatal (in a .txt, from the bad byte on)."""
    key = path.relative_to(root).as_posix()
    try:
        if path.suffix == ".jsonl":
            yield from jsonl_documents(path, key, text_field, skipped)
        elif path.suffix == ".parquet":
            yield from parquet_documents(path, key, text_field, skipped)
        elif path.suffix == ".txt":
            yield from txt_documents(path, key)
        else:
            yield key, path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        skipped.append({"file": str(path), "reason": f"{type(e).__name__}: {e}"})


def key_file(key: str) -> str:
    """The file a document's key names: `FILE:N` is the N-th document of a .txt, .jsonl or
    .parquet file (file_documents' keys), any other key a whole file."""
    name, _, n = key.rpartition(":")
    return name if n.isdigit() and Path(name).suffix in (".txt", ".jsonl", ".parquet") else key


def jsonl_documents(path: Path, key: str, text_field: str, skipped: list):
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            try:
                document = json.loads(line)[text_field] if line.strip() else ""
            except (ValueError, KeyError, TypeError):  # bad JSON or UTF-8, no such field
                document = None
            if not isinstance(document, str):
                skipped.append({"file": f"{path}:{line_number}",
                                "reason": f"not a JSON object with a string {text_field!r}"})
                continue
            yield f"{key}:{line_number}", document


def parquet_documents(path: Path, key: str, text_field: str, skipped: list):
    """Row N (from 0, across the file's row groups) is document `key:N`. Only the text
    column is read (check_parquet made sure there is one), a row group at a time, and
    handed on PARQUET_BATCH_ROWS rows at a time: memory holds the larger of one group and
    one batch, never the file's column. What pyarrow cannot read is skipped and recorded:
    a file whose footer it cannot read, whole; a damaged row group, from the first row not
    yet read to the group's end (the footer says where each group starts, so the rows of
    the groups after it keep their numbers); and a null row."""
    import pyarrow  # optional: check_parquet refused a parquet source without it
    import pyarrow.parquet

    try:
        # pre_buffer (pyarrow's default) would read the whole file's column before row 0
        parquet = pyarrow.parquet.ParquetFile(path, pre_buffer=False)
    except pyarrow.ArrowException as e:
        skipped.append({"file": str(path), "reason": f"{type(e).__name__}: {e}"})
        return
    with parquet:
        first = 0  # the file's row number of the group's first row
        for group in range(parquet.num_row_groups):
            yield from row_group_documents(parquet, group, first, path, key, text_field,
                                           skipped)
            first += parquet.metadata.row_group(group).num_rows


def row_group_documents(parquet, group: int, first: int, path: Path, key: str,
                        text_field: str, skipped: list):
    """One row group's documents (parquet_documents), its rows numbered from `first`."""
    import pyarrow

    row, end = first, first + parquet.metadata.row_group(group).num_rows
    try:
        for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group],
                                          columns=[text_field]):
            for document in batch.column(0).to_pylist():
                if document is None:
                    skipped.append({"file": f"{path}:{row}", "reason": f"{text_field!r} is null"})
                else:
                    yield f"{key}:{row}", document
                row += 1
    except (OSError, pyarrow.ArrowException) as e:  # a damaged page: pyarrow raises either
        skipped.append({"file": f"{path}:{row}-{end - 1}",
                        "reason": f"row group {group} cannot be read from row {row} on "
                                  f"({type(e).__name__}: {e})"})


def text_bytes(path: Path, text_field: str) -> int:
    """About how many bytes of text a file holds, for the encode's progress bar: its size
    on disk, or a parquet file's text column uncompressed (from its footer; parquet files
    are compressed, and their size would send the bar past 100%)."""
    footer = parquet_footer(path) if path.suffix == ".parquet" else None
    if footer is None:  # not parquet, or unreadable (skipped when the corpus is read)
        return path.stat().st_size
    return sum(column.total_uncompressed_size for g in range(footer.num_row_groups)
               for column in map(footer.row_group(g).column, range(footer.num_columns))
               if column.path_in_schema == text_field)


def is_text(arrow_type) -> bool:
    """An arrow string column, in any of its three layouts."""
    from pyarrow import types

    return types.is_string(arrow_type) or types.is_large_string(arrow_type) or \
        types.is_string_view(arrow_type)


def txt_documents(path: Path, key: str):
    """Documents separated by EOS_TOKEN, read READ_CHARS at a time (newline="" keeps the
    file's line endings as they are)."""
    with open(path, encoding="utf-8", newline="") as f:
        i, tail = 0, ""
        while piece := f.read(READ_CHARS):
            *documents, tail = (tail + piece).split(EOS_TOKEN)
            for document in documents:
                yield f"{key}:{i}", document
                i += 1
        yield f"{key}:{i}", tail


def hf_documents(source: str, text_field: str, subset: str | None, split: str,
                 skipped: list):
    """Yield (key, text) from a Hugging Face dataset: a directory written by `save_to_disk`,
    or a hub name with its subset (`load_dataset`'s `name`) and split, streamed so a large
    corpus is never held in memory. The rule of a parquet source: a null row is skipped
    and recorded in `skipped`; a field that is not text is refused before any work, from
    the dataset's features (or at its first row, where a stream does not declare them)."""
    import datasets  # optional: only this source kind needs it

    if Path(source).is_dir():
        dataset = datasets.load_from_disk(source)
        if subset:
            raise ValueError(f"--subset {subset}: {source} is a save_to_disk folder, and only "
                             f"a hub dataset has subsets; drop --subset")
        if isinstance(dataset, dict):  # a DatasetDict: take the split asked for
            if split not in dataset:
                raise ValueError(f"dataset {source} has no split {split!r} (it has "
                                 f"{sorted(dataset)}); pass --split")
            dataset = dataset[split]
        elif split != "train":  # the default: a Dataset is read whole
            raise ValueError(f"--split {split}: {source} holds one Dataset, not a DatasetDict "
                             f"of splits; drop --split")
    else:
        dataset = datasets.load_dataset(source, name=subset, split=split, streaming=True)
    if dataset.features is not None:
        check_text_field(source, text_field, dataset.features)
    for i, row in enumerate(dataset):
        text = row.get(text_field)
        if text_field not in row or not isinstance(text, (str, type(None))):
            check_text_field(source, text_field, {name: type(value).__name__
                                                  for name, value in row.items()})
        if text is None:
            skipped.append({"file": f"{source}:{i}", "reason": f"{text_field!r} is null"})
            continue
        yield f"{source}:{i}", text


def check_text_field(source: str, text_field: str, features: dict):
    """A dataset's text_field must be a string column, as a parquet file's must: refused,
    naming the fields and their types, where it is not. `features` maps each field to its
    datasets feature (a Value's dtype is "string" for text) or a row value's type name."""
    kinds = {name: getattr(feature, "dtype", feature) for name, feature in features.items()}
    if kinds.get(text_field) not in ("string", "large_string"):
        fields = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
        raise ValueError(f"dataset {source} has no text field {text_field!r} (its fields: "
                         f"{fields}); pass --text_field naming the field of documents")


def val_point(key: str) -> float:
    """Where a document's key hashes to in [0, 1): below val_fraction, it is a val document.
    A hash of the key, not the position, picks the split: adding files to a corpus never
    moves an old document between train and val."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def is_val(key: str, val_fraction: float) -> bool:
    return val_point(key) < val_fraction


def sample(corpus: Corpus, val_fraction: float, max_chars: int):
    """The tokenizer's training text: train documents in corpus order until max_chars."""
    chars = 0
    for key, text in corpus.documents([]):
        if chars >= max_chars:
            return
        if not is_val(key, val_fraction):
            yield text
            chars += len(text)


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


def check_reused_tokenizer(path: str) -> tuple[Tokenizer, str, bytes]:
    """A --tokenizer must be a tokenizer.json (`read_tokenizer`), byte-level (token_bytes
    relies on it) and name its document separator (`separator_token`); returns it, that
    token and the file's bytes."""
    file = reused_tokenizer_file(path)
    tokenizer, tokenizer_json = read_tokenizer(file)
    separator = separator_token(file, tokenizer)
    byte_symbols = set(pre_tokenizers.ByteLevel.alphabet())
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    if any(set(token) - byte_symbols for token in tokenizer.get_vocab() if token not in added):
        raise ValueError(f"--tokenizer {file} is not a byte-level BPE tokenizer; use one "
                         f"written by prepare.py, or train a new one (omit --tokenizer)")
    return tokenizer, separator, tokenizer_json


def reused_tokenizer_file(path: str) -> Path:
    """--tokenizer names a tokenizer.json, or the folder that holds one: a downloaded model's
    folder is what a user has at hand (and what tab completion gives)."""
    given = Path(path)
    file = given / TOKENIZER_FILE if given.is_dir() else given
    if given.is_dir() and not file.is_file():
        raise FileNotFoundError(f"--tokenizer {path} is a folder without a {TOKENIZER_FILE}; "
                                f"pass the folder of a model that has one, or the file itself")
    if not file.is_file():
        raise FileNotFoundError(f"--tokenizer {path} does not exist; pass a tokenizer.json or "
                                f"the folder that holds one, e.g. data/stdlib-32k")
    return file


def read_tokenizer(file: Path) -> tuple[Tokenizer, bytes]:
    """The tokenizer in `file` and the file's bytes. A file that is not one is refused in one
    line: the tokenizers library's own refusal is a bare Exception, a traceback."""
    tokenizer_json = file.read_bytes()
    try:
        json.loads(tokenizer_json)
    except ValueError as e:  # the usual case: a web page saved under the file's name
        raise ValueError(f"--tokenizer {file} is not JSON ({e}); a web page saved in its place? "
                         f"download the file itself again (on the Hugging Face Hub, its "
                         f"resolve/ link, not its blob/ page)") from None
    try:
        return Tokenizer.from_str(tokenizer_json.decode()), tokenizer_json
    except Exception as e:
        raise ValueError(f"--tokenizer {file} is JSON but not a tokenizer the tokenizers "
                         f"library reads ({e}); pass a tokenizer.json written by prepare.py "
                         f"or by a Hugging Face tokenizer") from None


def separator_token(path: Path, tokenizer: Tokenizer) -> str:
    """The token that opens each document in the shards: EOS_TOKEN where the tokenizer has
    it (prepare.py's own, GPT-2's, SmolLM's, Qwen's), else the end-of-text token its model
    names beside it: tokenizer_config.json's eos_token, or the eos_token_id of
    generation_config.json or config.json (Llama 3's <|end_of_text|>, say)."""
    if tokenizer.token_to_id(EOS_TOKEN) is not None:
        return EOS_TOKEN
    named = []
    for name, key in (("tokenizer_config.json", "eos_token"),
                      ("generation_config.json", "eos_token_id"), ("config.json", "eos_token_id")):
        try:
            value = json.loads((path.parent / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        value = value.get("content") if isinstance(value, dict) else value
        token = tokenizer.id_to_token(value) if isinstance(value, int) else value
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return token
        named.append(f"{name}'s {key} {value!r}")
    found = "; ".join(named) if named else "no tokenizer_config.json, generation_config.json " \
                                           "or config.json beside it names one"
    raise ValueError(f"--tokenizer {path} has no {EOS_TOKEN!r} token, and no end-of-text token "
                     f"of its own that it holds ({found}); give the tokenizer.json of a model "
                     f"folder, with its tokenizer_config.json beside it")


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
    """Appends one split's documents to `{split}_00000.bin, ...` of shard_tokens ids each.
    The val split also keeps its documents' keys, written to VAL_KEYS_FILE by finish()."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.pending, self.pending_tokens = [], 0
        self.documents = self.tokens = self.bytes = 0
        self.shards = []
        self.keys = [] if split == "val" else None  # the train split's could be billions

    def add(self, key: str, ids: list[int], eos_id: int, text_bytes: int):
        if self.keys is not None:
            self.keys.append(key)
        tokens = np.empty(len(ids) + 1, dtype=self.dtype)
        tokens[0], tokens[1:] = eos_id, ids  # EOS opens the document
        self.pending.append(tokens)
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
        info = {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
                "shards": self.shards}
        if self.keys is not None:
            write_atomic(self.out_dir / VAL_KEYS_FILE, json.dumps(self.keys, indent=0).encode())
            info["keys"] = VAL_KEYS_FILE
        return info


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


def encode_into(tokenizer, docs, writers, val_fraction, eos_id, total_bytes,
                max_tokens=None) -> str | None:
    """Encode documents with the library's parallel batch encoder, each to its split, until
    the train split holds max_tokens (whole documents). Returns the key of the train
    document that hashes lowest: the first a larger val_fraction would move to val.

    Three jobs overlap: this thread reads documents and writes shards while the encoder
    works on up to ENCODE_CHUNKS_IN_FLIGHT chunks (it releases the GIL and spreads each
    chunk over every core). One chunk at a time would leave cores idle on each chunk's
    longest documents, and again while its shards are written."""
    lowest = (2.0, None)  # (val_point, key) of the train document that hashes lowest
    # The bar only on a terminal: redirected to a log, its carriage returns are noise.
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode",
              disable=not sys.stderr.isatty()) as bar, \
            ThreadPoolExecutor(ENCODE_CHUNKS_IN_FLIGHT) as pool:
        in_flight = collections.deque()  # (chunk, future of its encodings), in corpus order
        chunks = chunked(docs, ENCODE_CHUNK_CHARS)
        while True:
            while len(in_flight) < ENCODE_CHUNKS_IN_FLIGHT and (chunk := next(chunks, None)):
                texts = [text for _, text in chunk]
                in_flight.append((chunk, pool.submit(tokenizer.encode_batch_fast, texts,
                                                     add_special_tokens=False)))
            if not in_flight or done(writers, max_tokens):
                break
            chunk, encodings = in_flight.popleft()
            for (key, text), encoding in zip(chunk, encodings.result(), strict=True):
                if done(writers, max_tokens):
                    break
                n_bytes, point = len(text.encode()), val_point(key)
                split = "val" if point < val_fraction else "train"
                writers[split].add(key, encoding.ids, eos_id, n_bytes)
                if split == "train":
                    lowest = min(lowest, (point, key))
                bar.update(n_bytes)
        for _, future in in_flight:  # stopped at max_tokens: the rest is not needed
            future.cancel()
    return lowest[1]


def done(writers: dict, max_tokens: int | None) -> bool:
    return max_tokens is not None and writers["train"].tokens >= max_tokens


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def main(argv=None):
    parser = ArgumentParser(
        description="Prepare token shards for stacklm (default: the Python standard "
                    "library's .py files, no download), or verify a prepared directory.")
    parser.add_argument("--source", help="a directory of files, a file (.txt, .jsonl, "
                        ".parquet (needs `pyarrow`) or other text), a quoted glob, or a Hugging "
                        "Face dataset name or save_to_disk directory (needs `datasets`); "
                        "default: built-in corpus")
    parser.add_argument("--data_dir", "--out", dest="out", metavar="DIR",
                        help="the directory to prepare, train.py's --data_dir (--out is the same "
                             "flag; default for the built-in corpus: "
                             "data/stdlib-<vocab_size/1024>k)")
    parser.add_argument("--vocab_size", type=int, default=32768,
                        help="BPE vocabulary size to train, including EOS (default 32768)")
    parser.add_argument("--tokenizer", help="reuse this tokenizer.json (or a model folder's) "
                        "instead of training one, so corpora share a vocabulary (default: "
                        "train one)")
    parser.add_argument("--text_field", default="text",
                        help="field holding the text in .jsonl lines, .parquet columns and "
                             "datasets (default text)")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--val_fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="share of documents, picked by a hash of their name, for val "
                             "(default 0.01)")
    parser.add_argument("--max_tokens", type=int_with_underscores, default=None,
                        help="stop after this many train tokens, whole documents (default: "
                             "the whole source)")
    parser.add_argument("--tokenizer_chars", type=int_with_underscores,
                        default=DEFAULT_TOKENIZER_CHARS,
                        help="train the tokenizer on the first this-many characters of the "
                             f"train split (default {DEFAULT_TOKENIZER_CHARS:,})")
    parser.add_argument("--subset", help="a Hugging Face dataset's configuration, the `name` "
                        "of load_dataset (e.g. sample-10BT); default: none")
    parser.add_argument("--split", default="train",
                        help="the Hugging Face dataset split to read (default train)")
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
                args.shard_tokens, args.val_fraction, args.max_tokens, args.tokenizer_chars,
                args.subset, args.split)


def int_with_underscores(text: str) -> int:
    """argparse type: 2_000_000_000 and 2,000,000,000 read as they are meant."""
    return int(text.replace("_", "").replace(",", ""))


if __name__ == "__main__":
    main()
