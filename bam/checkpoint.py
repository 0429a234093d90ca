"""
The run directory and its checkpoints: their layout, discovery, reading and writing, and the model's side
of them (model_from_checkpoint, load_model, save_model).

    RUN/config.toml                        the resolved config (train.py)
    RUN/metrics.jsonl                      one JSON object per logged step
    RUN/checkpoints/step_XXXXXXXX.pt       the last train.keep_last step checkpoints, each enough to resume
    RUN/checkpoints/best.pt                the weights with the lowest validation loss
    RUN/checkpoints/step_XXXXXXXX.pt.rejected  a checkpoint set aside after a loss spike (train.py)
    RUN/.lock                              held by the train.py that writes RUN (pid and host inside)

A checkpoint is a dict with "model_config" (ModelConfig as a dict) and "model" (the state dict); train.py
adds optimizer, loader, RNG and train state next to them (checkpoint_dict builds all of them).

A sharded run (train.parallel = "fsdp") writes the same names without ".pt" as folders (step_XXXXXXXX/,
best/), each a torch.distributed.checkpoint (DCP) checkpoint that every rank writes its shards into:

    .metadata, __R_0.distcp   DCP: the model's and the optimizer's tensors, as the ranks held them
    state.json                everything else (model_config, config, step, loader, every rank's RNG, ...)
    DONE                      written last: the name and size of every other file

A folder is written as NAME.tmp-PID and renamed once DONE is in it, so a reader sees a whole checkpoint or
none, and one whose files do not match DONE (a copy cut short) is refused as damaged. load_checkpoint reads
both kinds into the same dict (a folder's shards joined into whole tensors, in one process): every reader of
checkpoints (the evaluators, sample.py, export_hf.py, train.init_from) takes an FSDP run as it takes a DDP
run. `python -m bam.checkpoint SOURCE OUT.pt` writes any checkpoint as one .pt file.

A run refuses a checkpoint of another tokenizer (check_checkpoint_tokenizer, on resume and init_from), and
train.init_from's weights where they do not fit the run's model (load_init_weights).

Checkpoints are written atomically (outputs.atomic_file, outputs.swap_in): a reader sees a whole one or none;
the temp file of a killed writer never matches a checkpoint name and is removed by the next run. A run read while
it trains may prune (keep_last) or replace (best) the checkpoint a reader chose: load_checkpoint then reads the
run's newest complete one again, and says so.
"""

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import stat
import sys
import warnings
import zipfile
from collections import Counter
from contextlib import contextmanager

import torch

from bam import outputs
from bam.cli import Parser, UserError, WriteError, run_cli
from bam.config import (INITIALISATION_MODEL_KEYS, PARAMETER_ADDING_MODEL_KEYS, SHAPE_FREE_MODEL_KEYS,
                        checkpoint_differences, upgrade)
from bam.tokenizer import GPT2, GPT2_IDENTITY, TokenizerIdentity, tokenizer_identity
from model import ModelConfig, Transformer

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
BEST = "best"
LOCK = ".lock"
REJECTED = ".rejected"
DAMAGED = ".damaged"  # a step checkpoint that did not load, set aside by the resume that skipped it
SHARDED_STATE = "state.json"  # in a sharded checkpoint folder: everything that is not a tensor
DONE = "DONE"  # in a sharded checkpoint folder, written last
UNFINISHED_NAME = re.compile(r"(step_\d{8}|best)(\.pt)?\.tmp-\d+")  # a write killed before its rename
STEP_NAME = re.compile(r"step_(\d{8})(\.pt)?")  # a step checkpoint, file or folder (never a temp or rejected one)


def config_path(run_dir):
    return os.path.join(run_dir, CONFIG)


def metrics_path(run_dir):
    return os.path.join(run_dir, METRICS)


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, CHECKPOINTS)


def step_path(run_dir, step, sharded=False):
    # Zero-padded so that names sort by step.
    return os.path.join(run_dir, CHECKPOINTS, f"step_{step:08d}" + ("" if sharded else ".pt"))


