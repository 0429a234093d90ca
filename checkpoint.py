"""
The run directory and its checkpoints, and the repository's one atomic file writer.

    RUN/config.toml                        the resolved config (train.py)
    RUN/metrics.jsonl                      one JSON object per logged step
    RUN/checkpoints/step_XXXXXXXX.pt       the last train.keep_last step checkpoints, each enough to resume
    RUN/checkpoints/best.pt                the weights with the lowest validation loss
    RUN/checkpoints/step_XXXXXXXX.pt.rejected  a checkpoint set aside after a loss spike (train.py)
    RUN/.lock                              held by the train.py that writes RUN (pid and host inside)

A checkpoint is a dict with "model_config" (ModelConfig as a dict) and "model" (the state dict); train.py
adds optimizer, loader, RNG and train state next to them (checkpoint_dict builds all of them).

Every file the repository writes for keeps (checkpoints, shards, manifests, metrics, eval results) goes
through atomic_file: a temp file next to the target, fsync, rename, fsync of the directory. A crash at
any moment leaves the previous file or the complete new one, never a torn one; the temp file of a killed
writer never matches a checkpoint name and is removed by the next run.
"""

import dataclasses
import fcntl
import glob
import os
import shutil
import socket
import tempfile
import zipfile
from contextlib import contextmanager

import torch

from cli import WriteError
from config import upgrade

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
BEST = "best.pt"
LOCK = ".lock"
REJECTED = ".rejected"


def config_path(run_dir):
    return os.path.join(run_dir, CONFIG)


def metrics_path(run_dir):
    return os.path.join(run_dir, METRICS)


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, CHECKPOINTS)


def step_path(run_dir, step):
    # Zero-padded so that names sort by step.
    return os.path.join(run_dir, CHECKPOINTS, f"step_{step:08d}.pt")


def best_path(run_dir):
    return os.path.join(run_dir, CHECKPOINTS, BEST)


# ---------------------------------------------------------------------------------------------------
# Atomic writes


@contextmanager
def atomic_file(path, mode="wb"):
    """A file object to write `path`'s new content into; it replaces `path` only once the block ends
    without an exception (an exception leaves the old file and no temp file). An OSError of the write
    itself (a full disk, a read-only folder, a file where the folder should be) comes out as cli.WriteError:
    one line that names `path`, not the temp file, and says that the previous `path` is unchanged."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # The pid keeps two processes that write the same file (e.g. every torchrun rank fetching the
    # tokenizer) from writing into one temp file.
    tmp = f"{path}.tmp-{os.getpid()}"
    renamed = False
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            renamed = True
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync_dir(directory)  # the rename itself is only durable once the directory entry is on disk
    except WriteError:
        raise  # a nested atomic write already said which file
    except OSError as e:
        if not _is_about(e, path, tmp, directory):
            raise  # the block failed reading some other file: that file is what the error is about
        if renamed:  # only the folder's fsync failed: the new file is in place, perhaps not yet durable
            raise WriteError(e, path, "the new file is in place but may not survive a power loss") from e
        kept = "its previous version is unchanged" if os.path.isfile(path) else "nothing was written"
        raise WriteError(e, path, kept) from e


def _is_about(error, path, tmp, directory):
    """Whether an OSError is about writing `path`: it names no file, or the file, its temp file, or a folder on
    the way to it (which makedirs could not create)."""
    if error.filename is None:
        return True
    name = os.path.abspath(os.fsdecode(error.filename))
    return name in (os.path.abspath(path), os.path.abspath(tmp)) or (directory + os.sep).startswith(name + os.sep)


def check_writable(directory):
    """Create `directory` if needed and write and delete a probe file in it: the OSError a later write would
    meet (read-only, a file in the way, no permission) comes now, before any work whose results it would
    take. (Root ignores permission bits, so only trying tells.) Folders it had to create are removed again,
    so a command refused later leaves nothing behind; the real write creates them."""
    missing = os.path.abspath(directory)
    while not os.path.exists(os.path.dirname(missing)) and os.path.dirname(missing) != missing:
        missing = os.path.dirname(missing)  # the outermost folder that makedirs will create
    created = not os.path.exists(missing)
    os.makedirs(directory, exist_ok=True)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    finally:
        if created:
            shutil.rmtree(missing, ignore_errors=True)
    return directory


def _fsync_dir(directory):
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def replace_dir(finished, path):
    """Put the complete folder `finished` (written beside `path`, same filesystem) at `path`: an old `path`
    is moved aside first and removed after, so a whole folder is there at every moment; the parent
    directory is fsynced like a file's."""
    parent = os.path.dirname(os.path.abspath(path))
    aside = None
    if os.path.exists(path):
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
        os.replace(path, os.path.join(aside, "old"))
    os.replace(finished, path)
    _fsync_dir(parent)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def write_bytes(path, chunks):
    """Write an iterable of bytes objects to `path` atomically."""
    with atomic_file(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


def write_text(path, text):
    with atomic_file(path, "w") as f:
        f.write(text)


def save_atomic(obj, path):
    """torch.save(obj) to `path` atomically. A failed write (a full disk) raises its OSError, which
    torch's zip writer would otherwise hide behind an "unexpected pos" RuntimeError."""
    with atomic_file(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


def remove_temp_files(directory):
    """Temp files of writes that were killed before their rename; nothing else ever reads them."""
    for stale in glob.glob(os.path.join(glob.escape(directory), "*.tmp-*")):
        os.remove(stale)


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_dict(model, **state):
    """The one checkpoint layout: the model's config and weights, plus whatever `state` the writer keeps
    (train.py: optimizer, step, loader, RNG, ...; best.pt: step and val_loss)."""
    return {"model_config": dataclasses.asdict(model.config), "model": model.state_dict(), **state}


def step_checkpoints(run_dir):
    """A run's step checkpoints, oldest first (temp files never match)."""
    return sorted(glob.glob(os.path.join(glob.escape(checkpoint_dir(run_dir)), "step_*.pt")))


def find_checkpoint(path):
    """A checkpoint file as given, or a run directory's newest step checkpoint (its best.pt when it has no
    step checkpoint). FileNotFoundError names what was looked for."""
    path = os.fspath(path)
    if os.path.isdir(path):
        steps = step_checkpoints(path)
        if steps:
            return steps[-1]
        if os.path.isfile(best_path(path)):
            return best_path(path)
        raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(path)} (expected step_*.pt files)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file or run directory at {path}")
    return path


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, not a checkpoint, torn, foreign); the message names the file,
    `reason` says what is wrong with it in a few words."""

    def __init__(self, message, reason=None):
        super().__init__(message)
        self.reason = reason or message


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at that path (also a FileNotFoundError, as find_checkpoint's)."""


