"""prepare.py: prepare a tiny corpus in a temp dir, then check the shards, the tokenizer
and the manifest against the source documents, and every kind of source and bad input."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

import prepare
from conftest import copy_of, documents_of, stream
from data import EOS_TOKEN
from plumbing import shards


# ---------------------------------------------------------------------------------------
# Shards, tokenizer, manifest
# ---------------------------------------------------------------------------------------

def test_shards_decode_back_to_the_source_documents(prepared, corpus):
    manifest = shards.load_manifest(prepared)
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(prepared))
    decoded = {}
    for split in ("train", "val"):
        docs = documents_of(stream(prepared, split), manifest["eos_id"])
        decoded[split] = [tokenizer.decode(d, skip_special_tokens=False) for d in docs]
        assert manifest["splits"][split]["documents"] == len(docs)
        assert manifest["splits"][split]["tokens"] == sum(len(d) + 1 for d in docs)
        assert manifest["splits"][split]["bytes"] == sum(len(t.encode()) for t in decoded[split])
    expected = corpus[1]
    assert decoded["train"] and decoded["val"]
    assert sorted(decoded["train"] + decoded["val"]) == sorted(expected)
    assert decoded["train"] == [t for t in expected if t in decoded["train"]]  # file order
    # the literal "<|endoftext|>" in literal.py stayed text: no extra boundary appeared
    assert any(EOS_TOKEN in t for t in decoded["train"] + decoded["val"])


def test_the_val_documents_are_on_record_by_key_in_stream_order(prepared, corpus):
    """val_documents.json (named in the manifest) lists the key of every val document, in
    the order of the val stream: the file each key names is the document decoded there."""
    manifest = shards.load_manifest(prepared)
    keys = json.loads((prepared / manifest["splits"]["val"]["keys"]).read_text())
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(prepared))
    docs = documents_of(stream(prepared, "val"), manifest["eos_id"])
    assert len(keys) == manifest["splits"]["val"]["documents"] >= 2
    assert [tokenizer.decode(d, skip_special_tokens=False) for d in docs] == \
        [(corpus[0] / key).read_text(encoding="utf-8") for key in keys]


def test_manifest_records_shards_tokenizer_and_skips(prepared):
    manifest = shards.load_manifest(prepared)
    assert manifest["format_version"] == shards.FORMAT_VERSION
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] <= 400
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    assert manifest["eos_id"] == tokenizer.token_to_id(EOS_TOKEN)
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(
        (prepared / "tokenizer.json").read_bytes()).hexdigest()
    train = manifest["splits"]["train"]["shards"]
    assert len(train) > 1 and all(s["tokens"] == 700 for s in train[:-1])
    for shard in train:
        raw = (prepared / shard["file"]).read_bytes()
        assert shard["sha256"] == hashlib.sha256(raw).hexdigest()
        assert len(raw) == 2 * shard["tokens"]
    assert [Path(s["file"]).name for s in manifest["skipped_files"]] == ["latin1.py"]
    assert "UnicodeDecodeError" in manifest["skipped_files"][0]["reason"]
    assert not list(prepared.glob("*.tmp"))


def test_reused_tokenizer_shares_the_vocabulary(prepared, tmp_path):
    source = tmp_path / "notes.txt"
    source.write_text(f"first note\n{EOS_TOKEN}second note, longer\n{EOS_TOKEN}\n")
    manifest = prepare.prepare(str(source), str(tmp_path / "notes"),
                            tokenizer=str(prepared / "tokenizer.json"), val_fraction=0.0)
    assert manifest["tokenizer"]["sha256"] == shards.load_manifest(prepared)["tokenizer"]["sha256"]
    assert manifest["splits"]["train"]["documents"] == 2  # the blank tail is no document
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    docs = documents_of(stream(tmp_path / "notes", "train"), manifest["eos_id"])
    assert [tokenizer.decode(d) for d in docs] == ["first note\n", "second note, longer\n"]


def test_interrupted_prepare_leaves_nothing_to_read_and_a_rerun_recovers(corpus, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "out"
    real_write, calls = prepare.write_atomic, []

    def dies_on_third_file(path, payload):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_write(path, payload)

    monkeypatch.setattr(prepare, "write_atomic", dies_on_third_file)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(str(corpus[0]), str(out), vocab_size=300, shard_tokens=700,
                        val_fraction=0.2)
    assert calls[0].parent == tmp_path / "out.tmp"  # written aside, never into out
    with pytest.raises(FileNotFoundError, match="does not exist.*python prepare.py"):
        shards.load_manifest(out)
    monkeypatch.setattr(prepare, "write_atomic", real_write)
    prepare.prepare(str(corpus[0]), str(out), vocab_size=300, shard_tokens=700,
                    val_fraction=0.2)  # the same command again: the leftover is replaced
    assert shards.load_manifest(out) and not (tmp_path / "out.tmp").exists()


def test_a_rerun_never_touches_a_prepared_directory_or_the_source(prepared, corpus, tmp_path):
    """A rerun into a prepared --out, a folder of other files, or the source folder itself
    is refused before any work, and leaves every file as it was."""
    out = copy_of(prepared, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=f"--data_dir {out} already holds a prepared dataset "
                                         r"\(manifest.json\); nothing was changed"):
        prepare.prepare(str(corpus[0]), str(out), vocab_size=300)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(ValueError, match="already holds files"):
        prepare.prepare(str(corpus[0] / "mod_01.py"), str(corpus[0]), vocab_size=300)
    with pytest.raises(ValueError, match="is, or lies inside, the source folder"):
        prepare.prepare(str(corpus[0]), str(corpus[0]), vocab_size=300)
    with pytest.raises(ValueError, match="is, or lies inside, the source folder"):
        prepare.prepare(str(corpus[0]), str(corpus[0] / "prepared"), vocab_size=300)
    assert not (corpus[0] / "prepared").exists() and not list(tmp_path.glob("*.tmp"))


def test_preparing_a_corpus_again_makes_the_same_tokenizer_shards_and_val_keys(prepared,
                                                                               corpus,
                                                                               tmp_path):
    """ensure_builtin prepares a built-in corpus again where an older stacklm's lacks
    val_documents.json, promising the same shards (its checkpoints resume): the tokenizer's
    and every shard's sha256, as the manifest records them, and the val keys come out the
    same from a second preparation of the same source."""
    again = tmp_path / "again"
    prepare.prepare(str(corpus[0]), str(again), vocab_size=400, shard_tokens=700,
                    val_fraction=0.2)

    def identity(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        return manifest["tokenizer"]["sha256"], shards.fingerprint(manifest), \
            (folder / "val_documents.json").read_text()
    assert identity(again) == identity(prepared)


def test_write_atomic_keeps_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(prepare.os, "replace", broken_replace)
    with pytest.raises(OSError):
        prepare.write_atomic(path, b"new, partial")
    assert path.read_bytes() == b"old"


# ---------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------

def test_builtin_corpus_is_the_sorted_stdlib_without_site_packages():
    root, files = prepare.stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert root / "os.py" in files
    assert prepare.builtin_data_dir(32768) == "data/stdlib-32k"
    assert prepare.builtin_data_dir(4096) == "data/stdlib-4k"


def test_default_source_is_the_builtin_corpus(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    monkeypatch.setattr(prepare, "stdlib_files", lambda: (root, sorted(root.glob("mod_*.py"))))
    manifest = prepare.prepare(out_dir=str(tmp_path / "builtin"), vocab_size=300,
                               val_fraction=0.2)
    assert manifest["source"] == f"stdlib:{root}"
    docs = manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"]
    assert docs == 40


def test_glob_source_selects_matching_files(corpus, tmp_path):
    root, _ = corpus
    manifest = prepare.prepare(str(root / "mod_1*.py"), str(tmp_path / "glob"), vocab_size=300,
                            val_fraction=0.0)
    assert manifest["splits"]["train"]["documents"] == 10  # mod_10.py .. mod_19.py


def test_jsonl_source_reads_the_text_field_and_skips_bad_lines(tmp_path):
    source = tmp_path / "docs.jsonl"
    rows = [json.dumps({"body": f"document number {i} says hello"}) for i in range(5)]
    source.write_text("\n".join(rows[:2] + ["{not json", json.dumps({"other": 1})] + rows[2:]))
    manifest = prepare.prepare(str(source), str(tmp_path / "jsonl"), vocab_size=300,
                            text_field="body", val_fraction=0.0)
    assert manifest["splits"]["train"]["documents"] == 5
    assert [s["file"] for s in manifest["skipped_files"]] == [f"{source}:3", f"{source}:4"]


# --- parquet, read by pyarrow ----------------------------------------------------------

def write_parquet(path: Path, texts: list, row_group_size: int = 3):
    """A parquet file as the hub publishes them: the text column beside others, in several
    row groups."""
    import pyarrow
    import pyarrow.parquet

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pyarrow.table({"id": list(range(len(texts))), "text": texts})
    pyarrow.parquet.write_table(table, path, row_group_size=row_group_size)


def test_parquet_rows_are_documents_keyed_by_file_and_row(tmp_path):
    """A folder mixing .parquet, .jsonl and .txt: the shards decode back to exactly the
    texts written, in corpus order; every val key names the row (from 0, across row
    groups) that was decoded; a null row and a file that is not parquet are skipped."""
    root = tmp_path / "mixed"
    written = {}  # key -> text: the oracle
    for name in ("a.parquet", "shards/b.parquet"):
        texts = [f"{name} row {i}: " + "lorem ipsum " * (i % 4) for i in range(14)]
        texts[5] = None  # skipped, yet counted: row 6 is still key :6
        write_parquet(root / name, texts)
        written |= {f"{name}:{i}": t for i, t in enumerate(texts) if t is not None}
    (root / "c.jsonl").write_text(json.dumps({"text": "a json line"}) + "\n")
    (root / "d.txt").write_text(f"first text{EOS_TOKEN}second text")
    written |= {"c.jsonl:1": "a json line", "d.txt:0": "first text", "d.txt:1": "second text"}
    (root / "e.parquet").write_bytes(b"not parquet at all")
    out = tmp_path / "out"
    manifest = prepare.prepare(str(root), str(out), vocab_size=300, val_fraction=0.3)
    train, val = decoded_documents(out, "train"), decoded_documents(out, "val")
    val_keys = json.loads((out / manifest["splits"]["val"]["keys"]).read_text())
    assert [written[k] for k in val_keys] == val and len(val) >= 3
    assert train == [t for k, t in sorted(written.items(), key=corpus_order)
                     if k not in val_keys]
    assert [s["file"] for s in manifest["skipped_files"]] == \
        [f"{root / 'a.parquet'}:5", f"{root / 'e.parquet'}", f"{root / 'shards/b.parquet'}:5"]
    assert "ArrowInvalid" in manifest["skipped_files"][1]["reason"]


def corpus_order(item):
    """Files in sorted path order, then documents in file order."""
    path, index = item[0].rsplit(":", 1)
    return path, int(index)


def test_a_parquet_file_is_read_in_batches_across_its_row_groups(tmp_path, monkeypatch):
    """Ten rows in four row groups of 3, read 2 rows at a time: batches straddle the groups,
    and every row comes out once, in order, numbered across the file."""
    import pyarrow.parquet

    texts = [f"row {i}" for i in range(10)]
    write_parquet(tmp_path / "f.parquet", texts, row_group_size=3)
    assert pyarrow.parquet.ParquetFile(tmp_path / "f.parquet").num_row_groups == 4
    monkeypatch.setattr(prepare, "PARQUET_BATCH_ROWS", 2)
    got = list(prepare.parquet_documents(tmp_path / "f.parquet", "f.parquet", "text", []))
    assert got == [(f"f.parquet:{i}", t) for i, t in enumerate(texts)]


def test_a_damaged_row_group_loses_its_own_rows_alone(tmp_path):
    """Three row groups of 10 rows; the middle one's page header overwritten (pyarrow reads
    the footer, then fails on that group alone). The rows of the other two are documents
    under their own numbers (the oracle: the texts written), and the lost rows are listed
    with pyarrow's reason."""
    import pyarrow.parquet

    texts = [f"row {i}: " + "lorem ipsum " * 20 for i in range(30)]
    path = tmp_path / "f.parquet"
    write_parquet(path, texts, row_group_size=10)
    column = pyarrow.parquet.read_metadata(path).row_group(1).column(1)
    damaged = bytearray(path.read_bytes())
    start = column.dictionary_page_offset or column.data_page_offset
    damaged[start:start + 30] = b"\xff" * 30
    path.write_bytes(bytes(damaged))
    skipped = []
    got = list(prepare.parquet_documents(path, "f.parquet", "text", skipped))
    assert got == [(f"f.parquet:{i}", texts[i]) for i in (*range(10), *range(20, 30))]
    [lost] = skipped
    assert lost["file"] == f"{path}:10-19" and "row group 1 cannot be read from row 10 on (" \
        in lost["reason"]


