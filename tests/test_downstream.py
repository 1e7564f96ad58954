"""Downstream tasks (downstream.py) against independent oracles: a scorer written here with
plain transformers code on the run's export, one sequence at a time, following
lm-evaluation-harness 0.4.13's rules (lm-eval itself downloads its tasks, so CI cannot run
it); the readers against items worked out by hand from lm-eval's task files; the ranks'
shares against a one-rank scoring; and each bad input refused in one line."""

import bisect
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba
from tokenizers import Tokenizer

import config
import export
import prepare
import report
import train
from conftest import micro_config
from model import Transformer
from test_train import REPO, checkpoint_weights
from plumbing import downstream, overrides

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# Items that reach each rule: trailing whitespace moved into the continuation, a context
# far longer than seq_len (left truncation), non-ASCII choices (acc_bytes differs from
# acc_norm), 2 to 5 choices.
GENERIC = [
    {"context": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"], "gold": 0},
    {"context": "import json\n\n", "choices": ["import os", "x = 1", "café = 'é'"], "gold": 2},
    {"context": "# " + "the quick brown fox jumps over the lazy dog " * 30 + "\nclass",
     "choices": ["A:", "B(object):", "C(dict):\n    pass", "D", "E"], "gold": 1},
    {"context": "for i in range(10):  ", "choices": ["print(i)", "pass"], "gold": 1},
    {"context": "x = {'a': 1}\nprint(x['", "choices": ["a'])", "b'])", "ü'])"], "gold": 0},
    {"context": "while True:\n", "choices": ["    break", "break", "\tcontinue"], "gold": 0},
]


HELLASWAG_LINE = json.dumps({"activity_label": "a", "ctx_a": "b", "ctx_b": "c",
                             "endings": ["d", "e"], "label": 1})


def write_jsonl(path: Path, docs: list) -> Path:
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return path


def transformers_scores(folder, items) -> tuple[list[float], np.ndarray]:
    """lm-eval's loglikelihood for multiple_choice, with plain transformers: each choice
    as " " + choice after the context; trailing whitespace of the context moved to the
    continuation; tokenizer(context + continuation) split at len(tokenizer(context));
    the last max_length + 1 tokens kept, all but the last fed in; the continuation's
    log-softmax summed. acc, acc_norm, acc_bytes: argmax of ll, ll / chars, ll / bytes."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    max_length = model.config.max_position_embeddings
    lls, picks = [], []
    for item in items:
        item_lls = []
        for choice in item.choices:
            context, continuation = item.context, " " + choice
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = tokenizer(context + continuation).input_ids
            context_ids = tokenizer(context).input_ids
            cont = whole[len(context_ids):]
            inputs = (context_ids + cont)[-(max_length + 1):][:-1]
            with torch.no_grad():
                logits = model(torch.tensor([inputs]), use_cache=False).logits[0].double()
            logprobs = torch.log_softmax(logits, -1)[-len(cont):]
            item_lls.append(logprobs.gather(1, torch.tensor(cont)[:, None]).sum().item())
        ll = np.array(item_lls)
        picks.append([np.argmax(ll), np.argmax(ll / [len(c) for c in item.choices]),
                      np.argmax(ll / [len(c.encode()) for c in item.choices])])
        lls += item_lls
    return lls, np.array(picks)


def test_in_loop_scores_equal_a_transformers_scorer_item_by_item(small_data_dir, tmp_path,
                                                                capsys):
    """A trained micro model: the run's final acc, acc_norm and acc_bytes, and each choice's
    log-likelihood from the packed in-loop scorer (several sequences per row), equal the
    plain transformers scorer's on the export, one sequence at a time: the same pick item
    by item, log-likelihoods to 1e-5. Both a generic file and the next-line task."""
    tasks = f"mine:{write_jsonl(tmp_path / 'mine.jsonl', GENERIC)},nextline:{small_data_dir}"
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), stop_at_step=4,
                       downstream=tasks, downstream_items=6)
    final = train.main(cfg)
    printed = capsys.readouterr().out
    assert re.search(r"downstream every 4 steps: mine 6 items from .*mine\.jsonl \(chance "
                     r"0\.339\); nextline 6 items from .*small's val documents \(chance "
                     r"0\.250\); [\d,]+ forward tokens per scoring", printed)
    assert re.search(r"eval      4 \|.* \| mine acc [\d.]+ acc_norm [\d.]+ \(chance 0\.339\)",
                     printed)
    export.main([str(tmp_path / "run"), "--format", "hf"])
    model = Transformer(cfg.model).eval()
    model.load_state_dict(checkpoint_weights(cfg, 4))
    mine, nextline = downstream.load_tasks(cfg, small_data_dir, 1)
    assert (mine.rows["seq_ids"] > 0).any()  # packed: the masking is what the oracle checks
    assert (nextline.rows["position_ids"] == 63).any()  # and left truncation to seq_len 64
    for task in (mine, nextline):
        with torch.no_grad():
            ours = downstream.loglikelihoods(task, model, torch.device("cpu"),
                                             cfg.micro_batch_size, 0, 1).tolist()
        theirs, picks = transformers_scores(tmp_path / "run" / "export-hf", task.items)
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
        assert (downstream.predictions(task.items, ours) == picks).all()
        hits = picks == np.array([[item.gold] for item in task.items])
        for j, metric in enumerate(("acc", "acc_norm", "acc_bytes")):
            assert final[f"{metric}/{task.name}"] == hits[:, j].mean()


def test_the_last_step_is_scored_when_it_falls_between_scorings(small_data_dir, tmp_path,
                                                                capsys):
    """README: downstream_every is the steps between scorings, "and always the last step".
    Evaluations every 2 steps, scorings every 4, a stop at step 6: the log scores steps 0,
    4 and 6, not 2; step 6's accuracies are those of step 6's own weights (the scorer run
    here on its checkpoint), each eval line prints its record's numbers, and the report's
    finals quote step 6, not step 4's figures. The banner's cost of a scoring is the forwards the scorer runs
    (counted here) × micro-batch × seq_len, and its share of the training between scorings
    a third of that (a forward is 2 of a trained token's 6 FLOPs) over 4 steps × 512."""
    path = write_jsonl(tmp_path / "mine.jsonl", GENERIC)
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), stop_at_step=6, eval_every=2,
                       downstream=f"mine:{path}", downstream_every=4)
    train.main(cfg)
    printed = capsys.readouterr().out
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text()
                            .splitlines()) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    assert [r["step"] for r in evals if "acc/mine" in r] == [0, 4, 6]
    model = Transformer(cfg.model).eval()
    model.load_state_dict(checkpoint_weights(cfg, 6))
    [task] = downstream.load_tasks(cfg, small_data_dir, 1)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with torch.no_grad():
        lls = downstream.loglikelihoods(task, model, torch.device("cpu"), cfg.micro_batch_size,
                                        0, 1).tolist()
    hits = downstream.predictions(task.items, lls) == np.array([[i.gold] for i in task.items])
    last = evals[-1]
    assert [last[f"{m}/mine"] for m in ("acc", "acc_norm", "acc_bytes")] == hits.mean(0).tolist()
    for r in evals:  # each eval line says what its record holds, a scoring's at its end
        line = f"eval {r['step']:>6,} | val_loss {r['val_loss']:.4f} | val_bpb {r['val_bpb']:.4f}"
        if "acc/mine" in r:
            line += f" | mine acc {r['acc/mine']:.3f} acc_norm {r['acc_norm/mine']:.3f} " \
                    f"(chance 0.339)"
        assert f"{line}\n" in printed
    assert report.results(report.read_run(tmp_path / "run"))["tasks"]["mine"]["step"] == 6
    tokens = len(forwards) * cfg.micro_batch_size * cfg.seq_len
    assert f"downstream every 4 steps: mine 6 items from {path} (chance 0.339); {tokens:,} " \
           f"forward tokens " \
           f"per scoring, ~{tokens / 3 / (4 * 512):.1%} of the training compute between " \
           f"scorings\n" in printed


