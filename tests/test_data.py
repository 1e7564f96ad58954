"""data.py: prepare a tiny corpus in a temp dir, then check the loader, the manifest readers
and verify against plain-Python recomputations, round trips and invariants. The corpus,
its prepared directory and the plain shard readers live in conftest.py, shared with
test_prepare.py."""

import collections
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

import data
from conftest import copy_of, documents_of, stream
from data import PackedShardLoader
from plumbing import shards

T = 16  # loader tests use short windows so an epoch is a few hundred of them


def rows(batch) -> list[tuple]:
    return [tuple(r) for r in batch["input_ids"].tolist()]


# ---------------------------------------------------------------------------------------
# Loader: packing, EOS policy, order, ranks, resume
# ---------------------------------------------------------------------------------------

def expected_ids(row: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    """seq_ids and position_ids of one row by a plain loop over its tokens."""
    seq_ids, position_ids, seq, start = [], [], 0, 0
    for t, token in enumerate(row):
        if t > 0 and token == eos_id:
            seq, start = seq + 1, t
        seq_ids.append(seq)
        position_ids.append(t - start)
    return seq_ids, position_ids


def test_position_and_seq_ids_match_a_plain_loop(prepared):
    loader = PackedShardLoader(prepared, "train", T, micro_batch_size=8)
    eos_id = loader.eos_id
    for _ in range(30):
        batch = next(loader)
        assert all(v.shape == (8, T) and v.dtype == torch.int64 for v in batch.values())
        for b, row in enumerate(batch["input_ids"].tolist()):
            seq_ids, position_ids = expected_ids(row, eos_id)
            assert batch["seq_ids"][b].tolist() == seq_ids
            assert batch["position_ids"][b].tolist() == position_ids


def test_eos_policy_every_target_is_predicted(prepared, capsys):
    """EOS opens the next document: the token before it predicts EOS, EOS predicts that
    document's first token, and no target is ignored."""
    tokens = stream(prepared, "val")
    n = (len(tokens) - 1) // T
    loader = PackedShardLoader(prepared, "val", T, micro_batch_size=n)  # the whole split
    eos_id = loader.eos_id
    batch = next(loader)
    inputs, targets = batch["input_ids"], batch["targets"]
    assert (targets >= 0).all()
    for b in range(n):  # val is unshuffled: row b is window b
        assert inputs[b].tolist() == tokens[b * T:b * T + T].tolist()
        assert targets[b].tolist() == tokens[b * T + 1:b * T + T + 1].tolist()
    at_eos = inputs == eos_id
    assert at_eos[:, 1:].any()
    assert (batch["position_ids"][at_eos] == 0).all()
    before_eos = torch.zeros_like(at_eos)
    before_eos[:, :-1] = at_eos[:, 1:]
    assert (targets[before_eos] == eos_id).all()  # the end of a document is predicted
    assert (targets[at_eos] != eos_id).all()  # EOS predicts the next document's opening
    assert torch.equal(next(loader)["input_ids"], inputs)  # val rereads, unshuffled...
    assert capsys.readouterr().out == ""  # ...and quietly: evaluation wraps by design


def test_an_epoch_visits_every_window_once(prepared):
    tokens = stream(prepared, "train")
    loader = PackedShardLoader(prepared, "train", T, micro_batch_size=1, seed=7)
    n = loader.windows_per_epoch
    assert n == (len(tokens) - 1) // T and loader.tokens_per_epoch == n * T
    windows = [tuple(tokens[i * T:i * T + T].tolist()) for i in range(n)]
    seen = [rows(next(loader))[0] for _ in range(n)]
    assert collections.Counter(seen) == collections.Counter(windows)
    assert seen != windows  # shuffled
    assert loader.epoch == 1


def test_order_is_seeded_and_changes_between_epochs(prepared):
    def epoch_rows(seed, epoch):
        loader = PackedShardLoader(prepared, "train", T, micro_batch_size=1, seed=seed)
        loader.load_state_dict({**loader.state_dict(), "cursor": epoch * loader.windows_per_epoch})
        return [rows(next(loader))[0] for _ in range(20)]

    assert epoch_rows(1, 0) == epoch_rows(1, 0)
    assert epoch_rows(1, 0) != epoch_rows(2, 0)
    assert epoch_rows(1, 0) != epoch_rows(1, 1)


def test_each_epoch_begun_is_noted_once_for_the_log(prepared):
    """Every rank notes the same epochs (the log prints rank 0's), each once, in order, also
    when one micro-batch spans several epochs of a tiny split."""
    loaders = [PackedShardLoader(prepared, "train", T, 7, rank=r, world_size=2) for r in (0, 1)]
    n = loaders[0].windows_per_epoch
    for _ in range(2 * n // 14 + 2):
        for loader in loaders:
            next(loader)
    assert [loader.take_new_epochs() for loader in loaders] == [[1, 2], [1, 2]]
    assert loaders[0].take_new_epochs() == [] and loaders[0].epoch == 2
    wide = PackedShardLoader(prepared, "train", T, 3 * n + 1)  # one batch, epochs 0 to 3
    next(wide)
    next(wide)
    assert wide.take_new_epochs() == [1, 2, 3, 4, 5, 6] and wide.epoch == 6


def global_stream(prepared, micro_batch_size, world_size, steps, state=None):
    """Rows of `steps` global micro-batches, ranks in order, as one flat list."""
    loaders = [PackedShardLoader(prepared, "train", T, micro_batch_size, r, world_size, seed=3)
               for r in range(world_size)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    flat = [row for _ in range(steps) for loader in loaders for row in rows(next(loader))]
    assert len({json.dumps(loader.state_dict()) for loader in loaders}) == 1  # one cursor
    return flat, loaders[0].state_dict()


def test_ranks_together_see_the_single_rank_stream(prepared):
    n = PackedShardLoader(prepared, "train", T, 1).windows_per_epoch
    steps = 2 * n // 6 + 3  # past two epoch boundaries
    single, _ = global_stream(prepared, 6, 1, steps)
    for micro_batch_size, world_size in [(3, 2), (2, 3), (1, 6)]:
        assert global_stream(prepared, micro_batch_size, world_size, steps)[0] == single


def test_resume_at_a_random_cursor_under_another_world_size(prepared):
    n = PackedShardLoader(prepared, "train", T, 1).windows_per_epoch
    reference, _ = global_stream(prepared, 6, 1, 2 * n // 6 + 6)
    rng = random.Random(0)
    for _ in range(3):
        steps = rng.randrange(1, 2 * n // 6)
        before, state = global_stream(prepared, 3, 2, steps)
        state = json.loads(json.dumps(state))  # it travels in train_state.json
        assert state["cursor"] == 6 * steps
        after, _ = global_stream(prepared, 2, 3, 6, state=state)
        assert before + after == reference[:len(before) + len(after)]


def test_shard_boundaries_are_invisible(prepared):
    tokens = stream(prepared, "train")
    loader = PackedShardLoader(prepared, "train", 100, micro_batch_size=1)
    # window 6 covers tokens 600..700, which cross the 700-token shard boundary
    for window in (6, 13, loader.windows_per_epoch - 1):
        out = np.empty(101, dtype=np.int64)
        loader.read(window * 100, out)
        assert out.tolist() == tokens[window * 100:window * 100 + 101].tolist()


def test_uint32_shards_give_the_same_batches(prepared, tmp_path):
    wide = copy_of(prepared, tmp_path)
    manifest = json.loads((wide / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = wide / shard["file"]
            raw = np.fromfile(path, dtype=np.uint16).astype(np.uint32).tobytes()
            path.write_bytes(raw)
            shard["sha256"] = hashlib.sha256(raw).hexdigest()
    manifest["dtype"] = "uint32"
    (wide / "manifest.json").write_text(json.dumps(manifest))
    shards.verify(wide)
    narrow_loader = PackedShardLoader(prepared, "train", T, 4)
    wide_loader = PackedShardLoader(wide, "train", T, 4)  # other bytes: another shuffle
    for first in range(0, 20, 4):
        windows = np.arange(first, first + 4)
        narrow, wide_batch = narrow_loader.batch(windows), wide_loader.batch(windows)
        assert all(torch.equal(narrow[k], wide_batch[k]) for k in narrow)
    assert shards.token_dtype(65536) == np.uint16 and shards.token_dtype(65537) == np.uint32


# ---------------------------------------------------------------------------------------
# Reading a prepared directory
# ---------------------------------------------------------------------------------------

def test_token_bytes_sum_to_the_utf8_length_of_each_document(prepared):
    sizes = data.token_bytes(prepared)
    manifest = shards.load_manifest(prepared)
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(prepared))
    assert sizes.shape == (manifest["vocab_size"],) and sizes.dtype == torch.int64
    assert sizes[manifest["eos_id"]] == 0
    for doc in documents_of(stream(prepared, "train"), manifest["eos_id"])[:10]:
        text = tokenizer.decode(doc, skip_special_tokens=False)
        assert int(sizes[doc].sum()) == len(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------
# Bad input: clear errors that name the file and the fix
# ---------------------------------------------------------------------------------------

def test_missing_data_dir_suggests_the_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python prepare.py --vocab_size 4096"):
        PackedShardLoader(tmp_path / "stdlib-4k", "train", T, 1)
    with pytest.raises(FileNotFoundError, match="python prepare.py --source"):
        shards.load_manifest(tmp_path / "mine")


def test_corrupt_or_foreign_manifest_is_refused(prepared, tmp_path):
    bad = copy_of(prepared, tmp_path)
    (bad / "manifest.json").write_text("{truncated")
    with pytest.raises(ValueError, match="manifest.json is unreadable"):
        shards.load_manifest(bad)
    manifest = shards.load_manifest(prepared)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99"):
        shards.load_manifest(bad)


def test_shard_size_mismatch_and_truncation(prepared, tmp_path):
    bad = copy_of(prepared, tmp_path)
    shard = bad / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="train_00001.bin is truncated.*python prepare.py"):
        PackedShardLoader(bad, "train", T, 1)
    shard.write_bytes((prepared / "train_00001.bin").read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match="train_00001.bin is larger than the manifest says"):
        PackedShardLoader(bad, "train", T, 1)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="train_00001.bin is missing"):
        PackedShardLoader(bad, "train", T, 1)


def flip_bytes(path: Path, offset: int, count: int):
    """Corrupt a file in place, keeping its size: only a checksum can tell."""
    raw = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def rewrite_shard(data_dir: Path, name: str, tokens: np.ndarray):
    """Replace a shard and record its new sha256, as a foreign but self-consistent file."""
    raw = tokens.tobytes()
    (data_dir / name).write_bytes(raw)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if shard["file"] == name:
                shard["sha256"] = hashlib.sha256(raw).hexdigest()
    (data_dir / "manifest.json").write_text(json.dumps(manifest))


def test_loader_refuses_a_shard_changed_after_prepare(prepared, tmp_path):
    shards.verify(prepared)  # the prepared directory passes as written
    bad = copy_of(prepared, tmp_path)
    flip_bytes(bad / "train_00001.bin", 100, 64)  # same size: the size check cannot tell
    message = (r"train_00001.bin: sha256 does not match manifest.json \(the file changed "
               r"after it was prepared.*python prepare.py.*or restore the file")
    with pytest.raises(ValueError, match=message):
        PackedShardLoader(bad, "train", T, 1)
    PackedShardLoader(bad, "val", T, 1)  # only the split opened is hashed
    with pytest.raises(ValueError, match=message):
        shards.verify(bad)


def test_loader_refuses_ids_beyond_the_vocabulary(prepared, tmp_path):
    bad = copy_of(prepared, tmp_path)
    vocab_size = shards.load_manifest(prepared)["vocab_size"]
    tokens = np.fromfile(bad / "val_00000.bin", dtype=np.uint16)
    tokens[-1] = vocab_size + 1000  # the very last id: the whole file is scanned
    rewrite_shard(bad, "val_00000.bin", tokens)
    message = (f"val_00000.bin holds token id {vocab_size + 1000} but the tokenizer has "
               f"{vocab_size:,} ids")
    with pytest.raises(ValueError, match=message):
        PackedShardLoader(bad, "val", T, 1)
    with pytest.raises(ValueError, match=message):
        shards.verify(bad)
    tokens[-1] = vocab_size - 1  # the largest id the embedding has a row for
    rewrite_shard(bad, "val_00000.bin", tokens)
    PackedShardLoader(bad, "val", T, 1)


def test_scan_reads_in_chunks_and_matches_whole_file_oracles(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "VERIFY_CHUNK_BYTES", 64)  # many chunks and a partial last one
    for dtype in (np.uint16, np.uint32):
        tokens = np.random.default_rng(0).integers(0, 1000, 1001).astype(dtype)
        for where in (0, 500, 1000):  # the largest id in the first, a middle, the last chunk
            tokens[where] = 5000
            path = tmp_path / f"shard_{where}.bin"
            path.write_bytes(tokens.tobytes())
            digest, largest = shards.scan_shard(path, np.dtype(dtype))
            assert digest == hashlib.sha256(tokens.tobytes()).hexdigest()
            assert largest == 5000
            tokens[where] = 0
    (tmp_path / "empty.bin").write_bytes(b"")
    assert shards.scan_shard(tmp_path / "empty.bin", np.dtype(np.uint16)) == (
        hashlib.sha256(b"").hexdigest(), -1)


def test_each_shard_is_hashed_once_until_it_changes(prepared, tmp_path, monkeypatch):
    """Once in this process (the val loader is rebuilt at every evaluation), and once across
    processes through checked.json (other ranks, restarts); a changed shard is hashed again
    and refused."""
    fresh = copy_of(prepared, tmp_path)
    (fresh / shards.CHECKED).unlink(missing_ok=True)
    real_scan, scanned = shards.scan_shard, []

    def counting_scan(path, dtype):
        scanned.append(path.name)
        return real_scan(path, dtype)

    monkeypatch.setattr(shards, "scan_shard", counting_scan)
    monkeypatch.setattr(shards, "_verified_shards", set())
    val_files = [s["file"] for s in shards.load_manifest(fresh)["splits"]["val"]["shards"]]
    for _ in range(3):  # as train.py rebuilds the val loader at every evaluation
        PackedShardLoader(fresh, "val", T, 1)
    assert scanned == val_files
    assert sorted(json.loads((fresh / shards.CHECKED).read_text())) == sorted(val_files)
    scanned.clear()
    monkeypatch.setattr(shards, "_verified_shards", set())  # a new process: only the record
    PackedShardLoader(fresh, "val", T, 1)
    assert scanned == []
    flip_bytes(fresh / "val_00000.bin", 0, 64)
    stat = (fresh / "val_00000.bin").stat()  # a later mtime, as a real edit would leave
    os.utime(fresh / "val_00000.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="val_00000.bin: sha256 does not match"):
        PackedShardLoader(fresh, "val", T, 1)
    assert scanned == ["val_00000.bin"]  # the changed file only
    scanned.clear()
    shutil.copy(prepared / "val_00000.bin", fresh / "val_00000.bin")
    shards.verify(fresh)  # --verify hashes every shard, remembered or not
    assert len(scanned) == len(list(fresh.glob("*.bin")))


def test_a_read_only_data_dir_is_checked_without_a_record(prepared, tmp_path, monkeypatch):
    fresh = copy_of(prepared, tmp_path)
    (fresh / shards.CHECKED).unlink(missing_ok=True)
    monkeypatch.setattr(shards, "_verified_shards", set())
    fresh.chmod(0o555)
    try:
        if os.access(fresh, os.W_OK):  # root ignores the mode bits: nothing to test there
            monkeypatch.setattr(shards.os, "replace", lambda *a: (_ for _ in ()).throw(
                PermissionError(13, "Read-only file system")))
        PackedShardLoader(fresh, "val", T, 1)
    finally:
        fresh.chmod(0o755)
    assert not (fresh / shards.CHECKED).exists() and not list(fresh.glob("*.tmp"))


def test_fingerprint_names_the_prepared_data(prepared):
    manifest = shards.load_manifest(prepared)
    fingerprint = shards.fingerprint(manifest)
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    assert shards.fingerprint(json.loads(json.dumps(manifest))) == fingerprint  # a reread
    assert shards.fingerprint({**manifest, "source": "elsewhere"}) == fingerprint  # not identity
    for split in ("train", "val"):
        for i in range(len(manifest["splits"][split]["shards"])):
            for field, value in (("sha256", "0" * 64), ("tokens", 1), ("file", "x.bin")):
                other = json.loads(json.dumps(manifest))
                other["splits"][split]["shards"][i][field] = value
                assert shards.fingerprint(other) != fingerprint, (split, i, field)
    other = json.loads(json.dumps(manifest))
    other["tokenizer"]["sha256"] = "0" * 64
    assert shards.fingerprint(other) != fingerprint
    every = [s for split in ("train", "val") for s in manifest["splits"][split]["shards"]]
    other = {**manifest, "splits": {"train": {"shards": []}, "val": {"shards": every}}}
    assert shards.fingerprint(other) != fingerprint  # the same shards, in order, but all val


def test_train_order_is_the_documented_permutation(prepared):
    """Epoch e visits windows in default_rng([seed, e, *fingerprint]).permutation order, the
    fingerprint's first 32 hex digits as four 32-bit words: saved cursors mean the same
    windows only while this holds, so it is pinned against the plain reader."""
    tokens = stream(prepared, "train")
    loader = PackedShardLoader(prepared, "train", T, micro_batch_size=4, seed=11)
    digits = shards.fingerprint(shards.load_manifest(prepared))[:32]
    words = [int(digits[i:i + 8], 16) for i in (0, 8, 16, 24)]
    order = np.random.default_rng([11, 0, *words]).permutation(loader.windows_per_epoch)
    for step in range(5):
        windows = order[step * 4:step * 4 + 4]
        expected = np.stack([tokens[w * T:w * T + T + 1] for w in windows])  # (B, T+1)
        batch = next(loader)
        assert np.array_equal(batch["input_ids"].numpy(), expected[:, :-1])
        assert np.array_equal(batch["targets"].numpy(), expected[:, 1:])


def test_tokenizer_whose_hash_differs_from_the_manifest(prepared, tmp_path):
    bad = copy_of(prepared, tmp_path)
    (bad / "tokenizer.json").write_text((prepared / "tokenizer.json").read_text() + "\n")
    with pytest.raises(ValueError, match="tokenizer.json has sha256.*another tokenizer"):
        shards.tokenizer_path(bad)
    with pytest.raises(ValueError, match="tokenizer.json has sha256"):
        shards.verify(bad)


def test_seq_len_longer_than_the_split_names_the_real_fix(prepared):
    """A val split too small for one window is fixed by preparing a larger one
    (--val_fraction); a train split by more data. Lowering seq_len is the other way."""
    val_tokens = shards.load_manifest(prepared)["splits"]["val"]["tokens"]
    with pytest.raises(ValueError, match=f"split 'val' of {prepared} has {val_tokens:,} tokens, "
                                         f"too few for one window of seq_len={val_tokens}.*"
                                         f"larger --val_fraction.*or lower --seq_len"):
        PackedShardLoader(prepared, "val", val_tokens, 1)
    PackedShardLoader(prepared, "val", val_tokens - 1, 1)  # exactly one window fits
    train_tokens = shards.load_manifest(prepared)["splits"]["train"]["tokens"]
    with pytest.raises(ValueError, match="split 'train'.*prepare a larger corpus, or lower"):
        PackedShardLoader(prepared, "train", train_tokens, 1)


def test_vocab_too_large_for_the_dtype(prepared, tmp_path):
    bad = copy_of(prepared, tmp_path)
    manifest = shards.load_manifest(prepared)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 70_000}))
    with pytest.raises(ValueError, match="vocab_size=70,000 does not fit dtype uint16"):
        PackedShardLoader(bad, "train", T, 1)


def test_bad_loader_arguments_and_foreign_state(prepared):
    with pytest.raises(ValueError, match="split 'test' is not in"):
        PackedShardLoader(prepared, "test", T, 1)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        PackedShardLoader(prepared, "train", T, 1, rank=2, world_size=2)
    state = PackedShardLoader(prepared, "train", T, 1, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        PackedShardLoader(prepared, "train", T, 1, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len=16"):
        PackedShardLoader(prepared, "train", T + 1, 1, seed=1).load_state_dict(state)
