"""Downstream tasks in the loop: multiple-choice accuracy beside the val loss, scored as
lm-evaluation-harness 0.4.13 scores its `multiple_choice` tasks, so that a run's acc and
acc_norm are the numbers `lm_eval` gives on its export (docs/tasks.md).

An item is a context, its choices and the index of the gold one. lm-eval's rules, read in
its lm_eval/api/task.py, api/model.py and models/huggingface.py:

- Each choice's continuation is " " + choice (target_delimiter), after the context.
- A pair is encoded as `_encode_pair` does: whitespace that ends the context moves to the
  front of the continuation; context + continuation is encoded whole and the context alone;
  the continuation's tokens are the whole's past the context's count. Nothing is added in
  front: the export's tokenizer adds no BOS, and lm-eval's default (add_bos_token unset)
  adds what the tokenizer adds. An empty context (lm-eval's prefix-token case) is refused.
- Too long an item loses tokens from the left, as `_loglikelihood_tokens` truncates: the
  last T + 1 tokens of context + continuation are kept and all but the last are fed in.
  T is seq_len here; lm-eval's is the export's max_position_embeddings (model.max_seq_len),
  the same in both presets. A file's continuation longer than T is refused, as lm-eval
  asserts; nextline, which makes its own items, makes none that cannot fit.
- A choice's log-likelihood is the sum over its continuation's tokens of
  log p(token | all before it). acc: the argmax of the sums is the gold choice; acc_norm:
  the argmax of sum / len(choice) in characters (the choice's own length, without the
  delimiter's space); acc_bytes: of sum / its UTF-8 bytes. A tie goes to the first choice
  (np.argmax). Each is a mean over items; chance is the mean of 1 / choices.

Packing. Each (context, choice) is one sequence of L <= T inputs. Sequences are laid end to
end in rows of T (next-fit, in item order), with `seq_ids` numbering the sequences of a row
and `position_ids` restarting at 0 in each, as data.py's batches do: attention never
crosses a sequence, so each reads as if alone, and the choices of an item share forwards.
Targets are -100 except on continuation tokens, and `sequence` says whose each one is:

    input_ids, targets, position_ids, seq_ids, sequence   (R, T) int64 for a task's R rows
    per forward (B, T) -> per-target ce (B·T,) -> summed into lls (n_sequences,) float64

Ranks. Rows are dealt like val windows: global micro-batch k is rows [k·B·W, (k+1)·B·W) and
rank r takes its r-th block of B; past the last row a rank runs rows without targets, so
every rank runs every forward, as FSDP2 needs. A rank adds its sequences' log-likelihoods
into a vector over all sequences, zero elsewhere; one sum over the ranks gives every rank
each value once, on any rank count, and all of them the same accuracies.

Tasks (--downstream=NAME:PATH,…), read in setup: a missing file, or a line that is not an
item of its format, is refused in one line naming the file and line, and what a line of
the format holds. A file's items are its first downstream_items (lm_eval --limit N takes
the first N documents too).

    hellaswag       JSONL as distributed (hellaswag_val.jsonl): activity_label, ctx_a,
                    ctx_b, endings, label; lm-eval's utils.process_docs builds the item
    arc_easy,       JSONL of AI2's ARC release (question.stem, question.choices[{text,
    arc_challenge   label}], answerKey) or of its Hugging Face rows (question, choices.text,
                    choices.label, answerKey): "Question: {q}\\nAnswer:"
    piqa            JSONL of goal, sol1, sol2, label: "Question: {goal}\\nAnswer:"
    nextline        the next line of a val document given the lines before it
                    (NEXTLINE_*): PATH's, a corpus prepared from local files; bare
                    `nextline`, the run's own data's, or where those cannot serve, the
                    built-in corpus's val files (nextline_task)
    any other name  JSONL of {"context": str, "choices": [str, ...], "gold": int}

Imports from stacklm: config (the task list's syntax), shards (a corpus's manifest and its
val documents' keys) and prepare (how a key names a document, and reading it).
"""

import bisect
import difflib
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

import config
import prepare
from plumbing import shards

