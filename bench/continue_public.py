"""Continuing a public model: which optimizer and peak learning rate, measured on a stand-in.

    python bench/continue_public.py                      # 7 runs, ~25 min on 2 CPU cores
    python bench/continue_public.py --pretrain_steps 8 --continue_steps 4 --seeds 1 \\
        --runs_dir /tmp/continue_smoke                   # smoke: a minute

A public model such as SmolLM2-135M was pretrained with AdamW and has decayed its learning
rate. The stand-in is made the same way, on this CPU:
1. **Pretrain** the `tiny` model as a Llama (no QK-norm, RoPE on every layer) with AdamW on
   every matrix, through its whole warmup-stable-decay schedule, on the built-in corpus
   (data/stdlib-4k: the Python standard library), and export it as a transformers folder
   (`python export.py --format hf`): what `--init_from` reads.
2. **Continue** it with `--init_from` on other data, numpy's own Python source, prepared
   with the same tokenizer, under each arm, for each seed (a seed sets the data order):

       muon_preset    Muon on the matrices at the from-scratch peaks (muon 6e-3, adamw 3e-3)
       muon_modest    Muon at a tenth of them (muon 6e-4, adamw 3e-4)
       adamw_modest   AdamW on every matrix at a tenth of its from-scratch peak (3e-4)

3. **Score** each continued model, and the pretrained one, on both val splits: numpy's (what
   the continuation is for) and the standard library's (what it forgets).

Every run is a `python train.py` command as a user types it; the JSON line lists them. It
prints one JSON line and writes it to bench/results/continue_public.json.
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import data  # noqa: E402
import prepare  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from plumbing import cli  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ORIGINAL = "data/stdlib-4k"  # the built-in corpus, the stand-in's pretraining data
# A Llama's blocks: what a public model such as SmolLM2 is.
LLAMA = ["--model.qk_norm=false", "--model.nope_every=0"]
ARMS = {"muon_preset": ["--matrix_optimizer=muon", "--muon_peak_lr=6e-3", "--adamw_peak_lr=3e-3"],
        "muon_modest": ["--matrix_optimizer=muon", "--muon_peak_lr=6e-4", "--adamw_peak_lr=3e-4"],
        "adamw_modest": ["--matrix_optimizer=adamw", "--adamw_peak_lr=3e-4"]}
# What none of the runs needs: the in-loop task, the report, a checkpoint before the last.
QUIET = ["--downstream=", "--write_report=false", "--sample_tokens=1"]


def run(command: list[str]) -> list[str]:
    """Run one command from the repository's root; its output goes to the log only on
    failure."""
    result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return command


def schedule(steps: int) -> list[str]:
    """A whole warmup-stable-decay schedule of `steps`, warmup and decay as tiny's (10%, 20%)."""
    return [f"--total_steps={steps}", f"--stop_at_step={steps}",
            f"--warmup_steps={max(1, steps // 10)}"]


def new_corpus(runs: Path) -> str:
    """numpy's Python source, prepared with the built-in corpus's tokenizer."""
    folder = runs / "numpy-4k"
    if not folder.exists():
        source = str(Path(numpy.__file__).parent / "**" / "*.py")
        run(["prepare.py", "--source", source, "--tokenizer", f"{ORIGINAL}/tokenizer.json",
             "--data_dir", str(folder)])
    return str(folder)


def val_losses(export: Path, corpora: dict[str, str]) -> dict[str, float]:
    """The exported model's val loss on each corpus's whole val split."""
    model, _, _ = sample.load_export(str(export))
    cfg = dataclasses.replace(config.tiny(), eval_tokens=None)
    accelerator = train.Accelerator(cpu=True)
    with torch.no_grad():
        return {name: round(train.val_loss(cfg, accelerator, model, data.token_bytes(path),
                                           path)["val_loss"], 4)
                for name, path in corpora.items()}


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain_steps", type=cli.at_least(1), default=300)
    parser.add_argument("--continue_steps", type=cli.at_least(1), default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs_dir", default="bench/results/continue_runs.tmp")
    args = parser.parse_args(argv)
    runs = Path(args.runs_dir)
    prepare.ensure_builtin([ORIGINAL], 4096)
    corpora = {"continued": new_corpus(runs), "original": ORIGINAL}
    pretrain = runs / "pretrain"
    commands = [run(["train.py", "--preset", "tiny", *LLAMA, "--matrix_optimizer=adamw",
                     *schedule(args.pretrain_steps), *QUIET,
                     f"--out_dir={pretrain}"])]
    commands.append(run(["export.py", str(pretrain), "--format", "hf"]))
    commands.append(run(["export.py", str(pretrain)]))
    result = {"pretrained": val_losses(pretrain / "export", corpora), "arms": {}}
    for arm, flags in ARMS.items():
        losses = []
        for seed in args.seeds:
            out = runs / f"{arm}-seed{seed}"
            commands.append(run(["train.py", "--preset", "tiny",
                                 f"--init_from={pretrain / 'export-hf'}",
                                 f"--data_dir={corpora['continued']}", *flags,
                                 *schedule(args.continue_steps), f"--seed={seed}",
                                 *QUIET, f"--out_dir={out}"]))
            run(["export.py", str(out)])
            losses.append(val_losses(out / "export", corpora))
        result["arms"][arm] = {
            name: {"mean": round(statistics.mean(x[name] for x in losses), 4),
                   "seeds": [x[name] for x in losses]} for name in corpora}
    result["commands"] = [" ".join(c) for c in commands]
    line = json.dumps(result)
    print(line)
    (REPO / "bench" / "results" / "continue_public.json").write_text(line + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
