"""What the files say about each other is true: the top level holds the lesson and the
commands, and the rest of the code is the plumbing package; every module's docstring ends
with the line `Imports from stacklm: …`, and that list is exactly the stacklm modules the
file imports (read with ast, imports inside functions included; a module of plumbing/ is
named without its package). The imports run one way, with no circle: the lesson's parts
stand below the plumbing, save the exceptions named here with their reasons. The lesson's
prose holds no issue numbers and no measured figures (those live on docs/figures.md), and
is at most 40% of each lesson file's lines."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LESSON = {"train", "model", "loss", "data", "optim", "config"}
COMMANDS = {"prepare", "export", "sample", "report"}
FILES = {p.stem: p for p in [*REPO.glob("*.py"), *(REPO / "plumbing").glob("*.py"),
                             *(REPO / "integrations").rglob("*.py")]
         if p.stem not in ("__init__", "hf_modeling_stacklm")}  # the latter: an export's file
MODULES = sorted(FILES)


def test_the_top_level_is_the_lesson_and_the_commands():
    assert {p.stem for p in REPO.glob("*.py")} == LESSON | COMMANDS


def declared_imports(docstring: str) -> set[str]:
    """The modules named by "Imports from stacklm: a, b (why) and c." ("nothing": none)."""
    match = re.search(r"Imports from stacklm: (.*?)\.(?:\s|$)",
                      re.sub(r"\s*\([^)]*\)", "", docstring.replace("\n", " ")))
    assert match, "no 'Imports from stacklm: ….' line"
    names = re.split(r",\s*|\s+and\s+", match.group(1).split(":")[0])
    return set() if names == ["nothing"] else set(names)


def actual_imports(tree: ast.Module) -> set[str]:
    """The stacklm modules a file imports: `import x`, `from x import y`, and plumbing's
    `from plumbing import x`, `from plumbing.x import y`, `import plumbing.x`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("plumbing.").split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "plumbing":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.removeprefix("plumbing.").split(".")[0])
    return found & set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_file_imports_what_its_docstring_says(module):
    tree = ast.parse(FILES[module].read_text())
    assert declared_imports(ast.get_docstring(tree)) == actual_imports(tree)


# docs/contributing.md: the plumbing that the lesson files compose imports the lesson's
# config and data, the shared cli and shards, at most, plus what each extra is named for.
PLUMBING = ("checkpoint", "devices", "launch", "resume", "log", "downstream", "cli", "shards",
            "overrides", "hf_import", "report", "prepare")
PLUMBING_IMPORTS = {"config", "cli", "data", "shards"}
PLUMBING_EXTRAS = {"log": {"model"}, "downstream": {"prepare"}, "prepare": {"checkpoint"},
                   "resume": {"checkpoint", "hf_import"}, "hf_import": {"model"},
                   "overrides": {"hf_import"}, "launch": {"devices"}}


@pytest.mark.parametrize("module", PLUMBING)
def test_the_plumbing_imports_no_more_than_readme_says(module):
    tree = ast.parse(FILES[module].read_text())
    assert actual_imports(tree) <= PLUMBING_IMPORTS | PLUMBING_EXTRAS.get(module, set())


def test_the_docstring_parser_reads_the_forms_in_use():
    """The forms the files use, and a wrong line, through the parser above."""
    assert declared_imports("x\n\nImports from stacklm: nothing. It takes a model.") == set()
    assert declared_imports("Imports from stacklm: config (the shape) and data (the EOS\n"
                            "token).") == {"config", "data"}
    assert declared_imports("Imports from stacklm: a, b, c\nand d: it composes them.") == \
        {"a", "b", "c", "d"}


# ---------------------------------------------------------------------------------------
# The imports run one way
# ---------------------------------------------------------------------------------------

def import_graph() -> dict[str, set[str]]:
    return {module: actual_imports(ast.parse(FILES[module].read_text())) for module in MODULES}