# The next-line task. Lines shorter than this (`else:`, `)`) recur across files, so a
# distractor could be the answer itself; each context is the whole lines before the answer
# that fit in NEXTLINE_CONTEXT_CHARS (a few hundred tokens: it bounds the cost, and T cuts
# longer ones anyway). The seed is fixed, not the run's, so every run scores the same items.
NEXTLINE_MIN_CHARS = 16
NEXTLINE_CONTEXT_CHARS = 1000
NEXTLINE_CHOICES = 4  # the true line and 3 of similar length from other val documents
NEXTLINE_NEIGHBOURS = 40  # distractors are drawn from the lines nearest in length
NEXTLINE_SEED = 0
# What bare `nextline` reads, for the refusals of `nextline:PATH` that suggest it.
NEXTLINE_FALLBACK = ("the run's own data, or the built-in corpus's val files where it "
                     "cannot serve")


class Item(NamedTuple):
    context: str
    choices: list[str]
    gold: int  # the index of the right choice
    # FILE:LINE it was read from; nextline's items D:L, line L (from 1) of val document D
    # (from 0, in val_documents.json's order)
    where: str


@dataclass
class Task:
    name: str
    origin: str  # where its items come from: a file, or the documents nextline read
    items: list[Item]
    rows: dict[str, np.ndarray]  # the packed sequences, (R, T) each (see the docstring)
    n_sequences: int  # one per (item, choice), in item order
    forward_tokens: int  # what one scoring feeds the model, all ranks together

    @property
    def chance(self) -> float:
        return sum(1 / len(item.choices) for item in self.items) / len(self.items)


def describe(tasks: list[Task]) -> dict[str, dict]:
    """What the banner says of each task: its items and where they come from, chance, and
    forward tokens per scoring."""
    return {task.name: {"items": len(task.items), "from": task.origin, "chance": task.chance,
                        "forward_tokens": task.forward_tokens} for task in tasks}


def due(cfg, step: int) -> bool:
    """Whether the evaluation at `step` scores the tasks: every evaluation when
    downstream_every is none (a resume's evaluation of a new source too), else those every
    downstream_every steps, and the last step's, so the final figures are the run's own."""
    every = cfg.downstream_every
    return bool(cfg.downstream) and (every is None or step % every == 0
                                     or step == cfg.stop_at_step)


def corpora(cfg) -> list[str]:
    """The prepared corpora the tasks name (nextline:PATH's), which the run prepares first
    when one is the built-in corpus."""
    return [path for name, path in config.parse_downstream(cfg.downstream)
            if name == "nextline" and path]


def load_tasks(cfg, data_dir: str, world: int) -> list[Task]:
    """Every task of cfg.downstream: read, checked, encoded with the run's tokenizer (that
    of data_dir, its first source) and packed for `world` ranks, before any compute."""
    tokenizer = Tokenizer.from_file(shards.tokenizer_path(data_dir))
    tasks = []
    for name, path in config.parse_downstream(cfg.downstream):
        if name == "nextline":
            made, origin = nextline_task(path, data_dir)
            items, sequences = fitting(made, tokenizer, cfg.seq_len, cfg.downstream_items)
        else:
            items, origin = read_items(name, path)[:cfg.downstream_items], path
            sequences = encoded(items, tokenizer, cfg.seq_len, name)
        rows = pack(sequences, cfg.seq_len)
        per_forward = cfg.micro_batch_size * world  # rows, all ranks together
        forwards = math.ceil(len(rows["input_ids"]) / per_forward)
        tasks.append(Task(name, origin, items, rows, len(sequences),
                          forwards * per_forward * cfg.seq_len))
    return tasks


# ---------------------------------------------------------------------------------------
# Reading the tasks
# ---------------------------------------------------------------------------------------

def read_items(name: str, path: str) -> list[Item]:
    """A task file's items, read by its name's format (the generic one for any other)."""
    return read_jsonl(path, READERS.get(name, generic_item), name)