def test_each_rank_scores_its_share_and_every_sequence_counts_once(small_data_dir, tmp_path):
    """The ranks' vectors, summed, equal one rank's, at 2 and 3 ranks; every rank runs the
    same number of forwards (FSDP2 needs all of them in each)."""
    path = write_jsonl(tmp_path / "mine.jsonl", GENERIC)
    cfg = micro_config(small_data_dir, str(tmp_path), downstream=f"mine:{path}",
                       micro_batch_size=2, global_batch_tokens=256)
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with torch.no_grad():
        one = downstream.loglikelihoods(downstream.load_tasks(cfg, small_data_dir, 1)[0], model,
                                        torch.device("cpu"), 2, 0, 1)
        for world in (2, 3):
            [task] = downstream.load_tasks(cfg, small_data_dir, world)
            shares, counts = [], []
            for rank in range(world):
                forwards.clear()
                shares.append(downstream.loglikelihoods(task, model, torch.device("cpu"), 2,
                                                        rank, world))
                counts.append(len(forwards))
            assert len(set(counts)) == 1, counts
            assert ((torch.stack(shares) != 0).sum(0) == 1).all()  # each on one rank
            torch.testing.assert_close(sum(shares), one, atol=1e-5, rtol=0)


def test_each_format_reads_items_as_lm_eval_builds_them(tmp_path):
    """Expected items worked out by hand from lm-eval 0.4.13's hellaswag utils.py
    (preprocess: " [title]" -> ". ", other [tags] removed, double spaces single, ctx_b
    capitalised), arc_easy.yaml (both of ARC's layouts; arc_challenge's yaml includes it)
    and piqa.yaml."""
    hellaswag = {"activity_label": "Making a cake", "ctx_a": "A woman  mixes flour. [header]",
                 "ctx_b": "then she [title] bakes", "endings": [" It rises. [step]", "B"],
                 "label": 1, "ind": 4}
    arc_release = {"id": "x", "question": {"stem": "Which is a gas?", "choices": [
        {"text": "ice", "label": "1"}, {"text": "steam", "label": "2"}]}, "answerKey": "2"}
    arc_rows = {"question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"],
                "label": ["A", "B", "C"]}, "answerKey": "B"}
    piqa = {"goal": "Boil eggs", "sol1": "no water", "sol2": "cold water", "label": 1}
    generic = {"context": "2 + 2 =", "choices": ["3", "4"], "gold": 1}
    expected = {
        "hellaswag": [("Making a cake: A woman mixes flour. Then she. bakes",
                       ["It rises. ", "B"], 1)],  # the space before a removed tag stays
        "arc_easy": [("Question: Which is a gas?\nAnswer:", ["ice", "steam"], 1),
                     ("Question: Which is a gas?\nAnswer:", ["ice", "steam", "rock"], 1)],
        "arc_challenge": [("Question: Which is a gas?\nAnswer:", ["ice", "steam", "rock"], 1)],
        "piqa": [("Question: Boil eggs\nAnswer:", ["no water", "cold water"], 1)],
        "anything": [("2 + 2 =", ["3", "4"], 1)]}
    docs = {"hellaswag": [hellaswag], "arc_easy": [arc_release, arc_rows],
            "arc_challenge": [arc_rows], "piqa": [piqa], "anything": [generic]}
    for name, want in expected.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", docs[name])
        got = downstream.read_items(name, str(path))
        assert [(i.context, i.choices, i.gold) for i in got] == want, name
        assert got[0].where == f"{path}:1"