def best_path(run_dir, sharded=False):
    return os.path.join(run_dir, CHECKPOINTS, BEST + ("" if sharded else ".pt"))


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def save_atomic(obj, path):
    """torch.save(obj) to `path` atomically. A failed write (a full disk) raises its OSError, which
    torch's zip writer would otherwise hide behind an "unexpected pos" RuntimeError."""
    with outputs.atomic_file(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            failure = outputs.write_failure(e, path)
            if failure is None:
                raise
            raise failure from None


def checkpoint_dict(model, **state):
    """The one checkpoint layout: the model's config and weights, plus whatever `state` the writer keeps
    (train.py: optimizer, step, loader, RNG, ...; best.pt: step and val_loss)."""
    return {"model_config": dataclasses.asdict(model.config), "model": model.state_dict(), **state}


def model_from_checkpoint(ckpt, device="cpu", **overrides):
    """Build the model described by a loaded checkpoint dict; `overrides` change config fields that do
    not touch the weights (e.g. attn_impl). Model settings a newer model.py added are dropped
    (ModelConfig.from_dict, lenient)."""
    model = Transformer(ModelConfig.from_dict(ckpt["model_config"], **overrides))
    model.load_state_dict(ckpt["model"])
    return model.to(device)


def load_model(path, device="cpu", **overrides):
    """The model of a checkpoint file, or of a run directory's newest checkpoint."""
    return model_from_checkpoint(load_checkpoint(path)[1], device, **overrides)


def save_model(model, path):
    """A minimal checkpoint (config + weights), e.g. for tests and exported models."""
    save_atomic(checkpoint_dict(model), path)


def checkpoint_tokenizer(ckpt):
    """(name, TokenizerIdentity or None) of the tokenizer a checkpoint's run was trained with: the one reader of
    it. The name is data.tokenizer of the run's config (GPT-2 for a checkpoint without one: a bare model, or one
    from before the setting); the identity is the one train.py recorded, GPT-2's for an older GPT-2 run, else
    None (not recorded)."""
    name = ((ckpt.get("config") or {}).get("data") or {}).get("tokenizer") or GPT2
    recorded = ckpt.get("tokenizer")
    if recorded:
        return name, TokenizerIdentity.from_dict(recorded)
    return name, GPT2_IDENTITY if name == GPT2 else None


def step_checkpoints(run_dir):
    """A run's step checkpoints, files and sharded folders, oldest first (temp, rejected and damaged ones never
    match). A step that exists twice (a sharded folder and a .pt file, after a run switched train.parallel)
    is ordered with its complete copy last, so that every reader of the newest takes that one."""
    paths = [p for p in glob.glob(os.path.join(glob.escape(checkpoint_dir(run_dir)), "step_*"))
             if STEP_NAME.fullmatch(os.path.basename(p))]
    twice = {step for step, n in Counter(map(checkpoint_step, paths)).items() if n > 1}  # only these are opened
    return sorted(paths, key=lambda p: (checkpoint_step(p), checkpoint_step(p) in twice and looks_complete(p), p))


def looks_complete(path):
    """Whether a step checkpoint is whole by the cheap signs: a .pt file is a zip archive to its end; a sharded
    folder has its DONE and files of the sizes DONE lists (check_sharded, without reading a tensor)."""
    if not os.path.isdir(path):
        return zipfile.is_zipfile(path)
    try:
        check_sharded(path)
    except CheckpointError:
        return False
    return True


def is_sharded(path):
    """Whether `path` is a sharded (DCP) checkpoint folder, complete or not, rather than a run directory."""
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, DONE))
                                    or os.path.exists(os.path.join(path, ".metadata")))


