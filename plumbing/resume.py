"""Resume: which checkpoint a run continues, and whether it may.

`candidates` lists the checkpoints a run may continue, newest first (its own, or where a
branched run begins); `check_unfinished` stops a run that would train nothing; `resume`
continues the first one that reads, setting damaged ones aside, and `restore` reads it into
a run. A fresh run with --init_from begins from a public model's weights instead
(`start_from_public_model`), until it has checkpoints of its own. What a resume may change
is decided here too (`check_resume`): the model's shape, the data order and the matrix
optimizer are fixed, a data stage that has begun cannot change, and every other knob given
on the command line wins, said aloud.

Imports from stacklm: checkpoint (a checkpoint's files), cli (NothingToDo, for a run that
would train nothing), config (the differences between two configs) and hf_import (a public
model's weights, where a fresh run with --init_from begins).
"""

from pathlib import Path

from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from config import TrainConfig, differences
from plumbing import checkpoint, hf_import
from plumbing.checkpoint import DamagedCheckpointError, UnsafeCheckpointError, read_train_state
from plumbing.cli import NothingToDo

def candidates(cfg: TrainConfig) -> list[Path]:
    """The checkpoints this run may continue, in the order to try them, by cfg.resume:
    - "latest": every complete checkpoint in out_dir, newest first (`resume` falls back to
      older ones if one is damaged);
    - a path in out_dir's own ckpt folder: that checkpoint, as named (how to go back to one);
    - a path elsewhere: where a branched run (an anneal from the stable run's checkpoint)
      begins, while out_dir holds no checkpoint of its own; once it does, its own, as for
      "latest", so that the same command continues the branch rather than begin it again
      (torchtitan's checkpoint.initial_load_path);
    - "none": a fresh start, refused where it would overwrite checkpoints.
    Checked before anything is built: out_dir and its ckpt/ must be folders (or absent), and
    NothingToDo where the first is already at or past stop_at_step (the run would train
    nothing, and a resume there would only evaluate)."""
    out_dir, setting = Path(cfg.out_dir), cfg.resume
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir={out_dir} is a file, not a directory; choose another --out_dir")
    root = checkpoint.ckpt_root(out_dir)
    if root.exists() and not root.is_dir():  # the user's: kept, and refused before any work
        raise ValueError(f"{root} is a file, where this run keeps its checkpoints (a folder); "
                         f"move the file elsewhere, or choose another --out_dir")
    own = checkpoint.complete_checkpoints(out_dir)[::-1]
    if setting == "none" and own:
        raise ValueError(f"resume=none: out_dir={out_dir} already holds checkpoints (newest "
                         f"{own[0]}) that a fresh run would overwrite; continue them with "
                         f"--resume=latest, or start afresh in a new --out_dir")
    if setting == "none":
        return []
    if setting == "latest":
        found = own
    else:
        checkpoint.check_spelling(setting)
        # A branch's origin is not read once out_dir holds its own (it may be pruned since).
        branched = own and not is_inside(setting, checkpoint.ckpt_root(out_dir))
        found = own if branched else [checkpoint.find(out_dir, setting)]
    check_unfinished(found, cfg.stop_at_step, setting)
    return found