def test_a_parquet_file_is_held_a_row_group_at_a_time_never_whole(tmp_path):
    """pyarrow's own count of the bytes it holds, read at every row: sixteen row groups of
    ~100 KB of text that does not compress; reading never holds half the file's text."""
    import pyarrow

    rng = random.Random(0)
    texts = [rng.randbytes(50).hex() for _ in range(16 * 1024)]  # 100 characters each
    write_parquet(tmp_path / "f.parquet", texts, row_group_size=1024)
    before, held = pyarrow.total_allocated_bytes(), 0
    for _ in prepare.parquet_documents(tmp_path / "f.parquet", "f.parquet", "text", []):
        held = max(held, pyarrow.total_allocated_bytes() - before)
    assert 0 < held < 16 * 1024 * 100 / 2, held


def test_parquet_sources_as_a_glob_a_folder_and_a_single_file(tmp_path):
    root = tmp_path / "shards"
    for n in range(2):
        write_parquet(root / f"{n:03d}.parquet", [f"shard {n} row {i}" for i in range(4)])
    folder = source_documents(root)
    assert source_documents(root / "*.parquet") == folder
    assert [k for k, _ in folder] == [f"{n:03d}.parquet:{i}" for n in range(2) for i in range(4)]
    single = root / "001.parquet"
    assert list(prepare.Corpus(str(single), *prepare.find_source(str(single)), "text")
                .documents([])) == folder[4:]
    with pytest.raises(FileNotFoundError, match="nowhere.parquet: no such file"):
        prepare.prepare("nowhere.parquet", str(tmp_path / "o"))  # a path, not a hub name


