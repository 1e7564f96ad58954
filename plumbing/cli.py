"""Command-line plumbing that every command shares (train.py, prepare.py, export.py,
sample.py, report.py, config.py's own and the benchmarks): a mistake a user can fix is one
line, not a traceback or argparse's usage; so is a command with nothing to do, and a Ctrl-C
that interrupts it.

Imports from stacklm: nothing.
"""

import argparse
import contextlib
import math
import os
import sys


class NothingToDo(Exception):
    """What the command was asked to make already exists (a run that reached its stop): it
    says so in one line and exits 0, so a scheduler that reruns it sees success."""


@contextlib.contextmanager
def user_errors(debug: bool, errors: tuple = (ValueError, OSError),
                interrupted: str = "interrupted"):
    """The commands' contract for what a user can fix (a bad value, a missing or unreadable
    file): one line `error: …` on stderr and exit status 2; `debug` keeps the traceback.
    Anything else is a bug and keeps its traceback. NothingToDo is one line on stdout and
    exit status 0; a Ctrl-C that reaches the command (KeyboardInterrupt) is the line
    `interrupted` and exit status 130, the shell's code for SIGINT. Under a launcher only
    rank 0 prints."""
    rank0 = is_rank0()
    utf8_output()
    try:
        yield
    except NothingToDo as e:
        if rank0:
            print(e)
    except errors as e:
        if debug:
            raise
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if debug:
            raise
        if rank0:
            print(interrupted, file=sys.stderr)
        sys.exit(130)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose own refusals (an unknown flag, a bad choice, a missing
    argument, a value given to a flag that takes none) keep the commands' contract: one
    line `error: …` and exit status 2, without the usage argparse prints first. --help is
    argparse's own. (Overriding `error` is how argparse's documentation customises it.)"""

    def error(self, message: str):
        if "ignored explicit argument" in message:  # --force=true
            message += " (the flag takes no value: write it alone)"
        if is_rank0():
            print(f"error: {message}; `{self.prog} --help` lists the flags", file=sys.stderr)
        sys.exit(2)


def utf8_output(platform: str = sys.platform):
    """The commands print UTF-8 (×, →, –) on every OS: Windows writes a pipe or a file in its
    ANSI code page, which has no → and would end a run in a UnicodeEncodeError."""
    if platform == "win32":
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):  # a real text stream, not a test's capture
                stream.reconfigure(encoding="utf-8")


def at_least(minimum: int):
    """An argparse `type`: a whole number of at least `minimum`, else the commands' one line
    (a benchmark's --steps 0 would end in an empty median's traceback)."""
    def whole_number(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got "
                                             f"{text!r}")
        return value
    return whole_number


def positive_number(text: str) -> float:
    """An argparse `type`: a finite number above 0, else the commands' one line (a benchmark's
    --tokens_per_s 0 would end its whole measurement in a division by zero)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < math.inf:  # nan compares false: refused too
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def is_rank0() -> bool:
    """The first process of a launch (or the only one): the one that speaks for all, before
    any Accelerator exists to ask."""
    return os.environ.get("RANK", "0") == "0"