def is_inside(path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def check_unfinished(found: list[Path], stop_at_step: int, setting: str):
    """NothingToDo where the checkpoint a run would continue (the first found) is already at
    or past stop_at_step, read from its train_state.json."""
    try:
        step = read_train_state(found[0])["step"] if found else None
    except DamagedCheckpointError:
        return  # `resume` sets it aside and continues an older one
    if step is not None and step >= stop_at_step:
        fix = "a later --stop_at_step to continue it" if setting != "latest" else \
            "a new --out_dir to train afresh, or a later --stop_at_step to continue it"
        raise NothingToDo(f"nothing to train: {found[0]} is at step {step:,}, and this "
                          f"run stops at stop_at_step={stop_at_step:,}; pass {fix}")


def resume(run, found: list[Path]) -> str | None:
    """Continue `run` from the first checkpoint of `found` (`candidates`) that reads, and
    return its absolute path (None: a fresh start). A damaged one is renamed .damaged, kept
    for a person to look at, and the one before it is tried; a file unsafe to read stops
    the run, and so does a damaged checkpoint the user named (--resume). A branched run
    that continues its own checkpoint rather than the one --resume names says so on the
    line that says where it resumed. Every rank must take the same decision, and a damaged
    or unsafe file may show on one rank only, so the ranks share their verdicts first, each
    with its reason: every rank then acts on the same one, and rank 0 prints it."""
    accelerator, setting = run.accelerator, run.cfg.resume
    for path in found:
        error = None
        try:
            restore(run, path)
        except (DamagedCheckpointError, UnsafeCheckpointError) as e:
            error = e
        unsafe, damaged = shared_verdicts(accelerator, error)
        if unsafe:
            raise UnsafeCheckpointError(unsafe)
        named = setting != "latest" and Path(path).resolve() == Path(setting).resolve()
        if not damaged:
            origin = f"--resume={setting}" if setting != "latest" else \
                f"--init_from={run.cfg.init_from}" if run.cfg.init_from else None
            began = "" if origin is None or named else \
                f" (its own; {origin} is where this run began: to begin there again, use a " \
                f"new --out_dir)"
            accelerator.print(f"resumed from {path} at step {run.step:,}{began}")
            return str(Path(path).resolve())
        if named:
            raise ValueError(f"resume={setting} cannot be read: {damaged}; restore the file, "
                             f"or name another checkpoint (--resume=latest sets this one aside "
                             f"as .damaged and continues the newest that reads)")
        accelerator.wait_for_everyone()  # every rank is done reading it
        if accelerator.is_main_process:
            kept = checkpoint.set_aside(path, "damaged")
            print(f"warning: skipping damaged checkpoint: {damaged}; kept as {kept}")
        accelerator.wait_for_everyone()
    if found:
        raise ValueError(f"no checkpoint in {checkpoint.ckpt_root(run.cfg.out_dir)} can be read "
                         f"(see the warnings above; each is kept as .damaged); --resume=none "
                         f"starts afresh")
    if run.cfg.init_from:
        start_from_public_model(run)
    return None


def start_from_public_model(run):
    """A fresh run with --init_from: the transformers folder's weights (as fp32 master
    weights) into the model, sharded or not. Everything else starts as any fresh run does:
    step 0, empty optimizers, the schedule's warmup."""
    folder = run.cfg.init_from
    weights = hf_import.read_weights(folder, run.cfg.model)
    set_model_state_dict(run.accelerator.unwrap_model(run.model), weights,
                         options=StateDictOptions(full_state_dict=True))
    architecture = hf_import.read_config(folder)["architectures"][0]
    run.accelerator.print(f"init: {architecture} weights from {folder}; step 0, the optimizers "
                          f"fresh, the warmup from its start")


def shared_verdicts(accelerator, error: Exception | None) -> tuple[str | None, str | None]:
    """(the first unsafe refusal, the first damage) any rank met reading a checkpoint, each
    as its message, with the rank where there are several; None where no rank met one."""
    verdicts = gather_object([(isinstance(error, UnsafeCheckpointError),
                               None if error is None else str(error))])  # one per rank
    several = len(verdicts) > 1

    def first(unsafe: bool) -> str | None:
        return next((f"{message} (rank {rank})" if several else message
                     for rank, (kind, message) in enumerate(verdicts)
                     if message is not None and kind == unsafe), None)
    return first(True), first(False)


def restore(run, path: Path):
    """Weights, optimizers, RNGs and the run's counters and loader cursor from checkpoint
    `path`, on any rank count (DCP reshards; the cursor counts global windows). Knobs given
    now win, except those that cannot change; data stages may change only where they have
    not begun."""
    state = read_train_state(path)
    lines, run.facts.resume_changes = check_resume(run.cfg, run.stages, state)
    run.accelerator.print("\n".join(lines), end="\n" if lines else "")
    run.load_state_dict(state)  # the loader refuses changed sources: before any I/O
    checkpoint.load(run.accelerator, run.accelerator.unwrap_model(run.model),
                    list(run.optimizers.named.values()), path)


# What a resume may not change: the model's shape (the weights would not fit), the order the
# data is read in (the loader's cursor counts windows of this seq_len and this seed's
# shuffle), and which optimizer holds the matrices (its state is in the checkpoint). The
# data itself may change only in stages not yet begun (check_stages). Every other knob
# given on a resume's command line takes effect.
FIXED_ON_RESUME = ("model.", "seq_len", "seed", "matrix_optimizer")


def resume_changes(cfg: TrainConfig, saved: dict) -> list[tuple[str, object, object]]:
    """(knob, checkpoint's value, this run's value) for each knob that differs from the
    checkpoint's config `saved`; a ValueError naming every fixed knob that differs."""
    changed = [(k, old, new) for k, old, new in differences(cfg, saved) if k != "resume"]
    fixed = [f"{k} {old!r} → {new!r}" for k, old, new in changed if k.startswith(FIXED_ON_RESUME)]
    if fixed:
        raise ValueError(f"resume: {', '.join(fixed)} cannot change on a resume (the weights, "
                         f"the data order and the optimizer state are the checkpoint's); "
                         f"resume with the checkpoint's values or start a fresh --out_dir")
    return changed


def check_resume(cfg: TrainConfig, stages: list, state: dict) -> tuple[list[str], list]:
    """A resume of checkpoint state `state` (its train_state.json) by a run of `cfg` reading
    `stages`: the lines to print (stages added or edited, knobs changed) and the changed
    knobs, (knob, checkpoint's value, this run's value). Refuses what cannot change."""
    lines = check_stages(state["stages"], stages, state["step"])
    changes = resume_changes(cfg, state["config"])
    return lines + [f"resume: {name} {old} → {new}" for name, old, new in changes], changes


def check_stages(saved: list, stages: list, step: int) -> list[str]:
    """A resume at optimizer step `step` has begun every saved stage that starts before it:
    those must be as they were (refused otherwise, naming the stage and each change). A
    stage from `step` on has not been read yet: it may be added or edited; returns a line
    for each such change, for the run to print."""
    def text(stage):
        return ",".join(f"{d}:{w:g}" for d, w in stage[1])
    saved = {start: tuple(map(tuple, sources)) for start, sources in saved}
    ours = {start: sources for start, sources in stages}
    begun = [s for s in sorted(set(saved) | set(ours)) if s < step]
    changed = [f"the stage from step {s:,}: {text((s, saved[s])) if s in saved else 'none'} → "
               f"{text((s, ours[s])) if s in ours else 'none'}"
               for s in begun if saved.get(s) != ours.get(s)]
    if changed:
        raise ValueError(f"resume at step {step:,}: {'; '.join(changed)}: a stage that has begun "
                         f"cannot change (its windows are already trained on); change only "
                         f"stages from step {step:,} on, or start a fresh --out_dir")
    return [f"resume: data stage from step {s:,} {'changed' if s in saved else 'added'}: "
            f"{text((s, ours[s]))}" for s in sorted(ours) if s >= step and saved.get(s) != ours[s]]