def test_a_parquet_file_without_the_text_column_is_refused_naming_its_columns(tmp_path,
                                                                                capsys):
    write_parquet(tmp_path / "s" / "f.parquet", ["some text", "more text"])
    for field, kind in (("body", "no such column"), ("id", "a column of numbers")):
        with pytest.raises(SystemExit) as exit_info:
            prepare.main(["--source", str(tmp_path / "s"), "--data_dir", str(tmp_path / "o"),
                          "--text_field", field])
        assert exit_info.value.code == 2, kind
        stderr = capsys.readouterr().err
        assert stderr.count("\n") == 1 and "--text_field" in stderr, kind
        assert f"{tmp_path / 's' / 'f.parquet'} has no text column {field!r} (its columns: " \
               f"id (int64), text (string))" in stderr, kind
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_a_later_shard_without_the_text_column_is_refused_before_any_work(tmp_path,
                                                                          monkeypatch, capsys):
    """Only the last of three shards lacks the column: the refusal names that file, from the
    footers, before the tokenizer or the encode reads a row of the first two."""
    import pyarrow
    import pyarrow.parquet

    for n in range(2):
        write_parquet(tmp_path / "s" / f"{n:03d}.parquet", [f"shard {n} row {i}" for i in range(4)])
    pyarrow.parquet.write_table(pyarrow.table({"body": ["the wrong column"]}),
                                tmp_path / "s" / "002.parquet")
    read = []
    monkeypatch.setattr(prepare, "parquet_documents", lambda path, *rest: read.append(path) or [])
    with pytest.raises(SystemExit):
        prepare.main(["--source", str(tmp_path / "s"), "--data_dir", str(tmp_path / "o")])
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and f"{tmp_path / 's' / '002.parquet'} has no text column " \
        "'text' (its columns: body (string))" in stderr
    assert read == [] and not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()