def a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports that comes back to where it began, or None (depth-first search)."""
    state = {}  # module -> "open" while its imports are being walked, "done" after

    def walk(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (circle := walk(imported, path + [imported])):
                return circle
        state[module] = "done"
        return None
    return next(filter(None, (walk(m, [m]) for m in sorted(graph) if m not in state)), None)


def test_the_imports_have_no_circle():
    assert a_circle(import_graph()) is None


def test_the_circle_finder_finds_one():
    assert a_circle({"config": {"overrides"}, "overrides": {"hf_import"},
                     "hf_import": {"model"}, "model": {"config"}}) == \
        ["config", "overrides", "hf_import", "model", "config"]
    assert a_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


PLUMBING_FILES = {p.stem for p in (REPO / "plumbing").glob("*.py")} - {"__init__"}
# What a lesson part may import from plumbing/, each for its reason; docs/contributing.md
# names them. train.py composes the plumbing from above, so it is not one of these parts.
LESSON_PARTS = ("config", "model", "loss", "data", "optim")
LESSON_FROM_PLUMBING = {
    "data": {"shards": "the manifest check: a shard is the file its manifest describes"},
}


@pytest.mark.parametrize("module", LESSON_PARTS)
def test_the_lesson_imports_from_the_plumbing_only_what_is_named(module):
    allowed = set(LESSON_FROM_PLUMBING.get(module, {}))
    assert actual_imports(ast.parse(FILES[module].read_text())) & PLUMBING_FILES <= allowed


def test_config_py_answers_without_torch():
    """`python config.py --world_size=N`, asked before any node of a launch starts, imports
    neither torch nor config.py a second time (as `config`, beside `__main__`)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "config.py", "--world_size=8"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "32\n", out.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "json" in imported  # the list is read
    assert {"torch", "config"}.isdisjoint(imported)


# ---------------------------------------------------------------------------------------
# The lesson's prose: no issue numbers, no measured figures
# ---------------------------------------------------------------------------------------

ISSUE_NUMBER = re.compile(r"(?i)\b(?:issues?|PR|pull request)\s*#?\d+|(?<![\w/&#])#\d{2,}\b")
# A speed-up (1.29×, 1.04x), a share (48%), a rate (5,744 tokens/s), a time (8.4 s, 12 ms).
MEASURED = re.compile(r"\d+\.\d+\s?×|\d+\.\d+x(?!\w)|\d+(?:\.\d+)?\s?%|\d[\d,.]*\s?(?:tokens/s|"
                      r"tok/s|ms|µs|s/step|it/s|TFLOP/s|GB/s|GiB/s)\b|\d+\.\d+\s?s\b")


def prose(source: str) -> list[str]:
    """A file's comments and docstrings (module, classes, functions)."""
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    nodes = (n for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return comments + [d for n in nodes if (d := ast.get_docstring(n))]


def figures_and_issues(source: str) -> set[str]:
    return {m.group(0) for text in prose(source)
            for pattern in (ISSUE_NUMBER, MEASURED) for m in pattern.finditer(text)}


@pytest.mark.parametrize("module", sorted(LESSON))
def test_the_lesson_prose_holds_no_issue_numbers_or_figures(module):
    """Figures move to docs/figures.md, where the prose links; histories leave the code."""
    assert figures_and_issues(FILES[module].read_text()) == set()


def test_the_prose_rule_reads_what_it_must():
    flagged = '"""It made the step 1.29× faster (torchtitan #3397), issue 54."""\n' \
              "x = 1  # 48% of the step, 5,744 tokens/s, 8.4 s, 1.04x\n"
    assert figures_and_issues(flagged) == {"1.29×", "#3397", "issue 54", "48%", "5,744 tokens/s",
                                           "8.4 s", "1.04x"}
    clean = '"""(B, T, H, D); ~2.75 x d_model; arXiv 2404.06395; 16 × 256 × 4,096; 0.2·lr."""\n' \
            "y = a % 2  # layer (i + 1) % 4, PaLM's z-loss, 1e-4\n"
    assert figures_and_issues(clean) == set()


def prose_share(source: str) -> float:
    """Prose lines / non-blank lines, where a prose line holds a comment, or is a line of a
    module's, class's or function's docstring (its blank lines too)."""
    lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node) is not None:
            lines |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return len(lines) / sum(1 for line in source.splitlines() if line.strip())


@pytest.mark.parametrize("module", sorted(LESSON))
def test_the_lesson_is_at_most_40_percent_prose(module):
    """A tutorial's share, beside nanoGPT's and nanochat's: the why a learner needs, not a
    lab notebook's history or the code said again in words."""
    assert prose_share(FILES[module].read_text()) <= 0.40


def test_the_prose_share_counts_what_it_must():
    source = '"""Doc.\n\nMore."""\n\n\nx = 1  # why\n# a comment\ny = "# not one"\n\n' \
             'def f():\n    """One."""\n    return 2\n'
    assert prose_share(source) == 6 / 8  # docstrings 3 + 1 (a blank), comments 2; 8 non-blank
    model = FILES["model"].read_text()
    assert prose_share(model + "# a lab notebook's line\n" * 50) > 0.40


def test_the_reading_order_names_every_file_on_one_screen():
    """README's Reading order names each file of the lesson, the commands and plumbing/, in
    at most 40 lines; the import rules live on docs/contributing.md, which it links."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Reading order\n"):]
    section = section[:section.index("\n## ")]
    assert len(section.splitlines()) <= 40
    named = set(re.findall(r"`(\w+)(?:\.py)?`", section))
    assert {p.stem for p in REPO.glob("*.py")} | PLUMBING_FILES <= named
    assert "(docs/contributing.md)" in section
