"""Every command README.md and the docs pages it links document runs as written (a few
steps where it trains), in the pages' order, in one checkout; and the test command still
passes in that checkout.

The commands are read out of the pages themselves: README.md, then each docs/*.md page in
the order README first links it. A page's commands are its ```bash blocks and the
backticked commands of its tables. Each must have an entry in HOW, in the same order, so a
new or moved command fails this test until it is run here too (or its skip is explained).

README and each docs page also keep the issue 46 promise on their prose: README at most
2,500 words, every page's median sentence at most 22 words (prose_figures)."""

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import prepare

REPO = Path(__file__).resolve().parent.parent

# Appended to every command that trains: stop early, train on small batches, evaluate and
# sample little.
FEW_STEPS = ["--stop_at_step=2", "--eval_tokens=1024", "--sample_tokens=4",
             "--downstream_items=4", "--micro_batch_size=4", "--global_batch_tokens=1024"]
# Stack-100M itself does not fit a CPU test: the same command with a 1-layer stand-in.
CPU_STAND_IN = ["--model.n_layers=1", "--model.d_model=64", "--model.n_heads=2",
                "--model.n_kv_heads=1", "--model.intermediate=128", "--model.max_seq_len=64",
                "--seq_len=64", "--micro_batch_size=2", "--global_batch_tokens=128",
                "--total_steps=4", "--warmup_steps=1", "--decay_fraction=0.25",
                "--stop_at_step=2", "--eval_tokens=128", "--sample_tokens=4"]
# The public model's stand-in (tests/public_model.py) has 64 positions: a few short steps,
# with the decay leg from step 3, where the stable run stops.
PUBLIC_STAND_IN = ["--seq_len=64", "--micro_batch_size=2", "--global_batch_tokens=128",
                   "--total_steps=4", "--warmup_steps=1", "--decay_start=3",
                   "--eval_tokens=128", "--sample_tokens=4", "--downstream_items=4"]
GPU = "needs CUDA GPUs"
# The runs whose report nothing reads draw none (report.py runs for the tiny run's own and
# the comparison's, whose figure reads the runs' metrics.jsonl).
NO_REPORT = FEW_STEPS + ["--write_report=false"]
# The anneals branch from the stable run's checkpoint, which FEW_STEPS puts at step 2.
ANNEAL_FROM_STEP_2 = NO_REPORT + ["--stop_at_step=4", "--resume=out/tiny-stable/ckpt/step_0000002"]