def test_the_progress_bar_counts_a_parquet_files_text_not_its_compressed_size(tmp_path):
    """The encode bar's total is the text's UTF-8 bytes (the oracle: the texts written), to
    the column's per-row overhead, and not the file's size, which compression makes a
    fraction of it (the bar would pass 100%); a .jsonl file counts its size."""
    import pyarrow
    import pyarrow.parquet

    texts = [f"def f{i}():\n    return {i}\n" * 40 for i in range(300)]
    utf8 = sum(len(text.encode()) for text in texts)
    path = tmp_path / "f.parquet"
    urls = [f"https://example.org/{i:0200d}" for i in range(300)]  # a column not counted
    pyarrow.parquet.write_table(pyarrow.table({"url": urls, "text": texts}), path,
                                row_group_size=64, compression="zstd")
    assert path.stat().st_size < utf8 / 4  # what the bar counted before
    assert utf8 <= prepare.text_bytes(path, "text") <= 1.1 * utf8
    (tmp_path / "f.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert prepare.text_bytes(tmp_path / "f.jsonl", "text") == (tmp_path / "f.jsonl").stat().st_size


def test_a_parquet_source_without_pyarrow_says_how_to_install(tmp_path, monkeypatch, capsys):
    write_parquet(tmp_path / "s" / "f.parquet", ["some text"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as if not installed
    with pytest.raises(SystemExit):
        prepare.main(["--source", str(tmp_path / "s" / "*.parquet"), "--data_dir",
                      str(tmp_path / "o")])
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "`pip install pyarrow`" in stderr
    assert not (tmp_path / "o").exists()  # refused before any work


# --- Hugging Face datasets, read by the real library, offline ---------------------------

@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    """The real `datasets`, kept off the network and out of the user's cache. Both libraries
    read the offline switches once, at import, so the flags are set on them as well."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return datasets


def test_save_to_disk_folders_a_dataset_and_a_dataset_dicts_split(tmp_path, offline_datasets):
    datasets = offline_datasets
    texts = {split: [f"{split} row {i}: the quick brown fox" for i in range(6)]
             for split in ("train", "validation")}
    flat = tmp_path / "flat"
    datasets.Dataset.from_dict({"id": list(range(6)), "text": texts["train"]}).save_to_disk(flat)
    prepare.prepare(str(flat), str(tmp_path / "o1"), vocab_size=300, val_fraction=0.0)
    assert decoded_documents(tmp_path / "o1", "train") == texts["train"]
    split_dict = tmp_path / "dict"
    datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": rows})
                          for split, rows in texts.items()}).save_to_disk(split_dict)
    prepare.main(["--source", str(split_dict), "--split", "validation", "--data_dir",
                  str(tmp_path / "o2"), "--vocab_size", "300", "--val_fraction", "0"])
    assert decoded_documents(tmp_path / "o2", "train") == texts["validation"]
    refused = [  # the last two: what a folder cannot choose is refused, not ignored
        (split_dict, {"split": "test"},
         r"has no split 'test' \(it has \['train', 'validation'\]\); pass --split"),
        (flat, {"text_field": "body"},
         r"no text field 'body' \(its fields: id \(int64\), text \(string\)\); pass "
         r"--text_field"),
        (flat, {"text_field": "id"},  # a column of numbers, as parquet's is refused
         r"no text field 'id' \(its fields: id \(int64\), text \(string\)\); pass "
         r"--text_field"),
        (flat, {"split": "validation"},
         r"--split validation: .*flat holds one Dataset, not a DatasetDict of splits; drop "
         r"--split"),
        (split_dict, {"subset": "sample-10BT"},
         r"--subset sample-10BT: .*dict is a save_to_disk folder, and only a hub dataset has "
         r"subsets"),
    ]
    for n, (source, knobs, message) in enumerate(refused):
        with pytest.raises(ValueError, match=message):
            prepare.prepare(str(source), str(tmp_path / f"refused{n}"), **knobs)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("refused")]


def test_a_datasets_null_rows_are_skipped_and_listed_as_a_parquet_files_are(
        tmp_path, offline_datasets):
    """3 null rows of 20 in a save_to_disk folder: the other 17 are the corpus, in order,
    and the three are listed in manifest.json by row, as parquet's null rows are. Rows of
    a stream that declares no features are checked one by one: a number is refused, naming
    the field's type."""
    texts = [None if i in (3, 7, 11) else f"row {i}: the quick brown fox" for i in range(20)]
    offline_datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "ds")
    manifest = prepare.prepare(str(tmp_path / "ds"), str(tmp_path / "o"), vocab_size=300,
                               val_fraction=0.0)
    assert decoded_documents(tmp_path / "o", "train") == [t for t in texts if t is not None]
    assert manifest["skipped_files"] == [{"file": f"{tmp_path / 'ds'}:{i}",
                                          "reason": "'text' is null"} for i in (3, 7, 11)]
    rows = [{"text": "a document"}, {"text": 7}]
    stream = offline_datasets.IterableDataset.from_generator(lambda: iter(rows))
    assert stream.features is None  # as a hub stream may be
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offline_datasets, "load_dataset", lambda *a, **k: stream)
        with pytest.raises(ValueError, match=r"no text field 'text' \(its fields: text \(int\)"):
            list(prepare.hf_documents("someone/corpus", "text", None, "train", []))


def write_hub_layout(root: Path) -> dict:
    """A dataset repository as huggingface_hub leaves it on disk: parquet files and a
    README whose `configs` name each subset's files by split (FineWeb-Edu's layout)."""
    texts = {(None, "train"): [f"default row {i}" for i in range(5)],
             ("sample-10BT", "train"): [f"sample train row {i}" for i in range(7)],
             ("sample-10BT", "validation"): [f"sample validation row {i}" for i in range(8)]}
    for (subset, split), rows in texts.items():
        write_parquet(root / (subset or "data") / f"{split}-000.parquet", rows)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train\n    path: data/train-*.parquet\n"
        "- config_name: sample-10BT\n  data_files:\n"
        "  - split: train\n    path: sample-10BT/train-*.parquet\n"
        "  - split: validation\n    path: sample-10BT/validation-*.parquet\n---\n")
    return texts


