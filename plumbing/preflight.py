"""Preflight: everything a run checks before any work, and the facts its banner prints.

`check` refuses, in one line each, what would fail later or waste the machine: a plan past
a CPU's RAM, missing or mismatched data, a public model's folder (--init_from) whose files
cannot start a run, a bad downstream task file, a plan that reads a source more often than
--max_epochs allows. (The launch config is checked earlier, before accelerate reads it:
launch.check_launch.) It prepares the built-in corpus where a run needs it and it is
missing. What it learns on the way (the data stages, each source's
manifest, the tasks, the data plan, what an evaluation reads, the hardware) is what the
banner and metrics.jsonl's start record say; the warnings it collects are printed after
the banner.

Imports from stacklm: config, data, downstream, hf_import, launch, log, prepare and shards:
it composes them.
"""

import os
from typing import NamedTuple

import config
import data
import prepare
from plumbing import downstream, hf_import, launch, log, shards


class Plan(NamedTuple):
    """What preflight checked, for setup to build from and the banner to print."""
    stages: list[data.Stage]  # the data stages: which sources, by weight, from which step
    manifests: dict[str, dict]  # each source's manifest.json
    tasks: list[downstream.Task]  # the multiple-choice tasks scored beside the val loss
    eval_sources: dict[str, float]  # the sources evaluated, and their shares of val_loss
    compile_blocks: bool  # torch.compile each block (launch.use_compile)
    sharded: bool  # FSDP2: the launch config asks for it (launch.fsdp_launch)
    facts: log.RunFacts  # what the banner and metrics.jsonl's start record say of this start
    warnings: list[str]  # printed after the banner


def check(cfg, accelerator, force: bool) -> Plan:
    """Refuse a run that cannot work, before any compute, and gather what the banner says.
    `force` (--force) starts a plan past a CPU's RAM anyway."""
    if cfg.tensorboard:
        log.check_tensorboard(cfg.out_dir)
    if cfg.init_from:  # a public model's files: its shape and weights; later its tokenizer
        hf_import.check_shape(cfg)
        hf_import.check_weights(cfg.init_from, cfg.model)
    in_use, why = launch.mixed_precision(cfg)
    warnings = launch.precision_warnings(os.environ, in_use) + hf_import.peak_warnings(cfg)
    # FSDP2 when the launch config asks for it, on any device: train.py shards the model
    # itself, so a CPU run under gloo takes the very path a GPU run does (accelerate would
    # choose FSDP on GPUs only, and wrap the model in DDP on CPUs).
    sharded = launch.fsdp_launch(os.environ)
    warnings += log.check_memory(cfg, accelerator, sharded, force)  # refuses past a CPU's RAM
    stages = [data.Stage(*stage) for stage in cfg.stages(config.wsd_phases(cfg).decay_start)]
    sources = list(dict.fromkeys(d for stage in stages for d, _ in stage.sources))
    with accelerator.main_process_first():  # rank 0 prepares the built-in corpus if missing
        if accelerator.is_main_process:
            prepare.ensure_builtin(sources + downstream.corpora(cfg), cfg.model.vocab_size)
    if cfg.init_from:  # the data speaks the model's vocabulary (one tokenizer: checked below)
        hf_import.check_tokenizer(cfg, sources[0])
    manifests = shards.check_sources(sources, cfg.model.vocab_size)
    tasks = downstream.load_tasks(cfg, sources[0], accelerator.num_processes)
    eval_sources = data.val_shares(stages, manifests)  # sources with a val split, by weight
    data_plan = config.data_plan(cfg, stages, {d: data.windows_per_epoch(m, "train", cfg.seq_len)
                                               * cfg.seq_len for d, m in manifests.items()})
    warnings += config.check_epochs(cfg, data_plan)  # refuses past --max_epochs
    # Rank 0 opens every split first, hashing its shards; the others read its record.
    with accelerator.main_process_first():
        val_windows = {d: data.PackedShardLoader(d, "val", cfg.seq_len, 1).windows_per_epoch
                       for d in eval_sources}
    compile_blocks, compile_why = launch.use_compile(cfg)
    hardware = log.hardware(accelerator, sharded, (compile_blocks, compile_why), why)
    facts = log.RunFacts(hardware, log.code_revision(), data_plan, eval_sources, val_windows,
                         downstream.describe(tasks))
    return Plan(stages, manifests, tasks, eval_sources, compile_blocks, sharded, facts, warnings)