def read_jsonl(path: str, reader, name: str) -> list[Item]:
    """One item per non-blank line, each checked; the first bad line is refused."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"downstream task {name}: cannot read {path} ({e.__class__.__name__}: "
                         f"{e}); docs/tasks.md says where each file comes from") from None
    items = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                items.append(checked(reader(json.loads(line), f"{path}:{number}")))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                what = with_article("generic" if reader is generic_item else name)
                raise ValueError(f"{path}:{number}: not {what} item ({e.__class__.__name__}: "
                                 f"{e}); {line_format(name, path)}") from None
    if not items:
        raise ValueError(f"{path}: no items (an empty file); downstream task {name} needs "
                         f"some: put them in it, or drop {name} from --downstream")
    return items


def line_format(name: str, path: str) -> str:
    """What each line of a task's file must hold, for the refusal of one that does not: its
    format's fields, or where the name is no format's (hellaswg), the generic item, and the
    format it may have meant."""
    if name in FIELDS:
        return (f"each line of {with_article(name)} file holds {FIELDS[name]} (docs/tasks.md)")
    close = difflib.get_close_matches(name, [*READERS, "nextline"], n=1)
    meant = f"; did you mean --downstream={close[0]}:{path}?" if close else ""
    return (f"{name} is not a format's name ({', '.join([*READERS, 'nextline'])}), so each "
            f"line must be a generic item, {{\"context\": str, \"choices\": [str, ...], "
            f"\"gold\": int}}{meant}")


def with_article(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def checked(item: Item) -> Item:
    """What scoring needs of an item, whatever its format."""
    if not isinstance(item.context, str) or not item.context.strip():
        raise ValueError("the context is empty (lm-eval scores that from a prefix token: "
                         "not supported)")
    if not (isinstance(item.choices, list) and len(item.choices) >= 2
            and all(isinstance(c, str) and c for c in item.choices)):
        raise ValueError(f"choices must be 2 or more non-empty strings, not {item.choices!r}")
    if type(item.gold) is not int or not 0 <= item.gold < len(item.choices):
        raise ValueError(f"gold {item.gold!r} is not the index of one of the "
                         f"{len(item.choices)} choices (0 to {len(item.choices) - 1})")
    return item


def hellaswag_item(doc: dict, where: str) -> Item:
    """lm-eval's hellaswag (tasks/hellaswag/utils.py): the query is activity_label: ctx_a
    Ctx_b, and each ending a choice, all through its preprocess."""
    context = doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return Item(hellaswag_text(context), [hellaswag_text(e) for e in doc["endings"]],
                int(doc["label"]), where)


def hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's " [title]" becomes ". ", other [tags] go,
    and double spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def arc_item(doc: dict, where: str) -> Item:
    """lm-eval's arc_easy.yaml (arc_challenge includes it): gold is the answerKey's place
    among the choices' labels (letters, or digits in some questions)."""
    question, choices = doc["question"], doc.get("choices")
    if isinstance(question, dict):  # AI2's release nests them under question
        choices = {key: [c[key] for c in question["choices"]] for key in ("text", "label")}
        question = question["stem"]
    labels = list(choices["label"])
    if doc["answerKey"] not in labels:
        raise ValueError(f"answerKey {doc['answerKey']!r} is not one of its choices' labels "
                         f"{labels}")
    return Item(f"Question: {question}\nAnswer:", list(choices["text"]),
                labels.index(doc["answerKey"]), where)


def piqa_item(doc: dict, where: str) -> Item:
    """lm-eval's piqa.yaml; the label comes from valid-labels.lst, merged in (docs/tasks.md)."""
    if "label" not in doc:
        raise KeyError("label (PIQA's valid.jsonl has none: merge valid-labels.lst in)")
    return Item(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]],
                int(doc["label"]), where)


def generic_item(doc: dict, where: str) -> Item:
    return Item(doc["context"], doc["choices"], doc["gold"], where)


READERS = {"hellaswag": hellaswag_item, "arc_easy": arc_item, "arc_challenge": arc_item,
           "piqa": piqa_item}
ARC_FIELDS = ("question (its stem and choices, each a text and a label) and answerKey, as "
              "AI2's release writes it, or question, choices.text, choices.label and "
              "answerKey, as the Hub's rows")
FIELDS = {"hellaswag": "activity_label, ctx_a, ctx_b, endings and label",
          "arc_easy": ARC_FIELDS, "arc_challenge": ARC_FIELDS,
          "piqa": "goal, sol1, sol2 and label (valid-labels.lst merged in)"}


# ---------------------------------------------------------------------------------------
# The next-line task, from a corpus's val documents
# ---------------------------------------------------------------------------------------

