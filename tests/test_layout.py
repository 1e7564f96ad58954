"""What the files say about each other is true: every top-level module's docstring ends
with the line `Imports from stacklm: …`, and that list is exactly the stacklm modules the
file imports (read with ast, imports inside functions included)."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in REPO.glob("*.py"))


def declared_imports(docstring: str) -> set[str]:
    """The modules named by "Imports from stacklm: a, b (why) and c." ("nothing": none)."""
    match = re.search(r"Imports from stacklm: (.*?)\.(?:\s|$)",
                      re.sub(r"\s*\([^)]*\)", "", docstring.replace("\n", " ")))
    assert match, "no 'Imports from stacklm: ….' line"
    names = re.split(r",\s*|\s+and\s+", match.group(1).split(":")[0])
    return set() if names == ["nothing"] else set(names)


def actual_imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_each_file_imports_what_its_docstring_says(module):
    tree = ast.parse((REPO / f"{module}.py").read_text())
    assert declared_imports(ast.get_docstring(tree)) == actual_imports(tree)


# README's Reading order: the plumbing imports config, cli and data at most, plus one named
# module each for log, downstream, prepare and resume.
PLUMBING = ("checkpoint", "launch", "resume", "log", "report", "prepare", "downstream", "cli")
PLUMBING_IMPORTS = {"config", "cli", "data"}
PLUMBING_EXTRAS = {"log": {"model"}, "downstream": {"prepare"}, "prepare": {"checkpoint"},
                   "resume": {"checkpoint"}}


@pytest.mark.parametrize("module", PLUMBING)
def test_the_plumbing_imports_no_more_than_readme_says(module):
    tree = ast.parse((REPO / f"{module}.py").read_text())
    assert actual_imports(tree) <= PLUMBING_IMPORTS | PLUMBING_EXTRAS.get(module, set())


def test_the_docstring_parser_reads_the_forms_in_use():
    """The forms the files use, and a wrong line, through the parser above."""
    assert declared_imports("x\n\nImports from stacklm: nothing. It takes a model.") == set()
    assert declared_imports("Imports from stacklm: config (the shape) and data (the EOS\n"
                            "token).") == {"config", "data"}
    assert declared_imports("Imports from stacklm: a, b, c\nand d: it composes them.") == \
        {"a", "b", "c", "d"}