# Command -> ("run", extra flags) or ("skip", why), in the pages' order (docs_pages), which
# is the order they run in: later commands use what earlier ones made (the tiny run's
# checkpoint, the prepared corpus).
HOW = {
    # README.md
    "pip install -r requirements.txt": ("skip", "CI installs requirements-dev.txt, which "
                                                "includes it, before running the tests"),
    "python train.py --preset tiny": ("run", FEW_STEPS),
    "pip install -r requirements-dev.txt": ("skip", "CI runs exactly this before the tests"),
    "python -m pytest -q": ("skip", "this is the test command itself"),
    "python train.py --preset tiny --muon_peak_lr=0.01 --model.n_layers=6 "
    "--out_dir=out/tiny6": ("run", NO_REPORT),
    "python train.py --config run.toml": ("run", NO_REPORT),
    # docs/report.md
    "python train.py --preset tiny --stop_at_step=240 --out_dir=out/tiny-stable": (
        "run", NO_REPORT),
    "python train.py --preset tiny --resume=out/tiny-stable/ckpt/step_0000240 "
    "--out_dir=out/tiny-anneal-sqrt": ("run", ANNEAL_FROM_STEP_2),
    "python train.py --preset tiny --decay_shape=linear --resume=out/tiny-stable/ckpt/step_0000240 "
    "--out_dir=out/tiny-anneal-linear": ("run", ANNEAL_FROM_STEP_2),
    "python report.py out/tiny-stable out/tiny-anneal-sqrt out/tiny-anneal-linear "
    "--out out/compare": ("run", []),
    # docs/data.md
    "python prepare.py --source HuggingFaceFW/fineweb-edu --subset sample-100BT "
    "--max_tokens 20_000_000_000 --data_dir data/fwe": (
        "skip", "downloads a Hugging Face dataset; the datasets path (subset, split) runs "
                "the real library over a local copy of a hub layout in tests/test_prepare.py"),
    "python prepare.py --source HuggingFaceTB/smollm-corpus --subset fineweb-edu-dedup "
    "--max_tokens 20_000_000_000 --data_dir data/fwe-dedup": (
        "skip", "downloads a Hugging Face dataset, as the command above"),
    "python train.py --preset stack100m --data_dir=data/fwe": (
        "skip", "trains on the download above; the same command runs on data/mycorpus below"),
    "hf download HuggingFaceFW/fineweb-edu --include \"sample/10BT/*\" --repo-type dataset "
    "--local-dir data/raw/fineweb-edu": (
        "skip", "downloads; make_corpus writes two parquet shards where it leaves them"),
    'python prepare.py --source "data/raw/fineweb-edu/sample/10BT/*.parquet" '
    "--max_tokens 20_000_000_000 --data_dir data/fwe": ("run", []),
    'python prepare.py --source "data/raw/corpus/*.txt" --data_dir data/mycorpus': ("run", []),
    "python prepare.py --source data/raw/docs.jsonl --text_field body --data_dir data/docs": (
        "run", []),
    "python prepare.py --source data/raw/more.txt --tokenizer data/mycorpus/tokenizer.json "
    "--data_dir data/more": ("run", []),
    "python prepare.py --verify data/mycorpus": ("run", []),
    "python train.py --preset stack100m --data_dir=data/mycorpus": ("run", CPU_STAND_IN),
    # docs/tasks.md
    "python train.py --preset tiny --downstream=nextline:data/stdlib-4k,hellaswag:data/tasks/"
    "hellaswag_val.jsonl,arc_easy:data/tasks/ARC-Easy-Test.jsonl,piqa:data/tasks/"
    "piqa_valid.jsonl --out_dir=out/tiny-tasks": ("run", NO_REPORT),
    # docs/checkpoints.md
    "python export.py out/tiny": ("run", []),
    'python sample.py --export out/tiny/export --prompt "def " --num_samples 2': (
        "run", ["--max_new_tokens=8"]),
    "python export.py out/tiny --format hf": ("run", []),
    "lm_eval --model hf --model_args pretrained=out/tiny/export-hf,trust_remote_code=True "
    "--tasks hellaswag,arc_easy,piqa --batch_size 32": (
        "skip", "lm-evaluation-harness downloads its tasks; the folder it loads is tested "
                "against transformers in tests/test_hf_export.py"),
    # docs/torchtitan.md: the extra's own environment; .ci/run's second step
    "pip install -r requirements-torchtitan.txt": (
        "skip", ".ci/run's second step runs exactly this, after the suite"),
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file "
    "configs/torchtitan/stack100m.toml": (
        "skip", "needs 8 GPUs; tests/test_torchtitan.py reads this TOML with torchtitan's own "
                "parser and checks it is the stack100m preset, knob for knob"),
    "OMP_NUM_THREADS=1 torchrun --nproc_per_node=1 -m torchtitan.train --job.config_file "
    "configs/torchtitan/tiny_cpu.toml": (
        "skip", "needs requirements-torchtitan.txt: tests/test_torchtitan.py launches this "
                "command, at its micro run's shape, on 1 rank"),
    "OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file "
    "configs/torchtitan/tiny_cpu.toml --training.local_batch_size 8": (
        "skip", "the same, on 2 FSDP2 ranks"),
    # docs/scale.md
    "accelerate launch --config_file accelerate_configs/single_gpu.yaml train.py": ("skip", GPU),
    "accelerate launch --config_file accelerate_configs/ddp.yaml train.py": ("skip", GPU),
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml train.py": ("skip", GPU),
    "sbatch --nodes=N accelerate_configs/slurm_fsdp2.sh [--key=value ...]": (
        "skip", "needs SLURM and GPUs; tests/test_cluster.py runs the script itself with stub "
                "srun and scontrol"),
    "accelerate launch --config_file accelerate_configs/cpu_ddp.yaml train.py --preset tiny "
    "--micro_batch_size=8 --out_dir=out/tiny-ddp": (
        "run", NO_REPORT + ["--global_batch_tokens=2048"]),  # a micro-batch on each rank
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 train.py "
    "--preset tiny --micro_batch_size=8 --out_dir=out/tiny-fsdp2": (
        "skip", "tests/test_fsdp.py launches train.py with this launch config on 2 CPU "
                "processes, start to finish, then stopped, resumed and exported"),
    # docs/recipe.md. The downloads are skipped, and a local stand-in of each is prepared
    # at the same path, so that the recipe's own training commands run as written.
    "python prepare.py --source HuggingFaceTB/smollm-corpus --subset fineweb-edu-dedup "
    "--max_tokens 17_000_000_000 --data_dir data/fwe-dedup": (
        "instead", "downloads; stand-in: python prepare.py --source data/raw/corpus "
                   "--data_dir data/fwe-dedup"),
    "python prepare.py --source HuggingFaceTB/smollm-corpus --subset cosmopedia-v2 "
    "--max_tokens 3_000_000_000 --tokenizer data/fwe-dedup/tokenizer.json --data_dir data/cosmo": (
        "instead", "downloads; stand-in: python prepare.py --source data/raw/docs.jsonl "
                   "--text_field body --tokenizer data/fwe-dedup/tokenizer.json "
                   "--data_dir data/cosmo"),
    "python prepare.py --source HuggingFaceTB/finemath --subset finemath-4plus "
    "--max_tokens 2_000_000_000 --tokenizer data/fwe-dedup/tokenizer.json "
    "--data_dir data/finemath": (
        "instead", "downloads; stand-in: python prepare.py --source data/raw/more.txt "
                   "--tokenizer data/fwe-dedup/tokenizer.json --data_dir data/finemath"),
    "python train.py --preset stack100m --config configs/smollm_mixture.toml": (
        "run", CPU_STAND_IN),
    "python train.py --preset stack100m --config configs/smollm_mixture.toml "
    "--stop_at_step=38147": ("run", CPU_STAND_IN + ["--stop_at_step=4"]),
    "python train.py --preset stack100m --config configs/smollm_mixture.toml "
    "--stop_at_step=38147 --anneal_data_dir=data/cosmo:1,data/finemath:1 "
    "--resume=out/smollm/ckpt/step_0034332 --out_dir=out/anneal-b": (
        "run", CPU_STAND_IN + ["--stop_at_step=4", "--resume=out/smollm/ckpt/step_0000002"]),
    # docs/recipe.md, from a public model: a small random Llama stands in for the download,
    # with data/mycorpus's tokenizer, so that the commands after it run as written.
    "hf download HuggingFaceTB/SmolLM2-135M --local-dir models/SmolLM2-135M": (
        "instead", "downloads; stand-in: python tests/public_model.py models/SmolLM2-135M "
                   "data/mycorpus/tokenizer.json"),
    'python prepare.py --source "data/raw/corpus/*.txt" --tokenizer '
    "models/SmolLM2-135M/tokenizer.json --data_dir data/mine-smollm2": ("run", []),
    "python prepare.py --source data/raw/more.txt --tokenizer "
    "models/SmolLM2-135M/tokenizer.json --data_dir data/premium-smollm2": ("run", []),
    "python train.py --init_from=models/SmolLM2-135M --data_dir=data/mine-smollm2 "
    "--total_steps=4000 --stop_at_step=3600 --warmup_steps=200 --matrix_optimizer=adamw "
    "--adamw_peak_lr=3e-4 --out_dir=out/smollm2-stable": (
        "run", PUBLIC_STAND_IN + ["--stop_at_step=3"]),
    "python train.py --init_from=models/SmolLM2-135M --data_dir=data/mine-smollm2 "
    "--total_steps=4000 --stop_at_step=4000 --warmup_steps=200 --matrix_optimizer=adamw "
    "--adamw_peak_lr=3e-4 --anneal_data_dir="
    "data/premium-smollm2 --resume=out/smollm2-stable/ckpt/step_0003600 "
    "--out_dir=out/smollm2-anneal": (
        "run", PUBLIC_STAND_IN + ["--stop_at_step=4",
                                  "--resume=out/smollm2-stable/ckpt/step_0000003"]),
    "python report.py out/smollm2-stable out/smollm2-anneal --out out/smollm2-compare": (
        "run", []),
}


