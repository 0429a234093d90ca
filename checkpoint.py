"""
The run directory and its checkpoints, and the repository's one atomic file writer.

    RUN/config.toml                        the resolved config (train.py)
    RUN/metrics.jsonl                      one JSON object per logged step
    RUN/checkpoints/step_XXXXXXXX.pt       the last train.keep_last step checkpoints, each enough to resume
    RUN/checkpoints/best.pt                the weights with the lowest validation loss

A checkpoint is a dict with "model_config" (ModelConfig as a dict) and "model" (the state dict); train.py
adds optimizer, loader, RNG and train state next to them (checkpoint_dict builds all of them).

Every file the repository writes for keeps (checkpoints, shards, manifests, metrics, eval results) goes
through atomic_file: a temp file next to the target, fsync, rename, fsync of the directory. A crash at
any moment leaves the previous file or the complete new one, never a torn one; the temp file of a killed
writer never matches a checkpoint name and is removed by the next run.
"""

import dataclasses
import glob
import os
import tempfile
from contextlib import contextmanager

import torch

from cli import WriteError

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
BEST = "best.pt"


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
        # The rename itself is only durable once the directory entry is on disk.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
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
    take. (Root ignores permission bits, so only trying tells.)"""
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
        pass
    return directory


def write_bytes(path, chunks):
    """Write an iterable of bytes objects to `path` atomically."""
    with atomic_file(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


def write_text(path, text):
    with atomic_file(path, "w") as f:
        f.write(text)


def save_atomic(obj, path):
    """torch.save(obj) to `path` atomically."""
    with atomic_file(path, "wb") as f:
        torch.save(obj, f)


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


def keep_last(run_dir, k):
    """Delete all but the newest k step checkpoints (best.pt is not one of them)."""
    for old in step_checkpoints(run_dir)[:-k]:
        os.remove(old)