@pytest.mark.parametrize("name, lines, message", [
    ("mine", None, r"cannot read .*missing\.jsonl .*FileNotFoundError"),
    ("mine", ['{"context": "a", "choices": ["b", "c"], "gold": 0}', "", "{not json"],
     r"task\.jsonl:3: not a generic item \(JSONDecodeError"),
    ("hellaswag", ['{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d"]}'],
     r"task\.jsonl:1: not a hellaswag item \(KeyError: 'label'\); each line of a hellaswag "
     r"file holds activity_label, ctx_a, ctx_b, endings and label"),
    ("mine", ['{"context": "a", "choices": ["b", "c"], "gold": 2}'],
     r"task\.jsonl:1: .*gold 2 is not the index of one of the 2 choices \(0 to 1\)"),
    ("hellaswg", [HELLASWAG_LINE],  # a misspelt format: read as generic, and it says so
     r"task\.jsonl:1: not a generic item \(KeyError: 'context'\); hellaswg is not a format's "
     r"name \(hellaswag, arc_easy, arc_challenge, piqa, nextline\), so each line must be a "
     r"generic item, .*; did you mean --downstream=hellaswag:.*task\.jsonl\?"),
    ("arc_easy", [json.dumps({"question": {"stem": "Which?", "choices": [
        {"text": "a", "label": "A"}, {"text": "b", "label": "B"}]}, "answerKey": "E"})],
     r"task\.jsonl:1: not an arc_easy item \(ValueError: answerKey 'E' is not one of its "
     r"choices' labels \['A', 'B'\]\); each line of an arc_easy file holds question"),
    ("piqa", ['{"goal": "a", "sol1": "b", "sol2": "c"}'],
     r"task\.jsonl:1: .*merge valid-labels\.lst in"),
    ("mine", ['{"context": " ", "choices": ["b", "c"], "gold": 0}'],
     r"task\.jsonl:1: .*the context is empty"),
    ("mine", [json.dumps({"context": "a", "choices": ["word " * 100, "b"], "gold": 0})],
     r"task\.jsonl:1: a choice of [\d,]+ tokens is longer than seq_len=64 \(lm-eval refuses it "
     r"too\); drop the item from downstream task mine, or raise --seq_len"),
    ("mine", [], r"task\.jsonl: no items \(an empty file\); downstream task mine needs some: "
                 r"put them in it, or drop mine from --downstream"),
])
def test_a_bad_task_file_is_refused_in_setup_in_one_line(name, lines, message, small_data_dir,
                                                        tmp_path):
    """One line naming the file (and the line), and nothing trained or logged: setup refuses
    it before any compute (the command line prints such an error as it is, exit status 2)."""
    path = tmp_path / ("missing.jsonl" if lines is None else "task.jsonl")
    if lines is not None:
        path.write_text("\n".join(lines))
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), downstream=f"{name}:{path}")
    with pytest.raises(ValueError) as refused:
        train.main(cfg)
    assert "\n" not in str(refused.value) and re.search(message, str(refused.value))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_format_a_misspelt_name_is_told_reads_the_file(tmp_path):
    """The fix the refusal above names, followed: the file reads as a hellaswag item."""
    path = write_jsonl(tmp_path / "task.jsonl", [json.loads(HELLASWAG_LINE)])
    with pytest.raises(ValueError, match=r"did you mean --downstream=(\w+):") as refused:
        downstream.read_items("hellaswg", str(path))
    [item] = downstream.read_items(refused.value.args[0].rsplit("=", 1)[1].split(":")[0],
                                   str(path))
    assert item.choices == ["d", "e"] and item.gold == 1