def docs_pages() -> list[Path]:
    """README.md, then each docs page README links, in the order of its first link."""
    linked = re.findall(r"\]\((docs/[\w-]+\.md)(?:#[\w-]*)?\)", (REPO / "README.md").read_text())
    return [REPO / "README.md"] + [REPO / page for page in dict.fromkeys(linked)]


def readme_commands() -> list[str]:
    """Every page's commands, page by page, each page's in the order they stand in it."""
    commands = []
    for page in docs_pages():
        text = page.read_text()
        found = []  # (where it stands, command)
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            for line in block[1].splitlines():
                line = line.split("  #")[0].strip()
                found += [(block.start(), part.strip()) for part in line.split("&&")
                          if part.strip()]
        found += [(row.start(), row[1]) for row in
                  re.finditer(r"\| `((?:accelerate launch|sbatch) [^`]*)` \|", text)]
        commands += [command for _, command in sorted(found, key=lambda f: f[0])]
    return commands


def prose_figures(text: str) -> tuple[int, float]:
    """Words of prose and the median sentence's words, as issue 46 measures them: code
    blocks and table rows left out, sentences split on . ! ? before whitespace, fragments
    of two words or fewer ignored."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = "\n".join(line for line in prose.splitlines() if not line.lstrip().startswith("|"))
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", prose))
                 if len(s.split()) > 2]
    return len(prose.split()), statistics.median(len(s.split()) for s in sentences)


def test_readme_reads_in_ten_minutes():
    """README at most 2,500 words of prose with a median sentence of at most 22 words; each
    docs page's median sentence at most 22 words too. Every docs page is linked from
    README, so none of its commands escapes the test below."""
    words, median = prose_figures((REPO / "README.md").read_text())
    assert words <= 2500 and median <= 22, (words, median)
    for page in sorted((REPO / "docs").glob("*.md")):
        assert prose_figures(page.read_text())[1] <= 22, page.name
    assert set(docs_pages()[1:]) == set((REPO / "docs").glob("*.md"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, each
    space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_resolves():
    """Each relative link of README and the docs pages names a file that exists, and an
    anchor that one of that page's headings makes."""
    for page in docs_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(),
                                                            flags=re.S), re.M)
                assert anchor in {slug(h) for h in headings}, f"{page.name}: {target}"