def test_a_hub_dataset_streams_through_load_dataset_with_its_subset_and_split(
        tmp_path, monkeypatch, offline_datasets):
    """README's `--source org/name --subset S --split X` through the real load_dataset,
    streaming. A local folder never reaches that call (find_source reads a folder as files,
    and hf_documents sends one to load_from_disk), so the hub name alone is pointed at a
    local copy of a repository: the call's arguments are prepare's own, and the documents
    are the texts of that subset's split."""
    texts = write_hub_layout(tmp_path / "hub")
    real_load, calls = offline_datasets.load_dataset, []

    def load_from_local_copy(path, **kwargs):
        calls.append((path, kwargs))
        return real_load(str(tmp_path / "hub"), **kwargs)

    monkeypatch.setattr(offline_datasets, "load_dataset", load_from_local_copy)
    prepare.main(["--source", "someone/corpus", "--subset", "sample-10BT", "--split",
                  "validation", "--data_dir", str(tmp_path / "o1"), "--vocab_size", "300",
                  "--val_fraction", "0.3"])
    assert calls == [("someone/corpus", {"name": "sample-10BT", "split": "validation",
                                         "streaming": True})] * 3  # probe, sample, encode
    expected = texts[("sample-10BT", "validation")]
    manifest = shards.load_manifest(tmp_path / "o1")
    val_keys = json.loads((tmp_path / "o1" / manifest["splits"]["val"]["keys"]).read_text())
    val = decoded_documents(tmp_path / "o1", "val")
    assert val and [expected[int(k.split(":")[1])] for k in val_keys] == val
    assert {k.rsplit(":", 1)[0] for k in val_keys} == {"someone/corpus"}  # NAME:N, row N
    assert decoded_documents(tmp_path / "o1", "train") == [t for t in expected if t not in val]
    assert (manifest["subset"], manifest["split"]) == ("sample-10BT", "validation")
    prepare.prepare("someone/corpus", str(tmp_path / "o2"), vocab_size=300, val_fraction=0.0)
    assert decoded_documents(tmp_path / "o2", "train") == texts[(None, "train")]
    with pytest.raises(ValueError, match=r"no text field 'body' \(its fields: id \(int64\), "
                                         r"text \(string\)\)"):
        prepare.prepare("someone/corpus", str(tmp_path / "o3"), text_field="body")


def test_hugging_face_name_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install datasets"):
        prepare.prepare("someone/tiny-corpus", str(tmp_path / "x"))


# ---------------------------------------------------------------------------------------
# Bad input: clear errors that name the file and the fix
# ---------------------------------------------------------------------------------------