def nextline_task(path: str | None, data_dir: str) -> tuple[list[Item], str]:
    """nextline's items and where they come from, for the banner. `nextline:PATH`: PATH's
    val documents, or a refusal that says why they cannot serve. Bare `nextline`, the task
    serves the run it is in: the val documents of its own data (data_dir, its first
    source), or where those cannot serve (a corpus prepared from a Hugging Face dataset,
    files moved since, no line to ask about), the built-in corpus's val files, read from
    the standard library: nothing is prepared for it."""
    if path:
        texts = val_documents(path)
        items = nextline_items(texts)
        if not items:
            raise ValueError(f"downstream task nextline:{path}: {path}'s {len(texts):,} val "
                             f"documents have no line to ask about (one of "
                             f"{NEXTLINE_MIN_CHARS}+ characters after another, with "
                             f"{NEXTLINE_CHOICES - 1} lines like it in other val documents); "
                             f"prepare it with a larger --val_fraction, point it at a larger "
                             f"corpus, or pass --downstream=nextline ({NEXTLINE_FALLBACK})")
        return items, f"{path}'s val documents"
    texts, why, _ = read_back(shards.load_manifest(data_dir), data_dir)
    items = nextline_items(texts)
    if items:
        return items, f"{data_dir}'s val documents"
    why = why or f"{data_dir}'s val documents have no line to ask about"
    return (nextline_items(prepare.builtin_val_documents()),
            f"the built-in corpus's val files, read from the standard library ({why})")


def nextline_items(documents: list[str]) -> list[Item]:
    """Every line of at least NEXTLINE_MIN_CHARS (after the first of its document) as an
    item, in a seeded order: the context is the lines before it, the choices are "\\n" +
    the line and 3 lines of similar length from other documents, the gold at a seeded
    place. The "\\n" keeps the delimiter's space at the end of the line before, not in the
    indentation that Python reads. No items where no line qualifies."""
    documents = [text.split("\n") for text in documents]
    pool = sorted((len(line), line, d) for d, lines in enumerate(documents)
                  for line in lines if len(line.strip()) >= NEXTLINE_MIN_CHARS)
    lengths = [length for length, _, _ in pool]
    rng = random.Random(NEXTLINE_SEED)
    places = [(d, i) for d, lines in enumerate(documents) for i in range(1, len(lines))
              if len(lines[i].strip()) >= NEXTLINE_MIN_CHARS]
    rng.shuffle(places)
    items = []
    for d, i in places:
        context, line = context_before(documents[d], i), documents[d][i]
        near = bisect.bisect_left(lengths, len(line))
        others = sorted({other for _, other, e in pool[max(0, near - NEXTLINE_NEIGHBOURS):
                                                        near + NEXTLINE_NEIGHBOURS]
                         if e != d and other != line})
        if context.strip() and len(others) >= NEXTLINE_CHOICES - 1:
            choices = rng.sample(others, NEXTLINE_CHOICES - 1)
            gold = rng.randrange(NEXTLINE_CHOICES)
            choices.insert(gold, line)
            items.append(Item(context, ["\n" + c for c in choices], gold, f"{d}:{i + 1}"))
    return items


def context_before(lines: list[str], i: int) -> str:
    """The whole lines before line i that fit in NEXTLINE_CONTEXT_CHARS, joined."""
    start, size = i, 0
    while start > 0 and size + len(lines[start - 1]) + 1 <= NEXTLINE_CONTEXT_CHARS:
        start -= 1
        size += len(lines[start]) + 1
    return "\n".join(lines[start:i])


def val_documents(data_dir: str) -> list[str]:
    """The texts of a prepared corpus's val documents, in stream order (read_back), or a
    refusal naming why they cannot be read and what would serve."""
    try:
        manifest = shards.load_manifest(data_dir, flag="--downstream=nextline:")
    except (OSError, ValueError) as e:
        raise ValueError(f"downstream task nextline:{data_dir}: {e}") from None
    texts, why, fix = read_back(manifest, data_dir)
    if why:
        raise ValueError(f"downstream task nextline:{data_dir}: {why}; {fix}, or pass "
                         f"--downstream=nextline ({NEXTLINE_FALLBACK})")
    return texts