# What make_corpus writes: the pages' local inputs, at their paths, and run.toml.
INPUTS = ("data/raw/corpus/a.txt", "data/raw/docs.jsonl", "data/raw/more.txt", "run.toml",
          "data/raw/fineweb-edu/sample/10BT/000_00000.parquet",
          "data/raw/fineweb-edu/sample/10BT/001_00000.parquet",
          "data/tasks/hellaswag_val.jsonl", "data/tasks/ARC-Easy-Test.jsonl",
          "data/tasks/piqa_valid.jsonl")


def make_corpus(cwd: Path):
    """What the corpus commands read: standard-library text as .txt, .jsonl and one more file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text() for p in sorted(stdlib.glob("*.py"))[:100]]
    # The val split takes the 1% of documents whose key hashes low: a.txt's document 226 is
    # the first, so 300 documents (the texts, three times) give val a document.
    texts = texts * 3
    raw = cwd / "data" / "raw"
    (raw / "corpus").mkdir(parents=True)  # fails if the copy brought README's inputs along
    (raw / "corpus" / "a.txt").write_text("<|endoftext|>".join(texts))
    lines = [json.dumps({"body": t}) for t in texts]
    (raw / "docs.jsonl").write_text("\n".join(lines))
    # more.txt: as many documents as it takes for one to hash into the 1% val split
    n_more = next(i for i in range(10_000) if prepare.is_val(f"more.txt:{i}", 0.01)) + 1
    (raw / "more.txt").write_text("<|endoftext|>".join(texts[i % len(texts)][:2000]
                                                       for i in range(n_more)))
    # a run of its own: without out_dir it would continue out/tiny, which has nothing left
    (cwd / "run.toml").write_text('out_dir = "out/run"\nwarmup_steps = 1\nlog_every = 1\n')
    write_fineweb_shards(cwd / "data" / "raw" / "fineweb-edu" / "sample" / "10BT", texts)
    write_task_files(cwd / "data" / "tasks")


def write_task_files(folder: Path):
    """Four items of each task file README's in-loop command reads, in the layouts of the
    files README says to fetch (PIQA's labels merged in, as README's snippet does)."""
    folder.mkdir(parents=True)
    items = {
        "hellaswag_val.jsonl": [{"activity_label": "Cooking", "ctx_a": f"A cook mixes {n} eggs.",
                                 "ctx_b": "then she", "endings": ["bakes.", "sings.", "runs.",
                                                                  "sleeps."], "label": n % 4}
                                for n in range(4)],
        "ARC-Easy-Test.jsonl": [{"id": str(n), "question": {"stem": f"Which is {n}?", "choices": [
            {"text": t, "label": k} for t, k in (("one", "A"), ("two", "B"), ("three", "C"))]},
            "answerKey": "ABC"[n % 3]} for n in range(4)],
        "piqa_valid.jsonl": [{"goal": f"Boil {n} eggs", "sol1": "in water", "sol2": "in air",
                              "label": n % 2} for n in range(4)]}
    for name, docs in items.items():
        (folder / name).write_text("".join(json.dumps(doc) + "\n" for doc in docs))


def write_fineweb_shards(folder: Path, texts: list[str]):
    """Two shards in FineWeb-Edu's file names and columns (text among others), in row groups
    of 32; the first holds rows until one hashes into the 1% val split."""
    import pyarrow
    import pyarrow.parquet

    folder.mkdir(parents=True)
    n_first = next(i for i in range(10_000) if prepare.is_val(f"000_00000.parquet:{i}", 0.01)) + 1
    for name, rows in (("000_00000.parquet", texts[:n_first]), ("001_00000.parquet", texts[-50:])):
        table = pyarrow.table({"text": rows, "id": [f"<urn:{name}:{i}>" for i in range(len(rows))],
                               "score": [3.0] * len(rows)})
        pyarrow.parquet.write_table(table, folder / name, row_group_size=32)


def tracked_files(repo: Path) -> list[str]:
    """The files of the checkout: git's tracked files, so that nothing README's commands made
    there (out/, data/) or a user keeps there (a corpus, run.toml) is copied; outside a git
    checkout, every file outside the folders .gitignore names."""
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = []
    files = [name for name in listed if name and (repo / name).is_file()]
    ignored = {".git", "out", "wandb", "data", "__pycache__", ".pytest_cache"}
    return files or [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()
                     and not ignored & set(p.relative_to(repo).parts)]


def checkout(repo: Path, to: Path) -> Path:
    """Where the commands run: a copy of repo's files (tracked_files), made a git checkout of
    its own (nothing committed: the code's revision reads unknown, as in any copy), then
    this test's inputs at README's paths."""
    for name in tracked_files(repo):
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, to / name)
    subprocess.run(["git", "init", "-q"], cwd=to, check=True)
    subprocess.run(["git", "add", "-f", "."], cwd=to, check=True)
    make_corpus(to)
    return to


def test_the_copy_holds_the_checkouts_files_and_the_inputs(tmp_path):
    """The copy the test below works in takes none of what README's commands or a user left
    in the checkout (out/, data/: the same names would collide with its inputs, and a large
    corpus would be copied for nothing). The test below runs this one again inside the
    checkout where it ran README's commands, which is what a user does after them."""
    cwd = checkout(REPO, tmp_path / "copy")
    copied = {str(p.relative_to(cwd)) for p in cwd.rglob("*")
              if p.is_file() and ".git" not in p.relative_to(cwd).parts}
    assert {"README.md", "train.py", "tests/test_readme.py"} <= copied
    assert not [p for p in copied - set(INPUTS) if p.startswith(("out/", "data/"))]


def test_every_readme_command_runs_as_written(tmp_path):
    commands = readme_commands()
    assert commands == list(HOW), "the pages' commands changed or moved: update HOW"
    cwd = checkout(REPO, tmp_path / "work")
    if (REPO / "data" / "stdlib-4k" / "manifest.json").exists():  # prepared once already
        shutil.copytree(REPO / "data" / "stdlib-4k", cwd / "data" / "stdlib-4k")
    for command, (action, extra) in HOW.items():
        if action == "skip":
            continue
        argv = shlex.split(extra.split("stand-in: ")[1]) if action == "instead" \
            else shlex.split(command) + extra
        env = dict(os.environ)  # one process: the cores are its own
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[:2] == ["accelerate", "launch"]:
            argv = [sys.executable, "-m", "accelerate.commands.launch"] + argv[2:]
            env["OMP_NUM_THREADS"] = "1"  # two ranks on CI's two cores: a thread each
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr, command
        assert "nothing to train" not in done.stdout, command  # each one that trains, trains
    # The in-loop command scored its four tasks, each at each evaluation.
    records = [json.loads(line) for line in
               (cwd / "out" / "tiny-tasks" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if r.get("kind") == "eval"]
    assert len(scored) == 2 and all(f"acc/{task}" in r for r in scored
                                    for task in ("nextline", "hellaswag", "arc_easy", "piqa"))
    # The reports README shows: the tiny run's own, written by the command, and the overlay.
    assert "finished at step 2 of 2" in (cwd / "out" / "tiny" / "report.md").read_text()
    assert "# Runs compared: tiny-stable, tiny-anneal-sqrt, tiny-anneal-linear" in (
        cwd / "out" / "compare" / "report.md").read_text()
    for folder in ("tiny", "compare"):
        assert (cwd / "out" / folder / "report.png").stat().st_size > 10_000
    # Then the test command, in the checkout README's commands ran in (its out/ and data/
    # hold their outputs): this file's copy step there, which is all of the checkout that
    # the commands above depend on. (Running this test again would double its time.)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'nested'}", "tests/test_readme.py", "-k",
                           "test_the_copy_holds"], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]
