"""Shared fixtures: prepared datasets (a slice of the standard library for the loop tests, a
tiny corpus with traps for the data tests) and a micro model config."""

import json
import random
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

import config
import prepare
from data import EOS_TOKEN
from plumbing.overrides import apply_overrides


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory) -> str:
    """~750 KB of standard-library source, a 512-token BPE, prepared once per session."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("email", "json", "http", "importlib"):
        for path in sorted((stdlib / package).glob("*.py")):
            shutil.copy(path, root / f"{package}_{path.stem}.txt")
    out = tmp_path_factory.mktemp("data") / "small"
    prepare.prepare(source=str(root), out_dir=str(out), vocab_size=512, val_fraction=0.1)
    return str(out)


def micro_config(data_dir: str, out_dir: str, **overrides) -> config.TrainConfig:
    """A two-layer model that takes milliseconds per step: for testing the loop itself."""
    model = config.StackConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               intermediate=176, max_seq_len=64, nope_every=2, ce_chunk_size=96)
    cfg = config.TrainConfig(
        model=model, data_dir=data_dir, out_dir=out_dir, seq_len=64, micro_batch_size=4,
        global_batch_tokens=512, total_steps=8, stop_at_step=8, warmup_steps=2,
        decay_fraction=0.25, adamw_peak_lr=1e-2, muon_peak_lr=2e-2, log_every=1,
        eval_every=4, eval_tokens=1024, ckpt_every=4, keep_last_ckpts=5, compile_model="false",
        # fp32 on any CPU: auto would pick bf16 on one that computes it natively
        mixed_precision="no", sample_tokens=8, write_report=False,
        max_epochs=None)  # the tests' corpora are small: a run may read them many times
    return apply_overrides(cfg, overrides)


# README's FSDP2 tolerances against one process (test_fsdp.py, test_cluster.py). The real
# code's differences from the single-process reference, measured on this machine (2 ranks,
# 3 steps, torch 2.13): weights 4.6e-6 (max abs; on embed.weight, where AdamW's first step,
# lr·g / (|g| + 1e-8), turns a 7e-12 rounding difference in a 7e-9 gradient entry into
# 1.3e-6; every other tensor <= 1.8e-7), losses 7.7e-8 and grad norms 5.4e-7 (max
# relative), from summing in another order (micro-batches, reduce-scatter). Each tolerance
# is >= 10x its measured difference, and each negative control lands >= 10x above it.
WEIGHT_TOL, LOSS_RTOL, GRAD_NORM_RTOL = 1e-4, 2e-6, 1e-5


# --- the data tests' tiny corpus (test_data.py, test_prepare.py) -----------------------

def make_corpus(root: Path) -> list[str]:
    """Forty small, distinct "modules" plus the traps; returns the documents prepare must
    keep, in file order."""
    root.mkdir(parents=True)
    kept = []
    for i in range(40):
        rng = random.Random(i)
        lines = [f"def f_{i}_{j}(x):\n    return x * {rng.randint(0, 999)}  # café ☕ 数据\n"
                 for j in range(rng.randint(3, 8))]
        text = f'"""module {i}"""\n' + "".join(lines)
        (root / f"mod_{i:02d}.py").write_text(text, encoding="utf-8")
        kept.append((f"mod_{i:02d}.py", text))
    literal = f"SEPARATOR = '{EOS_TOKEN}'  # text, not a document boundary\n"
    (root / "literal.py").write_text(literal, encoding="utf-8")
    kept.append(("literal.py", literal))
    (root / "latin1.py").write_bytes("nom = 'café'\n".encode("latin-1"))  # skipped
    (root / "blank.py").write_text("\n\n")  # no document
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.py").write_text("password = 1\n")  # hidden: ignored
    return [text for _, text in sorted(kept)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "src"
    return root, make_corpus(root)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "tiny"
    prepare.prepare(str(corpus[0]), str(out), vocab_size=400, shard_tokens=700, val_fraction=0.2)
    return out


def stream(data_dir, split) -> np.ndarray:
    """A split's tokens read straight from the files, without the loader."""
    manifest = json.loads((Path(data_dir) / "manifest.json").read_text())
    return np.concatenate([np.fromfile(Path(data_dir) / s["file"], dtype=manifest["dtype"])
                           for s in manifest["splits"][split]["shards"]]).astype(np.int64)


def documents_of(tokens: np.ndarray, eos_id: int) -> list[list[int]]:
    assert tokens[0] == eos_id  # EOS opens every document, the first one too
    docs = []
    for token in tokens.tolist():
        if token == eos_id:
            docs.append([])
        else:
            docs[-1].append(token)
    return docs


def copy_of(prepared, tmp_path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(prepared, target)
    return target


class KeptForBackward(TorchDispatchMode):
    """Counts the bytes a forward leaves alive: every storage an op makes while the mode is
    on, held by a weak reference, and still alive when asked (`bytes`). Run over a forward
    whose output is kept, that is what autograd keeps for backward, however it keeps it:
    tensors saved by autograd's nodes, and the outputs selective recomputation caches
    outside them (saved-tensor hooks see neither inside a checkpointed region)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.made = {}  # data_ptr -> (weak reference, bytes)
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}  # weights, inputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.exclude:
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def bytes(self) -> int:
        return sum(n for ref, n in self.made.values() if not ref.expired())