@pytest.mark.parametrize("overrides, message", [
    ({"downstream": "hellaswag"}, r"'hellaswag' is not NAME:PATH \(only nextline stands"),
    ({"downstream": "a:x.jsonl,a:y.jsonl"}, "names a task twice"),
    ({"downstream_every": 6}, r"downstream_every=6 must be a positive multiple of eval_every=4"),
    ({"downstream_items": 0}, "downstream_items=0 must be positive"),
])
def test_bad_downstream_knobs_are_refused(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        micro_config("data", str(tmp_path), **overrides)


def test_readmes_piqa_merge_runs_as_written_and_gives_piqa_items(tmp_path):
    """docs/tasks.md's Python lines that merge PIQA's valid-labels.lst into valid.jsonl, run as
    written in a fresh folder holding the two downloaded files: the file they write reads as
    piqa items, each gold the label of its line."""
    snippet = next(block for block in re.findall(r"```python\n(.*?)```",
                                                 (REPO / "docs" / "tasks.md").read_text(), re.S)
                   if "valid-labels.lst" in block)
    goals = [{"goal": f"goal {i}", "sol1": f"first {i}", "sol2": f"second {i}"} for i in range(3)]
    write_jsonl(tmp_path / "valid.jsonl", goals)
    (tmp_path / "valid-labels.lst").write_text("1\n0\n1\n")
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    items = downstream.read_items("piqa", str(tmp_path / "data/tasks/piqa_valid.jsonl"))
    assert [(i.context, i.choices, i.gold) for i in items] == [
        (f"Question: goal {i}\nAnswer:", [f"first {i}", f"second {i}"], gold)
        for i, gold in enumerate((1, 0, 1))]


def test_downstream_every_none_scores_every_evaluation_and_always_the_last_step(tmp_path):
    """README's knob: "downstream_every (steps between scorings, a multiple of eval_every;
    none: every evaluation, and always the last step)", at each evaluation of a run that
    evaluates every 2 steps, stops at 7, and was resumed at step 5 with a new source (which
    it evaluates at once); no task, no scoring."""
    evaluated = [0, 2, 4, 5, 6, 7]
    for every, scored in ((None, evaluated), (4, [0, 4, 7]), (6, [0, 6, 7])):
        cfg = micro_config("data", str(tmp_path), downstream="t:t.jsonl", eval_every=2,
                           downstream_every=every, stop_at_step=7, total_steps=7)
        assert [s for s in evaluated if downstream.due(cfg, s)] == scored, every
    assert not any(downstream.due(micro_config("data", str(tmp_path), stop_at_step=7,
                                               total_steps=7), s)
                   for s in evaluated)


def test_downstream_items_scores_a_files_first_n(small_data_dir, tmp_path):
    """downstream_items=N takes a file's first N items, as lm_eval --limit N takes the first
    N documents; none takes them all."""
    path = write_jsonl(tmp_path / "mine.jsonl", GENERIC)
    for n, want in ((2, GENERIC[:2]), (None, GENERIC)):
        cfg = micro_config(small_data_dir, str(tmp_path), downstream=f"mine:{path}",
                           downstream_items=n)
        [task] = downstream.load_tasks(cfg, small_data_dir, 1)
        assert [(i.context, i.choices, i.gold) for i in task.items] == \
            [(doc["context"], doc["choices"], doc["gold"]) for doc in want]
        assert task.n_sequences == sum(len(doc["choices"]) for doc in want)


def test_val_documents_are_read_back_from_every_kind_of_file_by_their_keys(tmp_path):
    """A corpus of a .jsonl, a .parquet, a .txt of several documents and a whole file: the
    val documents read back are the texts written under the keys val_documents.json lists
    (the oracle: the texts, by key), in its order; a file changed since is refused in one
    line naming the document."""
    import pyarrow
    import pyarrow.parquet

    import prepare
    texts = {f"{kind} document {i}\n" + "x = 1\n" * (i % 7): (kind, i)
             for kind in ("jsonl", "parquet", "txt") for i in range(60)}
    by_kind = {kind: [text for text, (k, _) in texts.items() if k == kind]
               for kind in ("jsonl", "parquet", "txt")}
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n"
                                          for text in by_kind["jsonl"]))
    pyarrow.parquet.write_table(pyarrow.table({"text": by_kind["parquet"]}), root / "b.parquet")
    (root / "c.txt").write_text("<|endoftext|>".join(by_kind["txt"]))
    (root / "d.py").write_text("whole = True\n")
    keyed = {**{f"a.jsonl:{i + 1}": t for i, t in enumerate(by_kind["jsonl"])},
             **{f"b.parquet:{i}": t for i, t in enumerate(by_kind["parquet"])},
             **{f"c.txt:{i}": t for i, t in enumerate(by_kind["txt"])}, "d.py": "whole = True\n"}
    out = tmp_path / "data"
    prepare.prepare(source=str(root), out_dir=str(out), vocab_size=300, val_fraction=0.2)
    keys = json.loads((out / "val_documents.json").read_text())
    assert {key.split(":")[0] for key in keys} >= {"a.jsonl", "b.parquet", "c.txt"}
    assert downstream.val_documents(str(out)) == [keyed[key] for key in keys]
    (root / "c.txt").write_text("changed")
    lost = next(key for key in keys if key.startswith("c.txt:") and key != "c.txt:0")
    with pytest.raises(ValueError, match=f"val document {lost} of {out} cannot be read from "
                                         f".*: the files it was prepared from have changed "
                                         f"since; restore them, or pass --downstream=nextline"):
        downstream.val_documents(str(out))


