"""
One-line errors for every command line (train.py, prepare_fineweb.py, sample.py, eval/): a mistake the
user can fix is one `error: ...` line on stderr and a non-zero exit, never a traceback or a usage block.

    raise UserError("data.data_dir = ... holds no shards; make them with prepare_fineweb.py")

anywhere below a `with user_errors():` (or `run_cli(main)`) becomes

    error: data.data_dir = ... holds no shards; make them with prepare_fineweb.py

An OSError there (a full disk, a read-only or missing folder, a file where a folder should be) is the
machine's answer to what the user asked for, not a bug, so it becomes one line too, naming the path:

    error: cannot write runs/x/checkpoints/step_00000100.pt: the disk is full (no space left on device)

Exit status 1 for a user error, 2 for arguments argparse cannot read (argparse's own convention), 130
after Ctrl-C (the shell's convention for SIGINT).
"""

import argparse
import errno
import os
import sys
import time
from contextlib import contextmanager

SILENT_RANK_WAIT_S = 10.0  # see fail()


class UserError(Exception):
    """A mistake the user can fix: a bad setting, a missing file, a run directory in the way."""


# What each everyday errno means for the person at the keyboard; strerror's wording for the rest.
OS_REASONS = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is full",
    errno.EFBIG: "the file is too large (a file-size limit such as ulimit -f, or the file system's largest file)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "it is a directory, not a file",
    errno.EEXIST: "a file of that name is in the way",
    errno.ENAMETOOLONG: "the name is too long",
}


def usable_cores():
    """The cores this process may run on (its affinity, which a container or taskset narrows), else the
    machine's count: what a command's default number of workers or threads is divided from."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def os_reason(e):
    """Why an OSError happened, in words (no errno number, no path)."""
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and e.filename is not None:
        # makedirs and open say only "File exists" / "Not a directory": name the file that is in the way.
        path = os.path.abspath(os.fsdecode(e.filename))
        while path != os.path.dirname(path):
            if os.path.exists(path) and not os.path.isdir(path):
                return f"{path} is a file, not a directory"
            path = os.path.dirname(path)
    if e.errno in OS_REASONS:
        return OS_REASONS[e.errno]
    return (e.strerror or str(e) or type(e).__name__).splitlines()[0]


def error_line(e, limit=None):
    """A library's error as one line that keeps its reason: the lines of its message joined (transformers'
    config validation says which validator on the first and why on the next, torch's load_state_dict which
    module first and which keys after), a KeyError's message without the quotes its str() adds, the type's
    name for an empty message; cut to `limit` characters, if given, where a message may list without end."""
    message = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    text = " ".join(line.strip() for line in message.splitlines() if line.strip()) or type(e).__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3].rstrip() + "..."


def describe_os_error(e, action=None):
    """One line for an OSError: `<action> <path>: <reason>`; `action` defaults to "cannot use"."""
    path = e.filename if e.filename is not None else None
    if path is None:
        return f"{action or 'input/output error'}: {os_reason(e)}"
    return f"{action or 'cannot use'} {os.fsdecode(path)}: {os_reason(e)}"


class WriteError(OSError):
    """A file that could not be written (outputs.atomic_file raises it): the errno of the failure, the path
    of the file meant (not of its temp file), and str() is the whole one-line message."""

    def __init__(self, cause, path, note=""):
        super().__init__(cause.errno, cause.strerror or str(cause), os.fspath(path))
        self.note = note

    def __str__(self):
        return f"cannot write {self.filename}: {os_reason(self)}" + (f"; {self.note}" if self.note else "")


def fail(message, speak=True, code=1):
    """Exit with one `error: ...` line. Under torchrun every rank exits but only rank 0 speaks
    (speak=False on the others), so the line is not printed once per rank."""
    if speak:
        print(f"error: {message}", file=sys.stderr)
    else:
        # A silent rank that exits first makes torchrun stop the others, rank 0 included, perhaps before it
        # has printed the line (seen on a loaded machine); waiting lets rank 0 speak first. torchrun ends
        # this wait with SIGTERM once rank 0 has exited.
        time.sleep(SILENT_RANK_WAIT_S)
    raise SystemExit(code)


@contextmanager
def user_errors(speak=True, interrupted=None):
    """Turn a UserError or OSError raised inside the block into fail(...). With `interrupted` (the line to
    print, e.g. "passkey: interrupted; the lengths finished so far are saved"), Ctrl-C prints it and exits
    with 130 instead of a traceback."""
    try:
        yield
    except UserError as e:
        fail(e, speak)
    except BrokenPipeError:
        # `python sample.py ... | head`: the reader left; nothing to say. Point stdout at /dev/null so that
        # Python's own flush at exit does not raise the same error again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file descriptor (captured, closed)
            pass
        raise SystemExit(1)
    except OSError as e:
        fail(str(e) if isinstance(e, WriteError) else describe_os_error(e), speak)
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        if speak:
            print(f"\n{interrupted}", file=sys.stderr)
        raise SystemExit(130)


def run_cli(main, argv=None, interrupted=None):
    """`main(argv)` as a program: its return value is the exit status, a UserError or OSError one line, and
    Ctrl-C the line `interrupted` (see user_errors) with status 130."""
    with user_errors(interrupted=interrupted):
        code = main(argv)
    raise SystemExit(code or 0)


class Parser(argparse.ArgumentParser):
    """argparse, but an argument it cannot read is one `error: ...` line (the usage is in --help)."""

    def error(self, message):
        fail(f"{self.prog}: {message} (see --help)", code=2)
