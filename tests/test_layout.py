"""What the files say about each other is true: the top level holds the lesson and the
commands, and the rest of the code is the plumbing package; every module's docstring ends
with the line `Imports from stacklm: …`, and that list is exactly the stacklm modules the
file imports (read with ast, imports inside functions included; a module of plumbing/ is
named without its package)."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LESSON = {"train", "model", "data", "optim", "config"}
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


# README's Reading order: the plumbing that the lesson files compose imports the lesson's
# config and data, the shared cli and shards, at most, plus what each extra is named for.
PLUMBING = ("checkpoint", "devices", "launch", "resume", "log", "downstream", "cli", "shards",
            "overrides", "chunked_loss", "rms_norm", "hf_import", "report", "prepare")
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