def test_the_next_line_items_are_fixed_and_ask_for_the_true_next_line(small_data_dir):
    """Runs of two seeds read the same items ("their seed is not the run's, so runs
    compare": the global RNGs a run seeds are seeded apart before each read); each gold
    choice is the line that follows its context in a val document, and no other choice is
    that line."""
    texts = downstream.val_documents(small_data_dir)
    first, again = [], []
    for seed, items in ((1337, first), (1338, again)):
        random.seed(seed)
        torch.manual_seed(seed)
        items += downstream.nextline_items(texts)
    assert first == again and len(first) > 50
    for item in first[:50]:
        assert len(item.choices) == 4 and item.choices.count(item.choices[item.gold]) == 1
        assert any(item.context + item.choices[item.gold] + "\n" in text + "\n"
                   for text in texts)


def test_a_next_line_items_context_and_distractors_are_as_readme_says(small_data_dir):
    """README: "The context is the whole lines before it, up to 1,000 characters; the
    choices are the true line and 3 of similar length from other val files." Each item's
    document and line (its `where`) give the oracle: the context is whole lines ending
    before the answer, under 1,000 characters, and one more line would reach 1,000 (or the
    document's start); each distractor is a line of another val document, its length within
    the 80 lengths nearest the answer's among all val lines (of 16 characters or more)."""
    texts = downstream.val_documents(small_data_dir)
    documents = [text.split("\n") for text in texts]
    lengths = sorted(len(line) for lines in documents for line in lines
                     if len(line.strip()) >= downstream.NEXTLINE_MIN_CHARS)
    items = downstream.nextline_items(texts)
    for item in items[:200]:
        d, number = map(int, item.where.split(":"))
        lines, answer = documents[d], item.choices[item.gold][1:]
        assert answer == lines[number - 1]
        start = next(k for k in range(number - 1) if "\n".join(lines[k:number - 1]) ==
                     item.context)  # whole lines, the last one just before the answer
        assert len(item.context) < 1000
        assert start == 0 or len("\n".join(lines[start - 1:number - 1])) >= 1000
        near = bisect.bisect_left(lengths, len(answer))
        low, high = lengths[max(0, near - 40)], lengths[min(len(lengths) - 1, near + 39)]
        for j, choice in enumerate(item.choices):
            if j != item.gold:
                assert any(choice[1:] in other for e, other in enumerate(documents) if e != d)
                assert low <= len(choice) - 1 <= high, (len(answer), len(choice) - 1)
    assert any(len(item.context) > 900 for item in items)  # the bound is reached


# --- the next-line task serves the run it is in --------------------------------------------

def continuation_tokens(tokenizer: Tokenizer, context: str, choice: str) -> int:
    """A choice's tokens as lm-eval counts them: " " + choice after the context, the
    context's trailing whitespace moved to it, the whole encoded past the context's count."""
    kept = context.rstrip()
    whole = tokenizer.encode(context + " " + choice).ids
    return len(whole) - len(tokenizer.encode(kept).ids)