def read_back(manifest: dict, data_dir: str) -> tuple[list[str], str | None, str | None]:
    """data_dir's val documents, in stream order, read again from the files their keys
    name, as prepare.py read them (prepare.file_documents); or none, why not, and what
    would let them be read."""
    keys_file = manifest["splits"]["val"].get("keys")
    if not keys_file:
        return [], (f"{data_dir} was prepared by an older stacklm, which did not list its val "
                    f"documents ({shards.VAL_KEYS_FILE})"), "prepare it again"
    keys = json.loads((Path(data_dir) / keys_file).read_text(encoding="utf-8"))
    source = manifest["source"]
    if prepare.from_dataset(source, keys):
        return [], (f"{data_dir} was prepared from the Hugging Face dataset {source}, and "
                    f"nextline reads val documents back from local files alone"), \
            "point it at a corpus prepared from local files"
    root = prepare.source_root(source)
    if root is None:
        return [], (f"{data_dir} was prepared from {source} ({Path(source).resolve()}), which "
                    f"is not there now, and nextline reads its val documents back from it"), \
            "put it back there"
    wanted, found, skipped = set(keys), {}, []
    for path in dict.fromkeys(root / prepare.key_file(key) for key in keys):
        found.update((key, text) for key, text in prepare.file_documents(
            path, root, manifest["text_field"], skipped) if key in wanted)
    lost = [key for key in keys if key not in found]
    if lost:
        reason = f" ({' '.join(skipped[0]['reason'].split())})" if skipped else ""
        return [], (f"val document {lost[0]} of {data_dir} cannot be read from {root}{reason}: "
                    f"the files it was prepared from have changed since"), "restore them"
    return [found[key] for key in keys], None, None


# ---------------------------------------------------------------------------------------
# Encoding and packing
# ---------------------------------------------------------------------------------------

def encode(items: list[Item], tokenizer: Tokenizer,
           seq_len: int) -> list[list[tuple[list[int], int]]]:
    """Each item's choices as (its last <= T + 1 tokens, how many of them are the
    continuation's), by lm-eval's `_encode_pair` and left truncation."""
    pairs = [encode_pair_text(item.context, " " + choice)
             for item in items for choice in item.choices]
    wholes = tokenizer.encode_batch([context + continuation for context, continuation in pairs])
    contexts = tokenizer.encode_batch([context for context, _ in pairs])
    sequences = []
    for whole, context in zip(wholes, contexts, strict=True):
        continuation = whole.ids[len(context.ids):]
        sequences.append(((context.ids + continuation)[-(seq_len + 1):], len(continuation)))
    starts = np.cumsum([0] + [len(item.choices) for item in items])
    return [sequences[a:b] for a, b in zip(starts[:-1], starts[1:])]


def encoded(items: list[Item], tokenizer: Tokenizer, seq_len: int,
            name: str) -> list[tuple[list[int], int]]:
    """A task file's sequences, item by item; a choice longer than T is refused, as lm-eval
    refuses it."""
    sequences = []
    for item, choices in zip(items, encode(items, tokenizer, seq_len), strict=True):
        longest = max(n for _, n in choices)
        if longest > seq_len:
            raise ValueError(f"{item.where}: a choice of {longest:,} tokens is longer than "
                             f"seq_len={seq_len:,} (lm-eval refuses it too); drop the item "
                             f"from downstream task {name}, or raise --seq_len")
        sequences += choices
    return sequences


def fitting(items: list[Item], tokenizer: Tokenizer, seq_len: int,
            wanted: int | None) -> tuple[list[Item], list[tuple[list[int], int]]]:
    """nextline's first `wanted` items (None: all) whose every choice fits in T, and their
    sequences. The task makes its own items, so one that cannot fit the run is not made
    (a file's is refused: `encoded`). They are encoded `wanted` at a time, so the cost is
    about the items kept."""
    kept, sequences, step = [], [], wanted or max(len(items), 1)
    for start in range(0, len(items), step):
        chunk = items[start:start + step]
        for item, choices in zip(chunk, encode(chunk, tokenizer, seq_len), strict=True):
            if len(kept) < step and all(n <= seq_len for _, n in choices):
                kept.append(item)
                sequences += choices
        if len(kept) == step:
            break
    if not kept:
        raise ValueError(f"downstream task nextline: none of its {len(items):,} items fits "
                         f"seq_len={seq_len:,} (each choice is a whole line); raise "
                         f"--seq_len, or drop nextline from --downstream")
    return kept, sequences