def find_checkpoint(path):
    """A checkpoint (file or sharded folder) as given, or a run directory's newest step checkpoint (its best
    checkpoint when it has no step checkpoint). FileNotFoundError names what was looked for."""
    path = os.fspath(path)
    if UNFINISHED_NAME.fullmatch(os.path.basename(os.path.normpath(path))):
        raise FileNotFoundError(f"{path} is an unfinished save (the temp {'folder' if os.path.isdir(path) else 'file'} "
                                f"of a checkpoint write that was killed, never read); give the run directory or a "
                                f"finished checkpoint beside it")
    if os.path.isdir(path) and not is_sharded(path):
        steps = step_checkpoints(path)
        if steps:
            return steps[-1]
        for best in (best_path(path), best_path(path, sharded=True)):
            if os.path.exists(best):
                return best
        raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(path)} (expected step_*.pt files or "
                                "step_* folders)")
    if is_sharded(path):
        return path
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


READ_TRIES = 3  # reads of a run's newest checkpoint, each chosen again after a prune or a save took the one before


def load_checkpoint(path, mmap=True, optimizer=False, join_shards=True, warn=None):
    """(file, checkpoint dict) of a checkpoint or of a run directory's newest checkpoint (find_checkpoint):
    the one place the repository reads the format. With mmap the tensors of a .pt file stay on disk until
    read, so loading the weights of a training checkpoint never pages its optimizer state in; a resume that
    keeps the tensors (the optimizer state) loads without it. A sharded folder is joined into whole tensors
    in this process; its optimizer state (twice the weights) is read only with optimizer=True, and with
    join_shards=False no tensor is read (train.py loads them into its sharded model). Anything unusable is a
    CheckpointError of one line.

    A run that trains while it is read removes its older step checkpoints (keep_last) and replaces best/: the
    one chosen may go, or change, during the read. For a run directory the newest complete checkpoint is then
    chosen and read again, up to READ_TRIES times, each time said in one line through `warn` (stderr by
    default); a checkpoint named itself that is removed mid-read is a CheckpointNotFound saying so, and one
    replaced whole (best/) is read again."""
    path = os.fspath(path)
    warn = warn or (lambda line: print(line, file=sys.stderr))
    run = os.path.isdir(path) and not is_sharded(path)
    for _ in range(READ_TRIES):
        try:
            file = find_checkpoint(path)
        except FileNotFoundError as e:
            raise CheckpointNotFound(str(e)) from None
        before = _identity(file)
        try:
            ckpt, failure = _read(file, mmap, optimizer, join_shards), None
        except CheckpointError as e:
            ckpt, failure = None, e
        after = _identity(file)
        if before is not None and after == before:
            if failure is not None:
                raise failure  # the checkpoint is as it was: what failed is the checkpoint itself
            return file, _upgraded(ckpt)
        removed = after is None or after[1] is None
        if failure is None and before is not None and removed:
            return file, _upgraded(ckpt)  # removed once everything was read: what was read is one checkpoint
        if not run and removed:
            raise CheckpointNotFound(
                f"{file} was removed during the read (a training run's keep_last prunes its older checkpoints); "
                f"give the run directory to read its newest checkpoint", "removed during the read")
        warn(f"warning: {file} was {'removed' if removed else 'replaced'} during the read (a training run's "
             f"keep_last or its next save); reading {'the newest checkpoint of ' + path if run else 'it'} again")
    raise CheckpointError(f"{path}: the checkpoint changed under each of {READ_TRIES} reads (a run that saves "
                          f"faster than a checkpoint is read); copy one out of the run and read the copy",
                          "changed during every read")


def _upgraded(ckpt):
    if "config" in ckpt:  # train.py's run config, with the keys older versions kept elsewhere moved
        ckpt["config"] = upgrade(ckpt["config"])
    return ckpt


def _read(file, mmap, optimizer, join_shards):
    if os.path.isdir(file):
        return load_sharded_whole(file, optimizer) if join_shards else check_sharded(file)
    return _load_file(file, mmap)