def test_bare_nextline_reads_the_runs_own_data_and_leaves_out_what_cannot_fit(
        small_data_dir, tmp_path, monkeypatch):
    """`--downstream=nextline` on a run of its own 512-token corpus at seq_len 24, in a
    folder without data/stdlib-4k: the items are that corpus's, said so, and exactly those
    of its next-line items whose every choice fits in 24 tokens (the oracle: each choice
    counted with the tokenizer alone), in their order; some do not fit, and are not made.
    Nothing else is read or prepared."""
    monkeypatch.chdir(tmp_path)
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), downstream="nextline",
                       downstream_items=30, seq_len=24, global_batch_tokens=96)
    assert config.parse_downstream(cfg.downstream) == [("nextline", None)]
    assert downstream.corpora(cfg) == []  # nothing for the run to prepare
    [task] = downstream.load_tasks(cfg, small_data_dir, 1)
    assert task.origin == f"{small_data_dir}'s val documents"
    tokenizer = Tokenizer.from_file(str(Path(small_data_dir) / "tokenizer.json"))
    made = downstream.nextline_items(downstream.val_documents(small_data_dir))
    fits, left_out = [], 0
    for item in made:  # in order, until 30 fit
        if all(continuation_tokens(tokenizer, item.context, c) <= 24 for c in item.choices):
            fits.append(item)
        else:
            left_out += 1
        if len(fits) == 30:
            break
    assert task.items == fits and left_out > 0
    # the run: tiny on a corpus of its own, another vocabulary, a shorter seq_len
    tiny, _ = overrides.parse_args(["--preset", "tiny", f"--data_dir={small_data_dir}",
                                 "--model.vocab_size=512", "--seq_len=64"])
    [task] = downstream.load_tasks(tiny, small_data_dir, 1)
    assert len(task.items) == config.TINY_ITEMS
    assert task.origin == f"{small_data_dir}'s val documents"
    assert not Path("data").exists()


def fake_stdlib(root: Path) -> list[str]:
    """A stand-in for the standard library, for prepare.stdlib_files: 120 modules of a few
    lines, named so that four of them hash into the built-in corpus's 1% val split."""
    names = [f"m{i}.py" for i in range(5000)]
    val = [n for n in names if prepare.is_val(n, prepare.DEFAULT_VAL_FRACTION)][:4]
    train = [n for n in names if n not in val][:116]
    for n, name in enumerate(sorted(val + train)):
        (root / name).write_text("".join(f"value_{n}_{j} = compute('{'x' * (n % 9 + j)}')\n"
                                         for j in range(12)))
    return sorted(val)


def test_where_the_runs_data_cannot_serve_it_nextline_reads_the_built_in_val_files(
        tmp_path, monkeypatch):
    """The fallback reads the built-in corpus's val files where they are, with nothing
    prepared: the same texts, in the same order, as the val documents of the built-in
    corpus prepare.py prepares (the oracle: its val_documents.json, read back), on a stand-in
    standard library. A run whose data came from a Hugging Face dataset takes its items from
    there, and says why; `nextline:THAT_DATA` is refused, naming the dataset (not a path
    error), and the fix it names (bare nextline) serves."""
    datasets = pytest.importorskip("datasets")
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    val = fake_stdlib(stdlib)
    monkeypatch.setattr(prepare, "stdlib_files",
                        lambda: (stdlib, sorted(stdlib.glob("*.py"))))
    prepare.prepare(out_dir=str(tmp_path / "stdlib-0k"), vocab_size=300)
    prepared = downstream.val_documents(str(tmp_path / "stdlib-0k"))
    assert prepare.builtin_val_documents() == prepared
    assert prepared == [(stdlib / name).read_text() for name in val]
    rows = [f"def f{i}(x):\n    return x + {i}\n" * (i % 5 + 2) for i in range(60)]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(tmp_path / "hf")
    hub = tmp_path / "from-hub"
    prepare.prepare(str(tmp_path / "hf"), str(hub), vocab_size=300, val_fraction=0.2)
    items, origin = downstream.nextline_task(None, str(hub))
    assert items == downstream.nextline_items(prepared)
    assert origin == (f"the built-in corpus's val files, read from the standard library "
                      f"({hub} was prepared from the Hugging Face dataset {tmp_path / 'hf'}, "
                      f"and nextline reads val documents back from local files alone)")
    # a source that is no longer there: a hub name's keys are NAME:N, a folder's are paths
    assert prepare.from_dataset("org/name", ["org/name:0", "org/name:7"])
    assert not prepare.from_dataset("gone", ["a.txt", "b.jsonl:3"])  # a moved folder
    assert not prepare.from_dataset("docs.jsonl", ["docs.jsonl:1"])  # a local file's keys
    with pytest.raises(ValueError, match=f"downstream task nextline:{hub}: {hub} was prepared "
                                         f"from the Hugging Face dataset .*; point it at a "
                                         f"corpus prepared from local files, or pass "
                                         f"--downstream=nextline \\(the run's own data"):
        downstream.nextline_task(str(hub), str(hub))