def encode_pair_text(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's `_encode_pair` moves the context's trailing whitespace to the continuation."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + continuation) if spaces else \
        (context, continuation)


def pack(sequences: list[tuple[list[int], int]], seq_len: int) -> dict[str, np.ndarray]:
    """The sequences end to end in rows of T (next-fit, in order): (R, T) arrays."""
    rows, used = [], seq_len
    for k, (tokens, _) in enumerate(sequences):
        if used + len(tokens) - 1 > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(k)
        used += len(tokens) - 1
    fill = {"input_ids": 0, "targets": -100, "position_ids": 0, "seq_ids": 0, "sequence": -1}
    out = {key: np.full((len(rows), seq_len), value, np.int64) for key, value in fill.items()}
    for r, members in enumerate(rows):
        at = 0
        for j, k in enumerate(members):
            tokens, n = sequences[k]
            end = at + len(tokens) - 1  # the inputs are all tokens but the last
            out["input_ids"][r, at:end] = tokens[:-1]
            out["position_ids"][r, at:end] = np.arange(end - at)
            out["seq_ids"][r, at:end] = j
            out["targets"][r, end - n:end] = tokens[-n:]  # the continuation's tokens only
            out["sequence"][r, end - n:end] = k
            at = end
    return out


# ---------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def score(tasks: list[Task], model, accelerator, micro_batch_size: int) -> dict:
    """acc, acc_norm and acc_bytes of every task (`acc/<name>`, …) and its chance, the
    same on every rank."""
    metrics = {}
    model.eval()
    for task in tasks:
        lls = loglikelihoods(task, model, accelerator.device, micro_batch_size,
                             accelerator.process_index, accelerator.num_processes)
        lls = accelerator.reduce(lls, "sum").tolist()  # each sequence from its one rank
        hits = predictions(task.items, lls) == np.array([[item.gold] for item in task.items])
        for j, metric in enumerate(("acc", "acc_norm", "acc_bytes")):
            metrics[f"{metric}/{task.name}"] = float(hits[:, j].mean())
        metrics[f"chance/{task.name}"] = task.chance
    model.train()
    return metrics


def loglikelihoods(task: Task, model, device, batch: int, rank: int,
                   world: int) -> torch.Tensor:
    """(n_sequences,) float64: the log-likelihood of this rank's sequences, 0 elsewhere."""
    lls = torch.zeros(task.n_sequences, dtype=torch.float64, device=device)
    n_rows = len(task.rows["input_ids"])
    for first in range(0, n_rows, batch * world):  # the global row index of rank 0's first
        wanted = first + rank * batch + np.arange(batch)  # (B,)
        rows = {k: torch.from_numpy(v[np.minimum(wanted, n_rows - 1)]).to(device)
                for k, v in task.rows.items()}  # (B, T) each; past the end, a repeated row
        past = torch.from_numpy(wanted >= n_rows).to(device)  # (B,)
        rows["targets"][past], rows["sequence"][past] = -100, -1  # … with no target
        sequence = rows.pop("sequence")
        ce = model(**rows, reduction="none").ce  # (B·T,) nats, 0 where no target
        kept = sequence.flatten() >= 0
        lls.index_add_(0, sequence.flatten()[kept], -ce[kept].double())
    return lls


def predictions(items: list[Item], lls: list[float]) -> np.ndarray:
    """(items, 3): the choice each item's acc, acc_norm and acc_bytes pick, as lm-eval's
    process_results: argmax of ll, ll / len(choice), ll / len(choice in UTF-8)."""
    out, k = [], 0
    for item in items:
        ll = np.array(lls[k:k + len(item.choices)])
        k += len(item.choices)
        chars = np.array([len(c) for c in item.choices], dtype=float)
        utf8 = np.array([len(c.encode("utf-8")) for c in item.choices], dtype=float)
        out.append([np.argmax(ll), np.argmax(ll / chars), np.argmax(ll / utf8)])
    return np.array(out)