def _identity(path):
    """What tells the checkpoint at `path` from one written there later, or None when nothing is there: a file's
    inode, size and mtime (and () after them); a folder's inode, then its DONE's (None without a DONE). A read
    that overlaps a replacement may mix the two: torch.load with mmap opens a .pt file twice by name, and a
    folder's files are opened one by one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # unreadable: the read fails the same way, which then says why
        return ("unreadable", e.errno), ()
    if not stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), ()
    try:
        done = os.stat(os.path.join(path, DONE))
    except OSError:
        return (st.st_dev, st.st_ino), None
    return (st.st_dev, st.st_ino), (done.st_ino, done.st_size, done.st_mtime_ns)


def _load_file(file, mmap):
    if not zipfile.is_zipfile(file):  # torch.save's format; anything else would fail with a puzzling message
        raise CheckpointError(f"{file} is not a checkpoint (torch.save writes a zip archive; this file is not one)",
                              "not a whole zip archive, as torch.save writes: cut short, or not a checkpoint")
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a torn zip, a truncated pickle, a file of something else: all unusable
        raise CheckpointError(f"cannot load the checkpoint {file}: {_reason(e)}", _reason(e)) from None
    if not isinstance(ckpt, dict) or not {"model_config", "model"} <= set(ckpt):
        raise CheckpointError(f"{file} is not a checkpoint of this repository (it has no model_config and model)",
                              "not a checkpoint of this repository")
    return ckpt


def _reason(e):
    return (str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]


# ---------------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint), written by every rank of a train.parallel = "fsdp" run


def save_sharded(tensors, state, path):
    """Write the sharded checkpoint folder `path`: a collective that every rank joins with its own shards
    (`tensors`: nested dicts of DTensors and tensors, saved by torch.distributed.checkpoint) and the same
    `state` (JSON-able; rank 0 writes it as state.json). The folder is written as PATH.tmp-PID, DONE goes in
    last, and only then is it renamed to `path` (an old `path`, best/, is replaced whole). An OSError on any
    rank (a full disk) is raised on every rank, so that they stop together."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    master = dist.get_rank() == 0
    names = [f"{path}.tmp-{os.getpid()}"]
    dist.broadcast_object_list(names, src=0)  # rank 0's pid: one folder for all ranks
    tmp = names[0]
    _on_rank0(lambda: os.makedirs(tmp))  # before any rank writes into it
    try:
        dcp.save(tensors, checkpoint_id=tmp)  # each rank's files fsynced; rank 0 writes .metadata last
    except CheckpointException as e:
        # every rank raises it, with every rank's failure: a failed write (a full disk, a file-size limit, in
        # whatever form torch.save raised it on the rank that met it) becomes the same OSError on each
        failures = (outputs.write_failure(error, path) for error, _ in e.failures.values())
        oserror = next((failure for failure in failures if failure is not None), None)
        if oserror is not None:
            raise OSError(oserror.errno, oserror.strerror, path) from None
        raise
    dist.barrier()  # every rank's shards are on disk

    def finish():
        outputs.write_text(os.path.join(tmp, SHARDED_STATE), json.dumps(state, default=_as_list))
        sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        outputs.write_text(os.path.join(tmp, DONE), json.dumps(sizes, indent=0) + "\n")
        outputs.swap_in(tmp, path)  # best/ again: exchanged in one step, recover() finishes a killed swap
    try:
        _on_rank0(finish)
    except OSError as e:
        if not master:
            raise
        raise WriteError(e, path, "its previous version is unchanged" if os.path.exists(path) else
                         "nothing was written") from None


def _as_list(value):
    if isinstance(value, torch.Tensor):  # an RNG state (bytes) in state.json
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} into {SHARDED_STATE}")


def _on_rank0(job):
    """Run job() on rank 0 only, then tell every rank whether it failed: the others must not wait at the next
    collective for a rank that has given up. Rank 0 raises the job's own OSError, the others an OSError too."""
    import torch.distributed as dist

    error = None
    if dist.get_rank() == 0:
        try:
            job()
        except OSError as e:
            error = e
    failed = [error is not None]
    dist.broadcast_object_list(failed, src=0)
    if error is not None:
        raise error
    if failed[0]:
        raise OSError(None, "rank 0 could not write the checkpoint")


