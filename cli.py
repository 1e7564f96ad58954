"""Command-line plumbing that every command shares (train.py, prepare.py, export.py,
sample.py, report.py and config.py's own): a mistake a user can fix is one line, not a
traceback.

Imports from stacklm: nothing.
"""

import contextlib
import os
import sys


@contextlib.contextmanager
def user_errors(debug: bool, errors: tuple = (ValueError, OSError)):
    """The commands' contract for what a user can fix (a bad value, a missing or unreadable
    file): one line `error: …` on stderr and exit status 2; `debug` keeps the traceback.
    Anything else is a bug and keeps its traceback. Under a launcher only rank 0 prints."""
    try:
        yield
    except errors as e:
        if debug:
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
