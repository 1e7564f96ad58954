"""A checkpoint's files: write them atomically, read them back exactly on any number of
ranks, without running code; and what a diverging run does to them (`give_up`). Which
checkpoint a run continues is resume.py's.

    out_dir/ckpt/step_0001000/        one training checkpoint
        .metadata, __0_0.distcp, …    the model and both optimizers, a DCP folder
                                      (torch.distributed.checkpoint): each rank writes its own
                                      shards (FSDP2), and a load reshards onto any rank count
        train_state.json              step, tokens seen, the loader's cursor, the config, hashes,
                                      the code revision
        rng_rank<r>.pt                every random generator of rank r

A checkpoint is written into `step_XXXXXXX.tmp` and renamed when every rank is done, so a
crash mid-write leaves the previous checkpoint as the newest complete one; only complete
folders (a bare `step_` + digits name holding train_state.json) are ever resumed from.
`Saver` writes them, blocking the loop or (ckpt_async) in the background.
Nothing here runs code from a checkpoint. What is read, and how: DCP's `.metadata` (a
pickle) through an allowlist of the classes DCP metadata holds (MetadataUnpickler); the
tensor files (`*.distcp`) as DCP reads them, with torch.load(weights_only=True); the
checkpoint's entries that are not tensors (the optimizers' param-group values) with
torch.load(weights_only=True) too, where DCP's default planner would unpickle them whole
(WeightsOnlyLoadPlanner); `rng_rank<r>.pt` with weights_only=True; train_state.json as JSON.
A file or entry any of these refuses stops the run, named (UnsafeCheckpointError).
`read_train_state` reads any format this trainer has written. export.py turns a checkpoint
into files other programs load.

Imports from stacklm: nothing. It takes a model, optimizers and plain values.
"""

import contextlib
import datetime
import errno
import functools
import json
import operator
import os
import pickle
import random
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


# DCP warns that it "assumes the intent is to save in a single process" when no process
# group exists: that is exactly the single-process case.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file refers to code that a checkpoint never holds."""


class DamagedCheckpointError(ValueError):
    """A checkpoint's files cannot be read: truncated, corrupt or missing."""


# ---------------------------------------------------------------------------------------
# Reading DCP folders without running code
# ---------------------------------------------------------------------------------------

# DCP's filesystem reader unpickles `.metadata`, and unpickling can call any importable
# function: a crafted file would run code on resume or export. These are the only globals
# the metadata of a DCP checkpoint refers to (read off real ones), plus torch's dtypes.
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to torch.strided etc.
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def unsafe_error(what: str, held: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what}: holds {held}, which a checkpoint this trainer wrote never does; refusing to "
        f"read it (unpickling it could run code). Delete this checkpoint folder or replace it "
        f"with one this trainer wrote")


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only METADATA_GLOBALS and torch dtypes."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise unsafe_error(str(self.path), f"a reference to {module}.{name}")


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except for the entries that are not tensors (an optimizer's
    param-group values: lr, betas, flags, parameter names): DCP's own unpickles each with
    torch.load(weights_only=False), which runs whatever a crafted entry asks; this one reads
    them with weights_only=True (plain values only) and refuses any other. A refusal is kept
    in `refused`: DCP reports a failed read as its own CheckpointException."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.refused = path, None

    def load_bytes(self, read_item, value):
        fqn = read_item.dest_index.fqn
        try:
            entry = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = unsafe_error(f"{self.path}: entry {fqn}", weights_only_refusal(e))
            raise self.refused from None
        # Where DCP's own puts the value: a flattened name maps to a path in the nested dict.
        *parents, last = self.mappings[fqn] if self.flatten_state_dict else (fqn,)
        functools.reduce(operator.getitem, parents, self.original_state_dict)[last] = entry