def test_nextline_of_moved_files_or_raw_text_says_so_and_the_fix_serves(small_data_dir,
                                                                        tmp_path, monkeypatch):
    """A corpus whose source folder moved: the refusal says the folder is not there now
    (not that the corpus is of the wrong kind), and putting it back serves. A folder of raw
    text: the prepare command it names, then the --downstream value it names, serve; the
    value is --downstream's, not --data_dir's."""
    monkeypatch.chdir(tmp_path)
    raw = Path("raw")
    raw.mkdir()
    for i in range(400):  # about 1% of them hash into val at prepare's default
        (raw / f"f{i}.txt").write_text("".join(f"line {j} of file {i}: {'y' * (3 * j + i % 7)}\n"
                                              for j in range(8)))
    prepare.prepare(str(raw), "moved", vocab_size=300)
    raw.rename("raw-elsewhere")
    with pytest.raises(ValueError, match=f"downstream task nextline:moved: moved was prepared "
                                         f"from raw \\({tmp_path / 'raw'}\\), which is not there "
                                         f"now.*; put it back there, or pass "
                                         f"--downstream=nextline"):
        downstream.nextline_task("moved", small_data_dir)
    items, origin = downstream.nextline_task(None, "moved")  # bare: the run's own, moved
    assert items and origin.startswith("the built-in corpus's val files, read from the "
                                       "standard library (") and "not there now" in origin
    Path("raw-elsewhere").rename(raw)
    assert downstream.nextline_task("moved", small_data_dir)[0]
    with pytest.raises(ValueError) as refused:
        downstream.nextline_task("raw", small_data_dir)
    message = str(refused.value)
    assert message.startswith("downstream task nextline:raw: raw/manifest.json is missing")
    command, value = message.split("`")[1], message.rsplit("then pass ", 1)[1]
    assert command.startswith("python prepare.py ") and value.startswith("--downstream=nextline:")
    prepare.main(shlex.split(command)[2:])
    items, origin = downstream.nextline_task(value.split(":", 1)[1], small_data_dir)
    assert items and origin == f"{value.split(':', 1)[1]}'s val documents"


