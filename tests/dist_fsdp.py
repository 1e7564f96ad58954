"""torchrun worker for tests/test_fsdp.py: train.py's FSDP2 path on CPU with gloo.

    python -m torch.distributed.run --nproc_per_node=N tests/dist_fsdp.py ACTION DATA OUT

Every action builds the run as `train.setup` does under FSDP2 and trains it with the loop's
own `train.train_step`: an `accelerate.Accelerator(cpu=True)` with the config's gradient
accumulation, `train.build_model` + `train.shard_model`, `optim.build_optimizers`, this
rank's `MaskedLoader`, a `train.Run`. The model never goes through `accelerator.prepare`:
accelerate does not shard on CPU (it would wrap the sharded model in DDP over gloo), so
`shard_model` is the whole of FSDP2 here, as it is on GPUs.

ACTION
  train               STEPS steps of `fsdp_config` with every block selectively recomputed;
                      rank 0 writes each step's loss and pre-clip grad norm to OUT/train.json
                      and the full weights to OUT/weights.pt, and every rank writes what
                      accelerate reports about the world, and whether block 0 was resharded
                      after its forward (FSDP_RESHARD_AFTER_FORWARD, as the launch config
                      sets it), to OUT/world_<rank>.json. Then the two negative controls, the
                      same way into OUT/<mistake>: mean_of_means normalises every
                      micro-batch's loss by its own target count (a mean of micro-batch
                      means, the mistake global-token normalisation exists to avoid);
                      half_gradient gives every backward half the loss (the gradient is off
                      by a constant factor; the logged loss is not).
  save                trains STEPS steps, writes a sharded checkpoint to OUT/ckpt with
                      checkpoint.py's own writer, and rank 0 writes the full weights and
                      optimizer state to OUT/reference.pt, and the sharded model's
                      `logits` and greedy `generate` of a prompt to OUT/outputs.pt.
  load                builds a fresh sharded model on this number of ranks, loads OUT/ckpt, and
                      rank 0 writes whether the full weights and optimizer state equal
                      OUT/reference.pt to OUT/load_<N>.json.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from conftest import micro_config  # noqa: E402
from plumbing import checkpoint, launch, log, shards  # noqa: E402

STEPS = 3


def fsdp_config(data_dir: str, out_dir: str, **overrides):
    """768 tokens per step = 12 windows of 64 = 2 per micro-batch x 3 accum x 2 ranks
    (2 x 2 accum x 3 ranks for `load`; 12 x 1 x 1 rank for test_fsdp's reference)."""
    return micro_config(data_dir, out_dir, **{"micro_batch_size": 2, "global_batch_tokens":
                                              64 * 12, "stop_at_step": STEPS, **overrides})


class MaskedLoader(data.MixtureLoader):
    """The real loader with each row's first (first input id mod seq_len) targets ignored
    (-100), as padding or prompt tokens would be: micro-batches then hold anywhere from 2 to
    128 targets, so a mean of per-micro-batch means weights tokens differently from the
    global mean. The rule reads only the row's own tokens, so every rank count and every
    micro-batch size masks the same tokens of the global batch."""

    def __next__(self):
        batch = super().__next__()
        cut = batch["input_ids"][:, 0] % self.seq_len  # (B,)
        masked = torch.arange(self.seq_len)[None, :] < cut[:, None]  # (B, T)
        return batch | {"targets": batch["targets"].masked_fill(masked, -100)}


def normalise_each_micro_batch(model, cfg):
    """The negative control's mistake, by a forward hook: each micro-batch's summed loss
    becomes its own mean (times the fixed B·T, so the scale stays that of the right loss),
    i.e. train_step then averages per-micro-batch means."""
    full = cfg.micro_batch_size * cfg.seq_len

    def hook(module, args, kwargs, output):
        n_local = (kwargs["targets"] != -100).sum()
        return type(output)(output.loss * full / n_local, output.ce, output.z)

    model.register_forward_hook(hook, with_kwargs=True)


def halve_gradients(accelerator):
    """The other negative control's mistake: a loss scale off by 2 in the backward pass."""
    backward = accelerator.backward
    accelerator.backward = lambda loss, **kwargs: backward(loss / 2, **kwargs)


def make_run(cfg, data_dir: str) -> train.Run:
    world = int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=cfg.grad_accum_steps(world))
    model = train.build_model(cfg, compile_blocks=False)
    model = train.shard_model(model, accelerator.device, bf16=False,
                              reshard_after_forward=launch.reshard_after_forward(os.environ))
    optimizers = optim.build_optimizers(model, cfg)
    stages = [data.Stage(0, ((data_dir, 1.0),))]
    loader = MaskedLoader(stages, cfg.seq_len, cfg.micro_batch_size, accelerator.process_index,
                          accelerator.num_processes, seed=cfg.seed)
    facts = log.RunFacts(log.hardware(accelerator, True, (False, "test"), "test"), "test", [],
                         {data_dir: 1.0}, {data_dir: 1})
    return train.Run(cfg, accelerator, model, optimizers, loader, stages,
                     {data_dir: shards.load_manifest(data_dir)}, {data_dir: 1.0}, [], facts,
                     checkpoint.Saver(accelerator, in_background=False))