def load_checkpoint(path, mmap=True):
    """(file, checkpoint dict) of a checkpoint file or of a run directory's newest checkpoint (find_checkpoint):
    the one place the repository reads the format. With mmap the tensors stay on disk until read, so loading
    the weights of a training checkpoint never pages its optimizer state in; a resume that keeps the tensors
    (the optimizer state) loads without it. Anything unusable is a CheckpointError of one line."""
    try:
        file = find_checkpoint(path)
    except FileNotFoundError as e:
        raise CheckpointNotFound(str(e)) from None
    if not zipfile.is_zipfile(file):  # torch.save's format; anything else would fail with a puzzling message
        raise CheckpointError(f"{file} is not a checkpoint (torch.save writes a zip archive; this file is not one)",
                              "not a whole zip archive, as torch.save writes: cut short, or not a checkpoint")
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a torn zip, a truncated pickle, a file of something else: all unusable
        reason = (str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]
        raise CheckpointError(f"cannot load the checkpoint {file}: {reason}", reason) from None
    if not isinstance(ckpt, dict) or not {"model_config", "model"} <= set(ckpt):
        raise CheckpointError(f"{file} is not a checkpoint of this repository (it has no model_config and model)",
                              "not a checkpoint of this repository")
    if "config" in ckpt:  # train.py's run config, with the keys older versions kept elsewhere moved
        ckpt["config"] = upgrade(ckpt["config"])
    return file, ckpt


def keep_last(run_dir, k):
    """Delete all but the newest k step checkpoints (best.pt is not one of them)."""
    for old in step_checkpoints(run_dir)[:-k]:
        os.remove(old)


def checkpoint_step(path):
    return int(os.path.basename(path).removeprefix("step_").removesuffix(".pt"))


def reject_after(run_dir, step):
    """Set aside (as *.pt.rejected, which nothing loads) every step checkpoint newer than `step`, so that
    `--resume` continues from the one before them. Returns the paths set aside."""
    rejected = [p for p in step_checkpoints(run_dir) if checkpoint_step(p) > step]
    for path in rejected:
        os.replace(path, path + REJECTED)
    return rejected


def load_newest(paths, warn=print):
    """(path, checkpoint) of the newest of `paths` (oldest first) that loads; each one that does not is
    named through `warn` with the reason. (None, None) when none does."""
    for path in reversed(paths):
        try:
            return load_checkpoint(path, mmap=False)
        except CheckpointError as e:
            warn(f"warning: cannot load {path} ({e.reason}); trying the one before it")
    return None, None


class RunDirInUse(RuntimeError):
    pass


@contextmanager
def run_dir_lock(run_dir):
    """Hold RUN/.lock for the block: a second writer of the same run directory gets RunDirInUse naming the
    holder. flock is released by the kernel when the holder exits in any way (also SIGKILL), so a crashed
    run never leaves it stuck; it also holds across machines on NFS (Linux emulates it with POSIX locks).
    The directory is created first; OSError (not creatable, read-only) reaches the caller."""
    created = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    f = open(os.path.join(run_dir, LOCK), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "pid unknown"
        f.close()
        raise RunDirInUse(f"{run_dir} is in use by another train.py ({holder})") from None
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()}, host {socket.gethostname()}\n")
        f.flush()
        yield
    except BaseException:
        # A run refused before it wrote anything (a bad init_from, changed settings) leaves no directory
        # behind if it made it: nothing but the lock is in it yet.
        if created and os.listdir(run_dir) == [LOCK]:
            os.remove(os.path.join(run_dir, LOCK))
            os.rmdir(run_dir)
        raise
    finally:
        f.close()  # releases the lock; the file stays (removing it would race with a process about to lock it)