def check_sharded(path):
    """The state.json of a complete sharded checkpoint folder; a CheckpointError when it is incomplete or
    damaged (no DONE, or files that do not match it: a copy cut short)."""
    try:
        with open(os.path.join(path, DONE)) as f:
            sizes = json.load(f)
        for name, size in sizes.items():
            if os.path.getsize(os.path.join(path, name)) != size:
                reason = f"damaged: {name} has {os.path.getsize(os.path.join(path, name)):,} bytes, not {size:,}"
                raise CheckpointError(f"the sharded checkpoint {path} is {reason}", reason)
        with open(os.path.join(path, SHARDED_STATE)) as f:
            state = json.load(f)
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        reason = f"incomplete: {os.path.basename(e.filename)} is missing"
        raise CheckpointError(f"the sharded checkpoint {path} is {reason}", reason) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the checkpoint {path}: {_reason(e)}", _reason(e)) from None
    if not isinstance(state, dict) or "model_config" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this repository (its state.json has no model_config)",
                              "not a checkpoint of this repository")
    return state


def _from_dcp(record):
    return "torch/distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


def _dcp_loggers():
    """Every logger torch.distributed.checkpoint logs on: the root logger (its loader's warnings), its module
    loggers, and its event logger (c10d_logger's "c10d-<handler>-dcp_logger", which does not propagate)."""
    from torch.distributed.checkpoint import logger as dcp_logger

    named = [logger for name, logger in logging.Logger.manager.loggerDict.items()
             if name.startswith("torch.distributed.checkpoint") and isinstance(logger, logging.Logger)]
    return [logging.getLogger(), dcp_logger._dcp_logger, *named]


@contextmanager
def dcp_quiet():
    """torch.distributed.checkpoint's loader logs each failed read of a damaged folder's metadata, traceback and
    all (before it raises), once per attempt and rank: four tracebacks before the one line that says which
    checkpoint to move away. For the block, every logger that package logs on drops its records. The filter sits
    on each of those loggers, not on the root alone: a logger's filters see only the records created on it, and a
    handler attached to a non-propagating logger (pytest's log capture attaches one to each) would still get
    them."""
    loggers = _dcp_loggers()
    for logger in loggers:
        logger.addFilter(_from_dcp)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_from_dcp)


def load_sharded_whole(path, optimizer=False):
    """A sharded checkpoint folder as the dict a .pt checkpoint holds: whole tensors, read in this process
    without torch.distributed (torch.distributed.checkpoint joins the shards). The optimizer's state, saved
    by parameter name, comes back in torch's layout (numbered in the order of its param groups), as a DDP
    run's checkpoint has it."""
    # torch's reader of a whole DCP checkpoint into one process (what format_utils.dcp_to_torch_save uses)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ckpt = check_sharded(path)
    groups = ckpt.pop("optimizer_param_groups", None)
    try:
        with warnings.catch_warnings(), dcp_quiet():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            tensors = _load_state_dict_from_keys({"model", "optimizer"} if optimizer else {"model"}, checkpoint_id=path)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            raise
        raise CheckpointError(f"cannot load the checkpoint {path}: {_reason(e)}", _reason(e)) from None
    ckpt["model"] = tensors["model"]
    if optimizer and groups is not None:
        ckpt["optimizer"] = numbered_optimizer_state(tensors.get("optimizer", {}).get("state", {}), groups)
    return ckpt


def numbered_optimizer_state(by_name, groups):
    """torch.optim's state_dict layout from per-parameter-name state and param groups that list names."""
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    return {"state": {index[name]: state for name, state in by_name.items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in groups]}


def keep_last(run_dir, k):
    """Delete all but the newest k step checkpoints (best is not one of them)."""
    for old in step_checkpoints(run_dir)[:-k]:
        if os.path.isdir(old):
            shutil.rmtree(old)
        else:
            os.remove(old)


def checkpoint_step(path):
    return int(STEP_NAME.match(os.path.basename(path)).group(1))