def train_steps(run: train.Run) -> list[train.StepResult]:
    """What train.main does around each step, without evaluation, logging or checkpoints."""
    results = []
    with launch.StopFlag() as stop:
        while run.step < run.cfg.stop_at_step:
            run.optimizers.set_lr(optim.lr_multiplier(run.step, run.cfg))
            results.append(train.train_step(run, stop))
            run.step += 1
    return results


def watch_resharding(model) -> dict:
    """Fills in, at block 0's first forward, whether its weights were sharded again after it
    (FSDP2's reshard_after_forward) or stayed gathered for the backward."""
    seen = {}

    def hook(module, args, output):
        seen.setdefault("sharded_after_forward", isinstance(module.attn.q_proj.weight, DTensor))
    model.blocks[0].register_forward_hook(hook)
    return seen


def world_report(accelerator) -> dict:
    """What accelerate says about the torchrun world, and a sum over ranks of rank + 1."""
    total = accelerator.reduce(torch.tensor(accelerator.process_index + 1.0), "sum")
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "process_index": accelerator.process_index,
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type.value),
            "reduced_sum": total.item(), "grad_accum": accelerator.gradient_accumulation_steps}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model, optimizers: list) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizers,
                                        options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": full(v) for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = full(torch.as_tensor(value))
    return flat


def train_and_report(data_dir: str, out: Path, mistake: str | None = None):
    """STEPS steps with every block's activations selectively recomputed (recomputation under
    FSDP2 must give the plain reference's gradients: FSDP2 gathers each block's weights for
    it, as for the forward), and `mistake` made, if any; the results in out."""
    cfg = fsdp_config(data_dir, str(out), activation_recompute="selective")
    run = make_run(cfg, data_dir)
    resharding = watch_resharding(run.model)
    if mistake == "mean_of_means":
        normalise_each_micro_batch(run.model, cfg)
    elif mistake == "half_gradient":
        halve_gradients(run.accelerator)
    results = train_steps(run)
    rank = run.accelerator.process_index
    (out / f"world_{rank}.json").write_text(json.dumps(world_report(run.accelerator)
                                                       | resharding))
    weights = {k: full(v) for k, v in run.model.state_dict().items()}
    if rank == 0:
        (out / "train.json").write_text(json.dumps({
            "losses": [r.loss for r in results],
            "grad_norms": [r.grad_norm for r in results],
            "skipped": [r.skipped for r in results]}))
        torch.save(weights, out / "weights.pt")
    return run


def main():
    action, data_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if action == "train":  # the real step, then both negative controls, in one launch
        for mistake in (None, "mean_of_means", "half_gradient"):
            (out / (mistake or "")).mkdir(exist_ok=True)
            run = train_and_report(data_dir, out / (mistake or ""), mistake)
    else:
        run = make_run(fsdp_config(data_dir, str(out)), data_dir)
    rank, optimizers = run.accelerator.process_index, list(run.optimizers.named.values())
    if action == "save":
        train_steps(run)
        checkpoint.write_weights_and_optimizers(run.model, optimizers, out / "ckpt")
        state = full_state(run.model, optimizers)
        # The paths that use the root's parameters outside its forward, on every rank.
        prompt = torch.arange(1, 9)[None]  # (1, 8)
        outputs = {"logits": run.model.logits(prompt),
                   "generated": run.model.generate(prompt, 4, temperature=0)}
        if rank == 0:
            torch.save(state, out / "reference.pt")
            torch.save(outputs, out / "outputs.pt")
    elif action == "load":
        checkpoint.read_weights_and_optimizers(run.model, optimizers, out / "ckpt")
        state = full_state(run.model, optimizers)
        if rank == 0:
            reference = torch.load(out / "reference.pt", weights_only=True)
            mismatched = [k for k in reference if k not in state
                          or not torch.equal(reference[k], state[k])]
            (out / f"load_{run.accelerator.num_processes}.json").write_text(json.dumps({
                "compared": len(reference), "mismatched": mismatched,
                "extra": sorted(set(state) - set(reference))}))
    # As in dist_muon.py: the FSDP modules and their DTensors sit in reference cycles; free
    # them while the interpreter and the process group are alive, then let no rank tear
    # down gloo while another still writes its files.
    del run, optimizers
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
