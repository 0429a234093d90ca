"""
One-line errors for every command line (train.py, prepare_fineweb.py, sample.py, eval/): a mistake the
user can fix is one `error: ...` line on stderr and a non-zero exit, never a traceback or a usage block.

    raise UserError("data.data_dir = ... holds no shards; make them with prepare_fineweb.py")

anywhere below a `with user_errors():` (or `run_cli(main)`) becomes

    error: data.data_dir = ... holds no shards; make them with prepare_fineweb.py

Exit status 1 for a user error, 2 for arguments argparse cannot read (argparse's own convention).
"""

import argparse
import sys
from contextlib import contextmanager


class UserError(Exception):
    """A mistake the user can fix: a bad setting, a missing file, a run directory in the way."""


def fail(message, speak=True, code=1):
    """Exit with one `error: ...` line. Under torchrun every rank exits but only rank 0 speaks
    (speak=False on the others), so the line is not printed once per rank."""
    if speak:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


@contextmanager
def user_errors(speak=True):
    """Turn a UserError raised inside the block into fail(...)."""
    try:
        yield
    except UserError as e:
        fail(e, speak)


def run_cli(main, argv=None):
    """`main(argv)` as a program: its return value is the exit status, a UserError one line."""
    with user_errors():
        code = main(argv)
    raise SystemExit(code or 0)


class Parser(argparse.ArgumentParser):
    """argparse, but an argument it cannot read is one `error: ...` line (the usage is in --help)."""

    def error(self, message):
        fail(f"{self.prog}: {message} (see --help)", code=2)