def reject_after(run_dir, step):
    """Set aside (as *.rejected, which nothing loads) every step checkpoint newer than `step`, so that
    `--resume` continues from the one before them. Returns the paths set aside."""
    rejected = [p for p in step_checkpoints(run_dir) if checkpoint_step(p) > step]
    for path in rejected:
        outputs.set_aside(path, REJECTED)
    return rejected


def load_newest(paths, warn=print, join_shards=True, set_aside=False):
    """(path, checkpoint) of the newest of `paths` (oldest first) that loads (with its optimizer state; a
    sharded one as join_shards says); each one that does not is named through `warn` with the reason.
    (None, None) when none does. With `set_aside` (one process of a run: its rank 0), the ones skipped are
    renamed NAME.damaged once an older one loads, so that no reader meets them again (the run goes on to
    write a new checkpoint of their step) and the user finds them for a look."""
    skipped = []
    for path in reversed(paths):
        try:
            found = load_checkpoint(path, mmap=False, optimizer=True, join_shards=join_shards, warn=warn)
        except CheckpointError as e:
            warn(f"warning: cannot load {path} ({e.reason}); trying the one before it")
            skipped.append(path)
            continue
        for damaged in skipped if set_aside else ():
            try:
                warn(f"warning: {damaged} set aside as {os.path.basename(outputs.set_aside(damaged, DAMAGED))}")
            except FileNotFoundError:
                pass  # another process set it aside already
        return found
    return None, None


# ---------------------------------------------------------------------------------------------------
# What a run may take from another run's checkpoint: its tokenizer must be the run's (a resume, init_from), and
# init_from's weights must fit the run's model.


def check_checkpoint_tokenizer(ckpt, cfg, what):
    """UserError when the checkpoint was trained with another tokenizer than data.tokenizer: the same name whose
    files changed (the recorded sha256 differs), or another name (older checkpoints: GPT-2's)."""
    current = tokenizer_identity(cfg.data.tokenizer)
    recorded = checkpoint_tokenizer(ckpt)[1]
    if recorded is not None and recorded.sha256 != current.sha256:
        raise UserError(f"{what} was trained with the tokenizer {recorded.describe()}, not data.tokenizer = "
                        f"{current.describe()}: its token ids mean other text")


def load_init_weights(cfg, master):
    """The weights train.init_from names (a state dict), or None. Only for a fresh run: a run directory
    with checkpoints of its own resumes from them (recovery.load_resume_state), whatever init_from says.
    Model settings may differ from the checkpoint's where no parameter changes shape, and in
    PARAMETER_ADDING_MODEL_KEYS where that only adds parameters (SSMax's scales, a prior's), which then start
    from this config's initialisation (train.py's build_model; INITIALISATION_MODEL_KEYS, which may always change,
    say where) and are named in one line."""
    source = cfg.train.init_from
    if not source:
        return None
    try:
        path, ckpt = load_checkpoint(source, warn=None if master else lambda line: None)
    except CheckpointError as e:
        raise UserError(f"train.init_from = {source!r}: no usable checkpoint there ({e})") from None
    check_checkpoint_tokenizer(ckpt, cfg, f"train.init_from = {source!r}")
    saved, current = {"model": ckpt["model_config"]}, {"model": dataclasses.asdict(cfg.model)}
    allowed = SHAPE_FREE_MODEL_KEYS + PARAMETER_ADDING_MODEL_KEYS + INITIALISATION_MODEL_KEYS
    forbidden, changed = checkpoint_differences(saved, current, {"model": allowed})
    added, lost = added_parameters(cfg.model, ckpt["model"])
    if lost:  # the change would drop or reshape trained parameters: only adding is allowed
        adding = [c for c in changed if c.split(":")[0].removeprefix("model.") in PARAMETER_ADDING_MODEL_KEYS]
        if adding:
            forbidden += adding
            changed = [c for c in changed if c not in adding]
        elif not forbidden:
            forbidden.append(f"parameters {', '.join(lost[:3])}")
    if forbidden:
        raise UserError(f"train.init_from = {source!r} has other parameter shapes ({'; '.join(forbidden)}); only "
                        f"these model settings may change: {', '.join(SHAPE_FREE_MODEL_KEYS)}, "
                        f"{', '.join(INITIALISATION_MODEL_KEYS)} (where added parameters start), and "
                        f"{', '.join(PARAMETER_ADDING_MODEL_KEYS)} where that only adds parameters")
    old_pe = ckpt["model_config"].get("pe", cfg.model.pe)
    if old_pe != cfg.model.pe and old_pe != "nope" and not cfg.train.init_change_pe:
        raise UserError(f"train.init_from = {source!r} was trained with pe = {old_pe!r}, which its weights rely on; "
                        f"model.pe = {cfg.model.pe!r} drops it: pass --train.init_change_pe=true to change the "
                        f"encoding anyway")
    if master:
        if old_pe != cfg.model.pe:  # DroPE's recipe, or another re-encoding: the line that says which
            print(f"dropping pe = {old_pe!r}, which the weights of {path} were trained with, for "
                  f"{cfg.model.encoding_label.removeprefix('pe=')}{' + qk_norm' if cfg.model.qk_norm else ''}: "
                  f"recalibrating for {cfg.train.max_steps:,} steps (docs/training.md, \"Dropping RoPE after "
                  f"pretraining\")")
        print(f"initialised from {path} (step {ckpt.get('step', '?')}): weights only; fresh optimizer, schedule "
              f"and data" + (f"; changed: {'; '.join(changed)}" if changed else ""))
        if added:
            print(f"new parameters, not in {path}, start from this config's initialisation: {', '.join(added)}")
    return ckpt["model"]