def test_nextline_that_cannot_serve_says_why_and_bare_nextline_falls_back(small_data_dir,
                                                                          tmp_path):
    """Val documents with no line to ask about (every line under NEXTLINE_MIN_CHARS), and a
    corpus an older stacklm prepared (no list of val documents): `nextline:D` is refused
    naming which, with the fixes; bare `nextline` on such a run reads the built-in val files
    and the banner's origin says why. Items none of which fits seq_len are refused."""
    raw = tmp_path / "short"
    raw.mkdir()
    for i in range(200):
        (raw / f"f{i}.txt").write_text("".join(f"v{i} = {j}\n" for j in range(8)))
    short = str(tmp_path / "short_data")
    prepare.prepare(str(raw), short, vocab_size=300, val_fraction=0.2)
    with pytest.raises(ValueError, match=f"downstream task nextline:{short}: {short}'s [0-9]+ "
                                         f"val documents have no line to ask about .*prepare "
                                         f"it with a larger --val_fraction"):
        downstream.nextline_task(short, small_data_dir)
    items, origin = downstream.nextline_task(None, short)
    assert items and origin == ("the built-in corpus's val files, read from the standard "
                                f"library ({short}'s val documents have no line to ask about)")

    older = tmp_path / "older"
    shutil.copytree(small_data_dir, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["splits"]["val"]["keys"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"nextline:{older}: {older} was prepared by an older "
                                         f"stacklm, .*; prepare it again, or pass "
                                         f"--downstream=nextline"):
        downstream.nextline_task(str(older), small_data_dir)
    assert "was prepared by an older stacklm" in downstream.nextline_task(None, str(older))[1]

    made = downstream.nextline_items(downstream.val_documents(small_data_dir))
    tokenizer = Tokenizer.from_file(str(Path(small_data_dir) / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"none of its {len(made):,} items fits seq_len=1 "
                                         f"\\(each choice is a whole line\\); raise --seq_len"):
        downstream.fitting(made, tokenizer, 1, None)


def test_the_report_draws_accuracy_against_chance_and_compares_the_finals(tmp_path):
    """A hand-made log with two scorings of one task: the panel's lines hold the logged
    numbers and chance, the results table a row, and two runs compared a column."""
    from test_report import start_record, train_record, write_log
    evals = [{"kind": "eval", "step": s, "tokens_seen": s * 100, "val_loss": 4.0,
              "val_bpb": 1.8, "acc/t": a, "acc_norm/t": n, "chance/t": 0.25}
             for s, a, n in ((0, 0.2, 0.25), (10, 0.3, 0.4))]
    for name in ("a", "b"):
        write_log(tmp_path / name, [start_record(stop_at_step=10), train_record(10, 4.0),
                                    *evals, {"kind": "end", "step": 10, "outcome": "finished",
                                             "error": None, "elapsed_s": 1.0}])
    run = report.read_run(tmp_path / "a")
    fig = report.draw([run])
    [norm] = [l for ax in fig.axes for l in ax.lines if l.get_gid() == "acc_norm/t"]
    [chance] = [l for ax in fig.axes for l in ax.lines if l.get_gid() == "chance/t"]
    assert list(norm.get_ydata()) == [0.25, 0.4] and list(chance.get_ydata()) == [0.25, 0.25]
    report.write([tmp_path / "a"])
    assert "| t acc_norm / acc, step 10 | 0.4000 / 0.3000 (chance 0.2500) |" in (
        tmp_path / "a" / "report.md").read_text()
    both = report.draw([run, report.read_run(tmp_path / "b")])
    [chance] = [l for ax in both.axes for l in ax.lines if l.get_gid() == "chance/t"]
    assert chance.get_label() == "t chance"  # once: chance is the task's, not a run's
    report.write([tmp_path / "a", tmp_path / "b"], tmp_path / "both")
    finals = (tmp_path / "both" / "report.md").read_text()
    assert "| wall time | t acc_norm / acc |" in finals and finals.count("0.4000 / 0.3000 |") == 2


def test_runs_compared_draw_the_accuracy_panel_when_only_a_later_run_scored(tmp_path,
                                                                           monkeypatch):
    """`python report.py A B --out C` where A scored no task and B scored t: the figure
    still has the accuracy panel, holding B's curves (its logged numbers) and t's chance,
    in grey (it is the task's, not a run's); the finals have a t column, n/a for A."""
    from test_report import start_record, train_record, write_log
    plain = [{"kind": "eval", "step": s, "tokens_seen": s * 100, "val_loss": 4.0,
              "val_bpb": 1.8} for s in (0, 10)]
    scored = [{**r, "acc/t": a, "acc_norm/t": n, "chance/t": 0.25}
              for r, a, n in zip(plain, (0.2, 0.3), (0.25, 0.4))]
    end = {"kind": "end", "step": 10, "outcome": "finished", "error": None, "elapsed_s": 1.0}
    for name, evals in (("a", plain), ("b", scored)):
        write_log(tmp_path / name, [start_record(stop_at_step=10), train_record(10, 4.0),
                                    *evals, end])
    drawn, draw = [], report.draw
    monkeypatch.setattr(report, "draw", lambda *a, **k: drawn.append(draw(*a, **k)) or drawn[-1])
    report.cli([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "both"),
                "--quiet"])
    [panel] = [ax for ax in drawn[0].axes if ax.get_title(loc="left") == report.ACCURACY]
    lines = {line.get_gid(): line for line in panel.lines
             if not line.get_gid().startswith("boundary:")}
    assert lines.keys() == {"acc_norm/t", "acc/t", "chance/t"}
    assert list(lines["acc_norm/t"].get_ydata()) == [0.25, 0.4]
    assert list(lines["acc/t"].get_ydata()) == [0.2, 0.3]
    assert lines["acc_norm/t"].get_label() == "b t acc_norm"
    assert list(lines["chance/t"].get_ydata()) == [0.25, 0.25]
    assert to_rgba(lines["chance/t"].get_color()) == to_rgba("0.5")  # the task's, in grey
    finals = (tmp_path / "both" / "report.md").read_text()
    assert "| wall time | t acc_norm / acc |" in finals
    assert re.search(r"^\| a \|.* \| n/a \|$", finals, re.M)
    assert re.search(r"^\| b \|.* \| 0\.4000 / 0\.3000 \|$", finals, re.M)


def test_the_picks_follow_lm_eval_process_results():
    """An explicit table. lls -2 and -5 for choices "é" and "abc": acc takes the larger
    sum (0); acc_norm divides by characters, 1 and 3 (-2 < -1.67: choice 1), not by the
    continuation's 2 and 4 (" é", " abc": -1 > -1.25, choice 0); acc_bytes by UTF-8 bytes,
    2 and 3 (-1 > -1.67: choice 0). A tie goes to the first choice, as np.argmax."""
    items = [downstream.Item("x", ["é", "abc"], 0, ""), downstream.Item("x", ["ab", "cd"], 1, "")]
    assert downstream.predictions(items, [-2.0, -5.0, -3.0, -3.0]).tolist() == [[0, 1, 0],
                                                                                [0, 0, 0]]
