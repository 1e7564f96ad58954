"""The run's plumbing: everything a training run needs around the lesson (train.py,
model.py, loss.py, data.py, optim.py and config.py at the top of the repository), one
concern a file, each with a docstring that says what it holds:

    preflight      every refusal before any work, and the banner's facts
    devices        the device a run trains on (--device), for train.py and sample.py
    launch         the Accelerator, precision and compile, the launch config's keys, the
                   signals a scheduler sends, the outcome file, leaving the process group
    resume         which checkpoint a run continues, and what a resume may change
    checkpoint     a checkpoint's files: atomic DCP save (blocking or in the background),
                   reading without running code, RNG
    hf_import      a transformers folder as a run's starting weights (--init_from)
    log            the banner, the memory estimate, the log line, MFU, metrics.jsonl, wandb,
                   TensorBoard
    downstream     the multiple-choice tasks scored in the loop, as lm-eval scores them
    shards         a prepared folder's manifest, shard checks and their error hints
    overrides      a run's config from a TOML file and --key=value flags, and --help
    cli            the one-line errors every command shares
    hf_modeling_stacklm   the modelling file a transformers export carries (not imported)

Imports from stacklm: nothing.
"""