def added_parameters(model_config, state):
    """(the parameters a model of `model_config` has that `state` lacks, as name patterns with their count;
    the names in `state` that such a model drops or reshapes). Shapes only: the model is built on the meta
    device."""
    with torch.device("meta"):
        wanted = {name: tuple(t.shape) for name, t in Transformer(model_config).state_dict().items()}
    lost = [name for name, t in state.items() if wanted.get(name) != tuple(t.shape)]
    counts = {}
    for name in wanted:
        if name not in state:
            pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
            counts[pattern] = counts.get(pattern, 0) + 1
    return [f"{p} ({n} tensors)" if n > 1 else p for p, n in counts.items()], lost


class RunDirInUse(RuntimeError):
    pass


@contextmanager
def run_dir_lock(run_dir):
    """Hold RUN/.lock for the block (outputs.locked_folder): a second writer of the same run directory gets
    RunDirInUse naming the holder; it touches nothing but opens the lock file. The kernel releases the lock
    when the holder exits in any way (also SIGKILL), so a crashed run never leaves it stuck; it also holds
    across machines on NFS (Linux emulates flock with POSIX locks). A run refused before it wrote anything (a
    bad init_from, changed settings) leaves no directory behind if it made it. OSError (not creatable,
    read-only) reaches the caller."""
    with outputs.locked_folder(run_dir, LOCK, run_dir, "train.py", refused=RunDirInUse):
        yield


def main(argv=None):
    parser = Parser(prog="python -m bam.checkpoint", description=(
        "Write a checkpoint as one .pt file: a sharded step folder of an FSDP run (or a run directory, whose "
        "newest checkpoint is taken) in the layout of a DDP run's step_*.pt: model, optimizer and train state, "
        "read by torch.load(weights_only=True). Nothing needs it (every reader takes the folders as they are); "
        "it is for copying one file elsewhere."))
    parser.add_argument("source", help="a checkpoint folder or file, or a run directory")
    parser.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    try:
        path, ckpt = load_checkpoint(args.source, optimizer=True)
    except CheckpointError as e:
        raise UserError(e) from None
    save_atomic(ckpt, args.out)
    print(f"{path} -> {args.out} (step {ckpt.get('step', '?')}, {len(ckpt['model'])} tensors)")


if __name__ == "__main__":
    run_cli(main)