def weights_only_refusal(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in a few words ("a reference to
    posix.mkdir"), from its message."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return f"a reference to {found.group(1)}" if found else "more than tensors and plain values"


def read_dcp(state_dict: dict, path: Path):
    """dcp.load into `state_dict` (in place, resharding as needed), reading nothing that could
    run code: the folder's `.metadata` pickle must refer to nothing but METADATA_GLOBALS,
    the tensor files are read as DCP reads them, with torch.load(weights_only=True), and the
    non-tensor entries through WeightsOnlyLoadPlanner."""
    metadata = Path(path) / ".metadata"
    with open(metadata, "rb") as f:
        layout = MetadataUnpickler(f, metadata).load()  # raises UnsafeCheckpointError first
    check_files(layout, Path(path))
    planner = WeightsOnlyLoadPlanner(Path(path))
    try:
        dcp.load(state_dict, checkpoint_id=str(path), planner=planner)
    except dcp.CheckpointException:
        if planner.refused:
            raise planner.refused from None
        raise


def check_files(layout, path: Path):
    """Every file DCP's metadata `layout` says holds a tensor or an entry must be there, and
    at least as long as the last byte it is read to (DCP's own error names neither: a
    missing `__1_0.distcp` is a bare "No such file or directory" from rank 0)."""
    needed = {}
    for where in layout.storage_data.values():
        needed[where.relative_path] = max(needed.get(where.relative_path, 0),
                                          where.offset + where.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise DamagedCheckpointError(f"{file} is missing (.metadata lists it)")
        if file.stat().st_size < size:
            raise DamagedCheckpointError(f"{file} is cut short: {file.stat().st_size:,} bytes, "
                                         f".metadata reads it to byte {size:,}")


def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "ckpt"


def step_path(out_dir, step: int) -> Path:
    return ckpt_root(out_dir) / f"step_{step:07d}"


def complete_checkpoints(out_dir) -> list[Path]:
    """The complete checkpoints in out_dir/ckpt, oldest first: `step_` + digits, holding
    train_state.json (not .tmp, and not one set aside as .damaged, .diverged, ...)."""
    done = sorted(ckpt_root(out_dir).glob("step_*"))
    return [p for p in done if p.name.removeprefix("step_").isdigit()
            and (p / "train_state.json").exists()]


def newest(out_dir) -> str:
    """The newest complete checkpoint's path, for messages, or "none"."""
    return str(find(out_dir, "latest") or "none")


def set_aside(path: Path, reason: str) -> Path:
    """Rename folder `path` (a checkpoint, or a built-in corpus prepare.py cannot use) to
    <name>.<reason> (.<reason>.2, ... if that is taken): never resumed from or read, never
    deleted, never written over."""
    target, n = path.with_name(f"{path.name}.{reason}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{reason}.{n}")
    path.rename(target)
    return target


# Other words for the newest checkpoint: other trainers', and stacklm's own before it was
# named latest (auto, which for precision and compile means what this machine does best).
NEWEST_ELSEWHERE = ("auto", "last", "newest")


def find(out_dir, resume: str) -> Path | None:
    """`resume`: "none", a checkpoint path, or "latest" = the newest complete checkpoint."""
    if resume == "none":
        return None
    if resume == "latest":
        done = complete_checkpoints(out_dir)
        return done[-1] if done else None
    check_spelling(resume)
    if not (Path(resume) / "train_state.json").exists():
        raise FileNotFoundError(f"resume={resume}: no train_state.json there; point it at "
                                f"an out_dir/ckpt/step_XXXXXXX folder")
    return Path(resume)


def check_spelling(resume: str):
    """Refuse a --resume PATH that cannot mean a checkpoint folder, whether or not the run
    reads it: another word for the newest, or a checkpoint's train_state.json."""
    path = Path(resume)
    if resume in NEWEST_ELSEWHERE and not path.exists():
        raise ValueError(f"resume={resume}: the newest checkpoint is --resume=latest here (the "
                         f"default); or name a checkpoint folder, out_dir/ckpt/step_XXXXXXX")
    if path.name == "train_state.json":
        raise ValueError(f"resume={resume} is the checkpoint's train_state.json; name the folder "
                         f"that holds it: --resume={path.parent}")


def unwrapped_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say), blocking or in the background."""


def write_error(step: int, tmp: Path, error: BaseException, how: str) -> CheckpointWriteError:
    """One line for checkpoint `tmp` of `step`, whose write failed `how` ("" or " in the
    background"): the cause, the folder left incomplete, the checkpoint a resume takes
    instead, and the fix. A full disk is named by where it is mounted: the error DCP's
    writer meets names no file."""
    out_dir = tmp.parent.parent
    found = find(out_dir, "latest")
    before = f"the newest complete checkpoint is still {found}" if found else \
        "there is no complete checkpoint before it"
    full = getattr(cause(error), "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = f"once there is room on the disk mounted at {mount_point(tmp)}" if full else \
        "once that is fixed"
    then = ": it resumes from there" if found else " again"
    return CheckpointWriteError(
        f"the checkpoint of step {step} failed while it was written{how}: {failure(error)}; "
        f"{tmp} is incomplete, and {before}; {fix}, run the same command{then}")


@contextlib.contextmanager
def writing(step: int, tmp: Path):
    """A failure to write checkpoint `tmp` of `step` for an OSError (a full disk, a folder
    it may not write), on any rank (DCP's CheckpointException carries each rank's), becomes
    one CheckpointWriteError; any other failure is a bug and keeps its traceback."""
    try:
        yield
    except (OSError, dcp.CheckpointException) as e:  # DCP's is a BaseException
        if not isinstance(cause(e), OSError):
            raise
        raise write_error(step, tmp, e, "") from e


def mount_point(path: Path) -> Path:
    """Where the disk that holds `path` is mounted."""
    path = Path(path).resolve()
    while not os.path.ismount(path):  # Path.is_mount has no Windows version before 3.12
        path = path.parent
    return path


class InFlight(NamedTuple):
    """A checkpoint being written in the background."""
    future: Future  # DCP's: done when every rank's shards and the .metadata are written
    step: int
    tmp: Path  # step_XXXXXXX.tmp, renamed to step_XXXXXXX once the future is done
    prune: tuple  # (out_dir, keep_last, keep_steps), for the pruning after the rename
    started: float  # perf_counter() when its save began
    blocked: float  # seconds the loop waited for it: checks and staging


# How long a leaving rank waits for a background save to finish, and how long any
# collective of that save's own gloo group may wait for the other ranks (gloo's default is 30
# minutes): a rank whose peer died then leaves instead of holding its allocation. Five
# minutes cover a Stack-100M checkpoint (under 1 GB over all ranks) on a slow shared disk.
SAVE_WAIT_S = 300


def stager_for(device: torch.device) -> DefaultStager | None:
    """How a background save stages its copy on `device`. On a CUDA GPU: DCP's DefaultStager
    into pinned host memory, by non-blocking device-to-host copies it waits for before
    `async_save` returns (torchtitan's async_with_pinned_mem, in this process's thread),
    its pinned buffers kept from one save to the next. Elsewhere None, DCP's own default
    (plain memory, blocking copies): a CPU has nothing to copy from a device, and DCP
    refuses non-blocking copies without an accelerator."""
    if device.type != "cuda":
        return None
    # Shared memory is for a writer in another process; staging waits (not async) so that
    # the next optimizer step cannot change what is written.
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=True))


class Saver:
    """Writes the run's checkpoints: each out_dir/ckpt/step_XXXXXXX atomically, in one of two
    ways.

    - Blocking (the default): the loop waits while every byte is written.
    - In the background (ckpt_async, torchtitan's checkpoint.async_mode = "async"): DCP's
      async_save first stages the weights and both optimizers, a copy in memory made before
      `save` returns (on a GPU into pinned host memory: `stager_for`), so the next optimizer
      step cannot change what is written; a thread
      then writes the copy while the loop trains on. It is still written into
      step_XXXXXXX.tmp and renamed (and only then counted, resumed from or pruned) once
      every rank's write is done, which `poll` checks at every step. At most one save is in
      flight: the next save waits for it, and so does a blocking save (the last step's, and
      the one a stop request makes); leaving the `with` block waits too, so the process
      group outlives the write. DCP's background thread runs collectives of its own: over a
      gloo group of their own, which never interleave with the loop's.

    Either way, a write that fails (a full disk) stops the run as one CheckpointWriteError
    (write_error), and the folder stays .tmp. `save` and `poll` return the saves completed
    by the call, (step, seconds the loop waited, seconds the write took), for the log."""

    def __init__(self, accelerator, in_background: bool):
        self.accelerator, self.in_background = accelerator, in_background
        self.in_flight: InFlight | None = None
        self.stager = stager_for(accelerator.device) if in_background else None
        self.group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=SAVE_WAIT_S)) \
            if in_background and dist.is_initialized() else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        try:
            self.leave(exc_type is None)
        finally:
            if self.stager is not None:  # its pinned buffers, once no write reads them
                self.stager.close()

    def leave(self, cleanly: bool):
        """Wait for the save in flight: complete it, or after an error only let it finish."""
        if cleanly:
            self.wait()
        elif self.in_flight is not None:
            # After an error the write is let finish (the process group outlives it), but not
            # counted: the run may have stopped for what those weights hold (a divergence),
            # and other ranks may be gone. It stays .tmp; a resume takes the one before.
            try:
                self.in_flight.future.result(timeout=SAVE_WAIT_S)
            except TimeoutError:
                print(f"checkpoint: the background save of step {self.in_flight.step} did not "
                      f"finish within {SAVE_WAIT_S} s; leaving it incomplete "
                      f"({self.in_flight.tmp})", file=sys.stderr)
            except (Exception, dcp.CheckpointException):
                pass

    def save(self, model, optimizers: list, train_state: dict, out_dir, keep_last: int,
             keep_steps=(), blocking: bool = True) -> list[tuple[int, float, float]]:
        """Write train_state["step"]'s checkpoint; keep the newest `keep_last`, and those of
        `keep_steps` whatever their age. `model` is the unwrapped model, `optimizers` the
        torch optimizers; blocking=False writes it in the background when ckpt_async is on.
        Non-finite weights are never written over a good checkpoint: each rank checks the
        values it holds (its shards under FSDP2) and the sum over ranks covers them all."""
        done = self.wait()
        started, step = time.perf_counter(), train_state["step"]
        accelerator = self.accelerator
        mine = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        finite = all(bool(torch.isfinite(t).all()) for t in mine)
        finite_ranks = accelerator.reduce(torch.tensor(float(finite), device=accelerator.device))
        if finite_ranks.item() < accelerator.num_processes:
            raise RuntimeError(f"step {step}: the weights hold non-finite values; refusing to "
                               f"write a checkpoint over the last good one in "
                               f"{ckpt_root(out_dir)}")
        final = step_path(out_dir, step)
        tmp = final.with_name(final.name + ".tmp")
        optimizers = [unwrapped_optimizer(o) for o in optimizers]
        prune = (out_dir, keep_last, tuple(keep_steps))
        if blocking or not self.in_background:
            with writing(step, tmp):
                self.begin(tmp, train_state)
                write_weights_and_optimizers(model, optimizers, tmp)
            self.complete(tmp, prune)
            seconds = time.perf_counter() - started
            return done + [(step, seconds, seconds)]
        with writing(step, tmp):
            self.begin(tmp, train_state)
        model_sd, optim_sd = get_state_dict(model, optimizers)
        future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                checkpoint_id=str(tmp), process_group=self.group,
                                async_stager=self.stager)
        self.in_flight = InFlight(future, step, tmp, prune, started,
                                  time.perf_counter() - started)
        return done

    def begin(self, tmp: Path, train_state: dict):
        """Make `tmp` afresh and write what DCP does not: each rank's RNG state, and
        train_state.json."""
        accelerator = self.accelerator
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
        if accelerator.is_main_process:
            (tmp / "train_state.json").write_text(json.dumps(train_state, indent=1),
                                                  encoding="utf-8")

    def poll(self) -> list[tuple[int, float, float]]:
        """At every step: completes the save in flight once every rank's write is done (a
        collective while one is in flight, so every rank completes it at the same step)."""
        if self.in_flight is None:
            return []
        done = torch.tensor(float(self.in_flight.future.done()), device=self.accelerator.device)
        if self.accelerator.reduce(done, "sum").item() < self.accelerator.num_processes:
            return []
        return self.wait()

    def wait(self) -> list[tuple[int, float, float]]:
        """Wait for the save in flight, if any, and complete it."""
        if self.in_flight is None:
            return []
        flight, self.in_flight = self.in_flight, None
        try:
            flight.future.result(timeout=SAVE_WAIT_S)
        except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
            if isinstance(e, TimeoutError):  # a rank that never finishes its part
                e = TimeoutError(f"not done within {SAVE_WAIT_S} s")
            raise write_error(flight.step, flight.tmp, e, " in the background") from e
        self.complete(flight.tmp, flight.prune)
        return [(flight.step, flight.blocked, time.perf_counter() - flight.started)]

    def complete(self, tmp: Path, prune: tuple):
        """Every rank has written its part of `tmp`: rename it to its step's name, then
        prune, keeping the newest `keep_last` and every step of `keep_steps`."""
        out_dir, keep_last, keep_steps = prune
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            final = tmp.with_suffix("")
            if final.exists():  # one this run did not resume from (a damaged one, say): kept
                set_aside(final, "replaced")
            tmp.rename(final)
            for old in complete_checkpoints(out_dir)[:-keep_last]:
                if int(old.name.removeprefix("step_")) not in keep_steps:
                    shutil.rmtree(old)
        self.accelerator.wait_for_everyone()


def read_train_state(path: Path) -> dict:
    """The checkpoint's train_state.json in today's layout; DamagedCheckpointError if it
    cannot be read, or is not a train state (a JSON object holding the step)."""
    try:
        state = json.loads((Path(path) / "train_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(f"{path}: train_state.json: {failure(e)}") from e
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)):
        raise DamagedCheckpointError(f"{path}: train_state.json is not a checkpoint's train "
                                     f"state (a JSON object holding its step)")
    return current_layout(state)


def current_layout(state: dict) -> dict:
    """A train_state written before data mixtures (one source, one cursor) as a mixture of
    one: its data_dir read `cursor` windows in stage 0. Such a state names its data by the
    fingerprint of the whole directory (data_sha256), not yet by its tokenizer's sha256;
    one written before the code's revision was recorded says "unknown"."""
    state = {"revision": "unknown", **state}
    loader = state.get("loader", {})
    if "stage_start" in loader or "cursor" not in loader:  # today's, or no loader at all
        return state
    source = state["config"]["data_dir"]
    fingerprints = {source: state["data_sha256"]} if "data_sha256" in state else {}
    loader = {"seq_len": loader["seq_len"], "seed": loader["seed"], "stage_start": 0,
              "cursor": loader["cursor"], "offsets": {source: 0},
              "consumed": {source: loader["cursor"]}, "fingerprints": fingerprints}
    return {"skipped_steps": 0, "stages": [[0, [[source, 1.0]]]], "tokenizer_sha256": None,
            **state, "loader": loader}


def load(accelerator, model, optimizers: list, path: Path):
    """Restore the weights, both optimizers and this rank's RNG from `path`. The rank count
    may differ from the saving run's: DCP reshards the tensors. A folder whose files are
    truncated or corrupt raises DamagedCheckpointError (what was read in place is then
    partial: load another checkpoint over it, which rewrites every tensor)."""
    with reading(path):
        read_weights_and_optimizers(model, [unwrapped_optimizer(o) for o in optimizers], path)
    rng_file = Path(path) / f"rng_rank{accelerator.process_index}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        with reading(rng_file):
            set_rng_state(read_tensors(rng_file))


def read_tensors(path: Path):
    """torch.load with weights_only=True, which unpickles tensors and plain values only. A
    file it refuses holds something else, which a checkpoint never does: it is unsafe (a
    crafted pickle runs code), not merely damaged."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):  # torch's words for "not plain data"
            raise unsafe_error(str(path), weights_only_refusal(e)) from None
        raise


@contextlib.contextmanager
def reading(path: Path):
    """Any failure to read checkpoint `path` becomes one DamagedCheckpointError naming it and
    the cause (DCP's: the first failing rank's own error); a file refused as unsafe stays an
    UnsafeCheckpointError, and a damaged one keeps its message."""
    try:
        yield
    except (UnsafeCheckpointError, DamagedCheckpointError):
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        raise DamagedCheckpointError(f"{path}: {failure(e)}") from e


def cause(error: BaseException) -> BaseException:
    """The error itself; for DCP's CheckpointException, which says only which ranks failed,
    the first failing rank's own."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def failure(error: BaseException) -> str:
    """An error's type and first line; for DCP's CheckpointException, its first failing
    rank's and which rank that is."""
    if cause(error) is not error:
        return f"rank {min(error.failures)}: {failure(cause(error))}"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def write_weights_and_optimizers(model, optimizers: list, path: Path):
    """Every rank writes its shards (all of them when not sharded) into one DCP folder.
    get_state_dict names optimizer state by parameter name, so the two optimizers merge
    into one dict and the folder reshards onto any rank count."""
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def read_weights_and_optimizers(model, optimizers: list, path: Path):
    model_sd, optim_sd = get_state_dict(model, optimizers)
    sd = {"model": model_sd, "optim": optim_sd}
    read_dcp(sd, path)
    # Loading optimizer state also restores every param-group value the checkpoint saved
    # (peak_lr, weight_decay, betas, ...). The config of this run wins: put them back.
    settings = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                for o in optimizers]
    set_state_dict(model, optimizers, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for optimizer, groups in zip(optimizers, settings, strict=True):
        for group, values in zip(optimizer.param_groups, groups, strict=True):
            group.update(values)


def rng_state() -> dict:
    """Every RNG of this rank, as plain lists and tensors so a weights_only load reads it."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": list(random.getstate()[1]),
            "numpy": [keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate((3, tuple(state["python"]), None))
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def read_model(ckpt: Path, model) -> dict:
    """The model weights of checkpoint `ckpt`, read into `model`'s state dict (a freshly
    built model of the checkpoint's shape), whatever the rank count that wrote them."""
    sd = {"model": model.state_dict()}
    with reading(ckpt):
        read_dcp(sd, ckpt)  # reads only the model part
    return sd["model"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stayed non-finite for max_bad_steps steps in a row."""


def give_up(cfg, step: int, streak: int, lrs: dict[str, float], is_main: bool):
    """Stop a run whose loss stayed non-finite for the `streak` steps up to `step`. The
    checkpoint of the step the streak began at, if there is one, holds the weights that gave
    its first non-finite loss: set it aside (renamed .diverged), so a rerun resumes from the
    one before, and name the learning rates to lower."""
    suspect = step_path(cfg.out_dir, step - streak)
    if suspect.exists() and is_main:
        set_aside(suspect, "diverged")
    rates = " ".join(f"{name} {lr:.2e}" for name, lr in lrs.items())
    raise TrainingDiverged(
        f"{streak} consecutive non-finite steps (the last at step {step}, lr {rates}): "
        f"stopping; the newest checkpoint from before them is {newest(cfg.out_dir)}. "
        f"Lower --muon_peak_lr={cfg.muon_peak_lr:g} and --adamw_peak_lr={cfg.adamw_peak_lr:g} "
        f"(or --grad_clip={cfg.grad_clip:g}) and run again: it resumes from there")