def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty corpus.*holds no files"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty corpus: every document of .*empty is blank; "
                                         "check --source and --text_field"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "empty" / "binary.dat").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="empty corpus"):
        prepare.prepare(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="no file matches"):
        prepare.prepare(str(tmp_path / "*.nothing"), str(tmp_path / "out"))
    write_parquet(tmp_path / "cut.parquet", ["some text"] * 50)  # then truncated: the real
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "cut.parquet").read_bytes()[:300])
    with pytest.raises(ValueError, match=r"empty corpus: .*cut\.parquet has no readable, "
                                         r"non-blank document \(skipped .*cut\.parquet: "
                                         r"ArrowInvalid: Parquet magic bytes not found"):
        prepare.prepare(str(tmp_path / "cut.parquet"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before any work


def test_unreadable_files_are_skipped_and_counted(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    real_read = Path.read_bytes

    def read_bytes(path):
        if path.name == "mod_03.py":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    manifest = prepare.prepare(str(root), str(tmp_path / "out"), vocab_size=300,
                               val_fraction=0.2)
    reasons = {Path(s["file"]).name: s["reason"] for s in manifest["skipped_files"]}
    assert reasons.keys() == {"latin1.py", "mod_03.py"}
    assert "PermissionError" in reasons["mod_03.py"]


def test_reused_tokenizer_must_exist_and_have_eos(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        prepare.prepare(str(corpus[0]), str(tmp_path / "o"), tokenizer=str(tmp_path / "nope.json"))
    plain = Tokenizer(models.BPE())
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match="plain.json has no '<\\|endoftext\\|>'"):
        prepare.prepare(str(corpus[0]), str(tmp_path / "o"), tokenizer=str(tmp_path / "plain.json"))


def test_reused_tokenizer_may_be_named_by_its_folder(prepared, tmp_path):
    """A model's folder, as downloaded or tab-completed, stands for the tokenizer.json in it:
    the one whose bytes the new manifest records."""
    source = tmp_path / "notes.txt"
    source.write_text(f"first note\n{EOS_TOKEN}second note\n")
    manifest = prepare.prepare(str(source), str(tmp_path / "notes"), tokenizer=str(prepared),
                               val_fraction=0.0)
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(
        (prepared / "tokenizer.json").read_bytes()).hexdigest()
    assert (tmp_path / "notes" / "tokenizer.json").read_bytes() == \
        (prepared / "tokenizer.json").read_bytes()


def test_a_tokenizer_that_is_no_tokenizer_json_is_one_line(corpus, tmp_path, capsys):
    """A web page saved as tokenizer.json, JSON of another kind, and a folder without a
    tokenizer.json: each is refused in one line that names the file and what to do, before
    any work, and the file is left as it was."""
    page = tmp_path / "tokenizer.json"
    page.write_text("<!DOCTYPE html><html><body>Not Found</body></html>\n")
    other = tmp_path / "config.json"
    other.write_text('{"model_type": "llama"}')
    (tmp_path / "model").mkdir()
    out = tmp_path / "o"
    line = refusal(capsys, "--source", str(corpus[0]), "--out", str(out), "--tokenizer", str(page))
    assert f"--tokenizer {page} is not JSON" in line and "resolve/ link" in line
    line = refusal(capsys, "--source", str(corpus[0]), "--out", str(out), "--tokenizer", str(other))
    assert f"--tokenizer {other} is JSON but not a tokenizer" in line and "pass a tokenizer.json" \
        in line
    line = refusal(capsys, "--source", str(corpus[0]), "--out", str(out), "--tokenizer",
                   str(tmp_path / "model"))
    assert f"--tokenizer {tmp_path / 'model'} is a folder without a tokenizer.json" in line
    assert page.read_text().startswith("<!DOCTYPE html>") and not out.exists()


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def test_cli_prepares_a_directory(corpus, tmp_path):
    out = tmp_path / "cli"
    prepare.main(["--source", str(corpus[0]), "--out", str(out), "--vocab_size", "300",
               "--shard_tokens", "500", "--val_fraction", "0"])
    manifest = shards.load_manifest(out)
    assert manifest["vocab_size"] <= 300 and manifest["splits"]["val"]["documents"] == 0
    assert all(s["tokens"] <= 500 for s in manifest["splits"]["train"]["shards"])
    with pytest.raises(ValueError, match="also pass --data_dir"):
        prepare.prepare(str(corpus[0]))


def test_cli_verify_checks_every_checksum(prepared, tmp_path, capsys):
    prepare.main(["--verify", str(prepared)])
    assert "verified" in capsys.readouterr().out
    bad = copy_of(prepared, tmp_path)
    raw = bytearray((bad / "val_00000.bin").read_bytes())
    raw[5] ^= 1  # same size, so only the checksum can tell
    (bad / "val_00000.bin").write_bytes(bytes(raw))
    with pytest.raises(SystemExit) as exit_info:
        prepare.main(["--verify", str(bad)])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and stderr.count("\n") == 1
    assert f"{bad / 'val_00000.bin'}: sha256 does not match manifest.json" in stderr
    with pytest.raises(ValueError, match="val_00000.bin: sha256 does not match"):
        prepare.main(["--verify", str(bad), "--debug"])  # the exception itself, for a traceback


REPO = Path(__file__).resolve().parent.parent


def run_prepare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "prepare.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


def refusal(capsys, *args: str) -> str:
    """prepare's command line in this process: it must exit with status 2 after one
    `error: ...` line on stderr (test_cli_debug_shows_the_traceback runs a real process)."""
    with pytest.raises(SystemExit) as exit_info:
        prepare.main(list(args))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_cli_bad_arguments_are_one_line_each(corpus, tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("not a directory")
    assert f"--data_dir {a_file}: {a_file} is a file, not a directory" in refusal(
        capsys, "--source", str(corpus[0]), "--out", str(a_file))
    assert f"{a_file} is a file" in refusal(capsys, "--source", str(corpus[0]), "--out",
                                            str(a_file / "sub"))
    missing = tmp_path / "nowhere" / "corpus"
    assert f"--source {missing}: no such file or directory" in refusal(
        capsys, "--source", str(missing), "--out", str(tmp_path / "o"))
    (tmp_path / "unprepared").mkdir()
    line = refusal(capsys, "--verify", str(tmp_path / "unprepared"))
    assert str(tmp_path / "unprepared" / "manifest.json") in line and "is missing" in line \
        and "python prepare.py" in line
    assert not (tmp_path / "o").exists()  # refused before any work


def test_cli_debug_shows_the_traceback(tmp_path):
    result = run_prepare("--verify", str(tmp_path / "absent"), "--debug", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "FileNotFoundError" in result.stderr


# ---------------------------------------------------------------------------------------
# Bounds: the tokenizer's sample, max_tokens, streamed files, the pipelined encoder
# ---------------------------------------------------------------------------------------

def source_documents(root: Path) -> list[tuple[str, str]]:
    """(key, text) of every document of a folder source, in corpus order."""
    return list(prepare.Corpus(str(root), *prepare.find_source(str(root)), "text").documents([]))


def test_shards_hold_each_document_encoded_alone_with_many_chunks_in_flight(
        prepared, corpus, tmp_path, monkeypatch):
    """The overlapped encoder keeps corpus order: with chunks of ~one document, each
    document's ids equal the tokenizer's own encode of that document alone."""
    monkeypatch.setattr(prepare, "ENCODE_CHUNK_CHARS", 50)
    out = tmp_path / "small_chunks"
    manifest = prepare.prepare(str(corpus[0]), str(out), shard_tokens=700, val_fraction=0.2,
                               tokenizer=str(prepared / "tokenizer.json"))
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    ids = documents_of(stream(out, "train"), manifest["eos_id"])
    train_texts = [t for k, t in source_documents(corpus[0]) if not prepare.is_val(k, 0.2)]
    assert ids == [tokenizer.encode(t, add_special_tokens=False).ids for t in train_texts]


def test_max_tokens_stops_after_whole_documents(prepared, corpus, tmp_path):
    full = [len(d) + 1 for d in documents_of(stream(prepared, "train"),
                                             shards.load_manifest(prepared)["eos_id"])]
    limit = sum(full[:7]) - 3  # inside the 7th document: it is kept whole, the 8th is not
    manifest = prepare.prepare(str(corpus[0]), str(tmp_path / "capped"), shard_tokens=700,
                               val_fraction=0.2, max_tokens=limit,
                               tokenizer=str(prepared / "tokenizer.json"))
    assert manifest["splits"]["train"]["tokens"] == sum(full[:7])
    assert manifest["splits"]["train"]["documents"] == 7 and manifest["max_tokens"] == limit


def test_tokenizer_is_trained_on_the_bounded_sample_only(corpus, tmp_path):
    """With tokenizer_chars smaller than the corpus, the tokenizer is the one trained on the
    first train documents up to that budget, and not the one trained on all of them."""
    texts = [t for k, t in source_documents(corpus[0]) if not prepare.is_val(k, 0.2)]
    budget = sum(len(t) for t in texts[:5])
    prepare.prepare(str(corpus[0]), str(tmp_path / "bounded"), vocab_size=300,
                    val_fraction=0.2, tokenizer_chars=budget)
    got = (tmp_path / "bounded" / "tokenizer.json").read_text()
    assert got == prepare.train_tokenizer(texts[:5], 300).to_str()
    assert got != prepare.train_tokenizer(texts, 300).to_str()


def test_a_large_txt_file_is_read_in_pieces_into_the_same_documents(tmp_path, monkeypatch):
    documents = [f"doc {i}\r\n" + "x" * (i * 7 % 23) for i in range(30)]
    source = tmp_path / "big.txt"
    source.write_bytes(EOS_TOKEN.join(documents).encode())
    monkeypatch.setattr(prepare, "READ_CHARS", 5)  # pieces split documents and EOS tokens
    got = list(prepare.txt_documents(source, "big.txt"))
    assert got == [(f"big.txt:{i}", d) for i, d in enumerate(documents)]


def test_a_non_utf8_jsonl_line_is_skipped_alone(tmp_path):
    source = tmp_path / "mixed.jsonl"
    source.write_bytes(b'{"text": "good one"}\n{"text": "caf\xe9"}\n{"text": "good two"}\n')
    skipped = []
    got = list(prepare.file_documents(source, tmp_path, "text", skipped))
    assert got == [("mixed.jsonl:1", "good one"), ("mixed.jsonl:3", "good two")]
    assert [s["file"] for s in skipped] == [f"{source}:2"]


def test_an_empty_val_split_is_refused_naming_the_fraction_that_fixes_it(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"the val split of .* is empty.*pass "
                                         r"--val_fraction=(\S+) or more") as refused:
        prepare.prepare(str(corpus[0]), str(tmp_path / "v"), vocab_size=300, val_fraction=1e-4)
    assert not (tmp_path / "v").exists() and not (tmp_path / "v.tmp").exists()
    suggested = float(str(refused.value).split("--val_fraction=")[-1].split()[0])
    manifest = prepare.prepare(str(corpus[0]), str(tmp_path / "v"), vocab_size=300,
                               val_fraction=suggested)
    assert manifest["splits"]["val"]["documents"] >= 1


def decoded_documents(data_dir, split) -> list[str]:
    tokenizer = Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json"))
    docs = documents_of(stream(data_dir, split), shards.load_manifest(data_dir)["eos_id"])
    return [tokenizer.decode(d) for d in docs]


def test_val_is_about_one_percent_picked_by_name_so_new_files_move_no_document(prepared,
                                                                                tmp_path):
    """2,000 one-line files at the default --val_fraction: about 1% of them form val. Then
    500 more files whose names sort first, so every old file moves down the corpus: each
    old document stays in the split it was in."""
    old = tmp_path / "old"
    old.mkdir()
    for i in range(2000):
        (old / f"doc_{i:04d}.py").write_text(f"x = {i}\n")
    tokenizer = str(prepared / "tokenizer.json")
    prepare.prepare(str(old), str(tmp_path / "old_prepared"), tokenizer=tokenizer)
    before = {split: decoded_documents(tmp_path / "old_prepared", split)
              for split in ("train", "val")}
    assert 10 <= len(before["val"]) <= 30 and len(before["train"]) + len(before["val"]) == 2000
    grown = copy_of(old, tmp_path / "grown")
    for i in range(500):
        (grown / f"a_new_{i:03d}.py").write_text(f"y = {i}\n")
    prepare.prepare(str(grown), str(tmp_path / "grown_prepared"), tokenizer=tokenizer)
    for split in ("train", "val"):
        after = set(decoded_documents(tmp_path / "grown_prepared", split))
        assert set(before[split]) <= after, split


def test_val_fraction_zero_makes_no_val_split_and_says_so(prepared, corpus, tmp_path, capsys):
    manifest = prepare.prepare(str(corpus[0]), str(tmp_path / "no_val"), val_fraction=0.0,
                               tokenizer=str(prepared / "tokenizer.json"))
    assert manifest["splits"]["val"] == {"documents": 0, "tokens": 0, "bytes": 0, "shards": [],
                                         "keys": shards.VAL_KEYS_FILE}
    assert json.loads((tmp_path / "no_val" / shards.VAL_KEYS_FILE).read_text()) == []
    assert manifest["splits"]["train"]["documents"] == len(corpus[1])  # every document
    assert "data: warning: --val_fraction=0 makes no val split" in capsys.readouterr().out


def test_the_command_line_defaults_are_the_ones_readme_gives(monkeypatch):
    """--val_fraction 0.01 (about 1% of documents), --tokenizer_chars 1,000,000,000, the
    train split, the text field, and no --max_tokens bound."""
    calls = []
    monkeypatch.setattr(prepare, "prepare", lambda *args: calls.append(args))
    prepare.main(["--source", "corpus", "--data_dir", "out"])
    [(source, out, vocab_size, tokenizer, text_field, shard_tokens, val_fraction, max_tokens,
      tokenizer_chars, subset, split)] = calls
    assert (val_fraction, tokenizer_chars, max_tokens) == (0.01, 1_000_000_000, None)
    assert (text_field, split, subset, vocab_size) == ("text", "train", None, 32768)


def test_data_dir_names_the_output_and_out_is_its_alias(corpus, tmp_path):
    """prepare.py's output is the folder train.py calls --data_dir; --out still works."""
    for flag in ("--data_dir", "--out"):
        prepare.main(["--source", str(corpus[0]), flag, str(tmp_path / flag[2:]),
                      "--vocab_size", "300", "--val_fraction", "0.2"])
        assert shards.load_manifest(tmp_path / flag[2:])["vocab_size"] <= 300


@pytest.mark.parametrize("leftover, aside, says", [
    (["train_00000.bin"], "stdlib-4k.incomplete", "data/stdlib-4k has no manifest.json"),
    (["train_00000.bin", "manifest.json"], "stdlib-4k.old",
     "data/stdlib-4k was prepared by an older stacklm (no val_documents.json)")])
def test_a_built_in_corpus_it_cannot_use_is_moved_aside_and_prepared_again(
        tmp_path, monkeypatch, capsys, leftover, aside, says):
    """data/stdlib-4k without manifest.json (a preparation killed before its rename), or
    from before val_documents.json: it is said what it is, kept aside (nothing is deleted),
    and the corpus is prepared again in its place; once prepared, nothing more happens."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "data" / "stdlib-4k"
    folder.mkdir(parents=True)
    for name in leftover:
        (folder / name).write_text("{}")
    made = []

    def fake_prepare(out_dir, vocab_size):  # the real one reads the whole standard library
        assert not Path(out_dir).exists()  # prepare refuses a folder that holds files
        made.append((out_dir, vocab_size))
        Path(out_dir).mkdir()
        for name in ("manifest.json", shards.VAL_KEYS_FILE):
            (Path(out_dir) / name).write_text("{}")
    monkeypatch.setattr(prepare, "prepare", fake_prepare)
    prepare.ensure_builtin(["data/stdlib-4k"], 4096)
    assert made == [("data/stdlib-4k", 4096)]
    assert sorted(p.name for p in (tmp_path / "data" / aside).iterdir()) == sorted(leftover)
    out = capsys.readouterr().out
    assert says in out and "is missing" not in out
    prepare.ensure_builtin(["data/stdlib-4k"], 4096)  # prepared now: nothing more to do
    assert len(made) == 1



def test_a_vocabulary_below_the_one_asked_for_is_stated(corpus, tmp_path, capsys):
    """The tiny corpus has fewer distinct merges than 5,000: the summary states the
    vocabulary reached (the tokenizer's own largest id + 1) beside the one asked for. One
    that reaches it, and a reused tokenizer, say only the vocabulary."""
    manifest = prepare.prepare(str(corpus[0]), str(tmp_path / "big"), vocab_size=5000,
                               val_fraction=0.2)
    tokenizer = Tokenizer.from_file(str(tmp_path / "big" / "tokenizer.json"))
    reached = max(tokenizer.get_vocab().values()) + 1
    assert manifest["vocab_size"] == reached < 5000
    assert f", vocab {reached:,} (asked for 5,000: the tokenizer's training text has no more " \
           f"merges), " in capsys.readouterr().out
    prepare.prepare(str(corpus[0]), str(tmp_path / "small"), vocab_size=300, val_fraction=0.2)
    prepare.prepare(str(corpus[0]), str(tmp_path / "reused"), val_fraction=0.2,
                    tokenizer=str(tmp_path / "big" / "tokenizer.json"))
    assert "asked for" not in capsys.readouterr().out
