"""Checkpoints: save and resume a run exactly, on any number of ranks; export the weights.

    out_dir/ckpt/step_0001000/        one training checkpoint
        .metadata, __0_0.distcp, …    the model and both optimizers, a torch.distributed.checkpoint
                                      (DCP) folder: each rank writes its own shards (FSDP2), and a
                                      load reshards onto any rank count
        train_state.json              step, tokens seen, the loader's cursor, the config, hashes
        rng_rank<r>.pt                every random generator of rank r
    out_dir/export/                   model.pt + config.json + tokenizer.json, for sample.py

A checkpoint is written into `step_XXXXXXX.tmp` and renamed when every rank is done, so a
crash mid-write leaves the previous checkpoint as the newest complete one; only complete
folders (a bare `step_` + digits name holding train_state.json) are ever resumed from.

This file imports nothing else from stacklm: it takes a model, optimizers and plain values.
"""

import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

# DCP warns that it "assumes the intent is to save in a single process" when no process
# group exists: that is exactly the single-process case.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")


def ckpt_root(out_dir) -> Path:
    return Path(out_dir) / "ckpt"


def complete_checkpoints(out_dir) -> list[Path]:
    """The complete checkpoints in out_dir/ckpt, oldest first."""
    done = sorted(ckpt_root(out_dir).glob("step_[0-9]*[0-9]"))
    return [p for p in done if (p / "train_state.json").exists()]


def find(out_dir, resume: str) -> Path | None:
    """`resume`: "none", a checkpoint path, or "auto" = the newest complete checkpoint."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "train_state.json").exists():
            raise FileNotFoundError(f"resume={resume}: no train_state.json there; point it at "
                                    f"an out_dir/ckpt/step_XXXXXXX folder")
        return path
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None


def unwrapped_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def save(accelerator, model, optimizers: list, train_state: dict, out_dir,
         keep_last: int) -> Path:
    """Write train_state["step"]'s checkpoint atomically; keep the newest `keep_last`.

    `model` is the unwrapped model; `optimizers` the torch optimizers. Non-finite weights
    are never written over a good checkpoint: each rank checks the values it holds (its
    shards under FSDP2) and the sum over ranks covers them all."""
    step = train_state["step"]
    mine = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    finite = all(bool(torch.isfinite(t).all()) for t in mine)
    finite_ranks = accelerator.reduce(torch.tensor(float(finite), device=accelerator.device))
    if finite_ranks.item() < accelerator.num_processes:
        raise RuntimeError(f"step {step}: the weights hold non-finite values; refusing to "
                           f"write a checkpoint over the last good one in {ckpt_root(out_dir)}")
    final = ckpt_root(out_dir) / f"step_{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write_weights_and_optimizers(model, [unwrapped_optimizer(o) for o in optimizers], tmp)
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, model, optimizers: list, path: Path) -> dict:
    """Restore the weights, both optimizers and this rank's RNG from `path`; return its
    train_state for the caller to restore the step, the counters and the data cursor. The
    rank count may differ from the saving run's: DCP reshards the tensors."""
    state = json.loads((Path(path) / "train_state.json").read_text())
    read_weights_and_optimizers(model, [unwrapped_optimizer(o) for o in optimizers], path)
    rng_file = Path(path) / f"rng_rank{accelerator.process_index}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved
        set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def write_weights_and_optimizers(model, optimizers: list, path: Path):
    """Every rank writes its shards (all of them when not sharded) into one DCP folder.
    get_state_dict names optimizer state by parameter name, so the two optimizers merge
    into one dict and the folder reshards onto any rank count."""
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def read_weights_and_optimizers(model, optimizers: list, path: Path):
    model_sd, optim_sd = get_state_dict(model, optimizers)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path))  # fills sd in place, resharding as needed
    set_state_dict(model, optimizers, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


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


def export(ckpt: Path, model, model_config: dict, tokenizer_file, out_dir) -> Path:
    """out_dir/export/{model.pt, config.json, tokenizer.json} from checkpoint `ckpt`: one
    consolidated file that sample.py loads, whatever the rank count that trained it.
    `model` is a freshly built model of the checkpoint's shape, filled from the checkpoint."""
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt))  # reads only the model part
    out = Path(out_dir) / "export"
    tmp = out.with_name("export.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(sd["model"], tmp / "model.pt")
    (tmp / "config.json").write_text(json.dumps(model_config, indent=1))
    shutil.copy(tokenizer_file, tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
