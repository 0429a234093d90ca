"""checkpoint.py: the atomic writer (old file kept on failure, no temp file left), checkpoint discovery
(newest step by number, temp files ignored, best.pt as the fallback), keep-last-K, and that it is the
repository's only writer that renames files into place."""

import ast
import dataclasses
import glob
import json
import os

import pytest
import torch

from bam import checkpoint
from bam.checkpoint import (best_path, checkpoint_dict, find_checkpoint, keep_last, save_atomic, step_checkpoints,
                            step_path)
from bam.outputs import atomic_file, remove_temp_files, write_bytes, write_text
from tiny_models import tiny_config, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(os.path.basename(path))


def test_atomic_writes_replace_the_file_whole(tmp_path):
    path = str(tmp_path / "deep" / "er" / "file.txt")  # missing folders are made
    write_text(path, "old")
    write_bytes(path, [b"new ", b"content"])
    assert open(path).read() == "new content"
    save_atomic({"x": torch.arange(3)}, tmp_path / "obj.pt")  # a Path works too
    assert torch.equal(torch.load(tmp_path / "obj.pt", weights_only=True)["x"], torch.arange(3))
    assert sorted(os.listdir(tmp_path / "deep" / "er")) == ["file.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    write_text(path, "old\n")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_file(path, "w") as f:
            f.write("half of the new")
            raise RuntimeError("disk on fire")
    assert open(path).read() == "old\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")
    save_atomic({"step": 1}, str(tmp_path / "ckpt.pt"))
    with pytest.raises(TypeError):
        save_atomic({"step": 2, "bad": Unpicklable()}, str(tmp_path / "ckpt.pt"))
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True) == {"step": 1}
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "metrics.jsonl"]


def test_discovery_takes_the_newest_step_and_ignores_temp_files(tmp_path):
    run = str(tmp_path / "run")
    for step in (2, 10, 9):
        touch(step_path(run, step))
    touch(step_path(run, 11) + ".tmp-1234")  # a save killed before its rename
    touch(best_path(run))
    assert os.path.basename(step_path(run, 10)) == "step_00000010.pt"
    assert step_checkpoints(run) == [step_path(run, s) for s in (2, 9, 10)]  # by number, not by text
    assert find_checkpoint(run) == step_path(run, 10)
    assert find_checkpoint(best_path(run)) == best_path(run)  # a file is taken as it is

    only_best = str(tmp_path / "only_best")
    touch(best_path(only_best))
    assert find_checkpoint(only_best) == best_path(only_best)
    os.makedirs(tmp_path / "empty" / "checkpoints")
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*empty/checkpoints"):
        find_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no checkpoint file or run directory at /no/such/run"):
        find_checkpoint("/no/such/run")


def test_keep_last_and_temp_file_cleanup(tmp_path):
    run = str(tmp_path)
    for step in range(1, 6):
        touch(step_path(run, step))
    touch(best_path(run))
    touch(step_path(run, 6) + ".tmp-99")
    keep_last(run, 2)
    remove_temp_files(checkpoint.checkpoint_dir(run))
    assert sorted(os.listdir(checkpoint.checkpoint_dir(run))) == ["best.pt", "step_00000004.pt", "step_00000005.pt"]


def test_checkpoint_dict_holds_the_config_the_weights_and_the_state():
    @dataclasses.dataclass
    class Config:
        width: int = 3

    model = torch.nn.Linear(3, 2)
    model.config = Config()
    ckpt = checkpoint_dict(model, step=7, val_loss=1.5)
    assert list(ckpt) == ["model_config", "model", "step", "val_loss"]
    assert ckpt["model_config"] == {"width": 3} and torch.equal(ckpt["model"]["weight"], model.weight)


def test_checkpoint_is_the_only_module_that_renames_files_into_place():
    """Every other writer goes through outputs.atomic_file (one place that fsyncs the directory), or, for a
    folder, outputs.swap_in."""
    sources = [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
               if "/tests/" not in p and os.path.basename(p) not in ("checkpoint.py", "outputs.py")]
    assert len(sources) > 10
    for path in sources:
        calls = [node for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr in ("replace", "rename")
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"]
        assert not calls, f"{os.path.relpath(path, ROOT)}:{calls[0].lineno} renames a file itself"


def sharded_folder(path, files=None):
    """A sharded checkpoint folder as save_sharded leaves it (the shards are stand-ins: only sizes are checked)."""
    files = files or {".metadata": b"meta", "__0_0.distcp": b"shard 0", "state.json": b'{"model_config": {}}'}
    os.makedirs(path)
    for name, content in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(content)
    write_text(os.path.join(path, checkpoint.DONE), json.dumps({name: len(c) for name, c in files.items()}))
    return path


def test_a_step_saved_twice_is_ordered_with_its_complete_copy_last(tmp_path, monkeypatch):
    """A sharded folder and a .pt file of one step (a run that switched train.parallel): the complete copy is the
    newest, whichever it is, and only a step saved twice is opened to tell."""
    run = str(tmp_path / "run")
    sharded_folder(step_path(run, 4, sharded=True))
    with open(step_path(run, 4), "wb") as f:
        f.write(b"PK\x03\x04 a zip cut short by a kill")
    os.makedirs(step_path(run, 9, sharded=True))  # a folder without DONE: the .pt of step 9 is whole
    torch.save({"step": 9}, step_path(run, 9))
    touch(step_path(run, 2))
    real, opened = checkpoint.looks_complete, []
    monkeypatch.setattr(checkpoint, "looks_complete", lambda p: opened.append(os.path.basename(p)) or real(p))
    assert step_checkpoints(run) == [step_path(run, 2), step_path(run, 4), step_path(run, 4, True),
                                     step_path(run, 9, True), step_path(run, 9)]
    assert sorted(opened) == ["step_00000004", "step_00000004.pt", "step_00000009", "step_00000009.pt"]


def test_sharded_folders_are_step_checkpoints_found_kept_and_set_aside_like_files(tmp_path):
    run = str(tmp_path / "run")
    for step in (3, 12):
        sharded_folder(step_path(run, step, sharded=True))
    touch(step_path(run, 5))  # a .pt from before train.parallel changed
    os.makedirs(step_path(run, 13, sharded=True) + ".tmp-77")  # a save killed before its rename
    sharded_folder(best_path(run, sharded=True))
    assert step_checkpoints(run) == [step_path(run, 3, True), step_path(run, 5), step_path(run, 12, True)]
    assert find_checkpoint(run) == step_path(run, 12, True)
    assert find_checkpoint(step_path(run, 3, True)) == step_path(run, 3, True)  # a folder is a checkpoint, not a run
    assert checkpoint.reject_after(run, 4) == [step_path(run, 5), step_path(run, 12, True)]
    assert os.path.isdir(step_path(run, 12, True) + ".rejected") and step_checkpoints(run) == [step_path(run, 3, True)]
    for name in ("step_00000005.pt.rejected", "step_00000012.rejected"):
        os.replace(os.path.join(checkpoint.checkpoint_dir(run), name),
                   os.path.join(checkpoint.checkpoint_dir(run), name.removesuffix(".rejected")))
    keep_last(run, 1)
    remove_temp_files(checkpoint.checkpoint_dir(run))
    assert sorted(os.listdir(checkpoint.checkpoint_dir(run))) == ["best", "step_00000012"]
    only_best = str(tmp_path / "only_best")
    sharded_folder(best_path(only_best, sharded=True))
    assert find_checkpoint(only_best) == best_path(only_best, sharded=True)


def test_an_incomplete_or_damaged_sharded_folder_is_refused_and_skipped(tmp_path):
    run = str(tmp_path / "run")
    good = sharded_folder(step_path(run, 1, sharded=True))
    cut = sharded_folder(step_path(run, 2, sharded=True))
    with open(os.path.join(cut, "__0_0.distcp"), "wb") as f:
        f.write(b"sh")  # a copy cut short
    unfinished = step_path(run, 3, sharded=True)
    os.makedirs(unfinished)  # DONE missing (not made by save_sharded, which renames only complete folders)
    with open(os.path.join(unfinished, ".metadata"), "wb") as f:
        f.write(b"meta")
    with pytest.raises(checkpoint.CheckpointError, match="is damaged: __0_0.distcp has 2 bytes, not 7"):
        checkpoint.check_sharded(cut)
    with pytest.raises(checkpoint.CheckpointError, match="is incomplete: DONE is missing"):
        checkpoint.check_sharded(unfinished)
    warnings = []
    path, state = checkpoint.load_newest(step_checkpoints(run), warn=warnings.append, join_shards=False)
    assert path == good and state == {"model_config": {}}
    assert warnings == [f"warning: cannot load {unfinished} (incomplete: DONE is missing); trying the one before it",
                        f"warning: cannot load {cut} (damaged: __0_0.distcp has 2 bytes, not 7); trying the one "
                        "before it"]


# ---------------------------------------------------------------------------------------------------
# A run read while it trains: the chosen checkpoint pruned (keep_last) or replaced during the read


def trainer_saves_during_the_first_read(monkeypatch, save, times=1):
    """Wrap the reader of a .pt file so that its first `times` calls run `save(file)` (what a live run does between
    the reader's choice and its read: a new step saved and the older ones pruned, or best.pt replaced) before
    reading. Returns the files it was called with."""
    real, calls = checkpoint._load_file, []

    def reading(file, mmap):
        calls.append(file)
        if len(calls) <= times:
            save(file)
        return real(file, mmap)
    monkeypatch.setattr(checkpoint, "_load_file", reading)
    return calls


def test_a_run_pruned_during_the_read_is_read_again_at_its_newest_checkpoint(tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    for step in (1, 2):
        checkpoint.save_model(tiny_model(seed=step), step_path(run, step))

    def next_save(file):  # steps 3 and 4 saved, keep_last = 2: the chosen step 2 is gone
        for step in (3, 4):
            checkpoint.save_model(tiny_model(seed=step), step_path(run, step))
        keep_last(run, 2)
    calls = trainer_saves_during_the_first_read(monkeypatch, next_save)
    capsys.readouterr()
    model = checkpoint.load_model(run)
    assert calls == [step_path(run, 2), step_path(run, 4)]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_model(seed=4).state_dict().values()))
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {step_path(run, 2)} was removed during the read (a training run's keep_last or its next save); "
        f"reading the newest checkpoint of {run} again"]

    # A run that saves and prunes during every read: a bounded number of tries, then one line
    def prune_newest(file):
        step = checkpoint.checkpoint_step(file) + 1
        checkpoint.save_model(tiny_model(seed=step), step_path(run, step))
        keep_last(run, 1)
    trainer_saves_during_the_first_read(monkeypatch, prune_newest, times=checkpoint.READ_TRIES)
    with pytest.raises(checkpoint.CheckpointError, match=f"changed under each of {checkpoint.READ_TRIES} reads"):
        checkpoint.load_checkpoint(run, warn=lambda line: None)


def test_a_named_checkpoint_removed_during_the_read_is_one_line_saying_so(tmp_path, monkeypatch, capsys):
    from bam.cli import run_cli

    run = str(tmp_path / "run")
    for step in (1, 2):
        checkpoint.save_model(tiny_model(seed=step), step_path(run, step))
    trainer_saves_during_the_first_read(monkeypatch, os.remove)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run_cli(checkpoint.main, [step_path(run, 1), str(tmp_path / "out.pt")])  # python -m bam.checkpoint
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.splitlines() == [
        f"error: {step_path(run, 1)} was removed during the read (a training run's keep_last prunes its older "
        "checkpoints); give the run directory to read its newest checkpoint"], err
    assert not os.path.exists(tmp_path / "out.pt")

    # best.pt replaced whole during the read (a new best saved): read again, the new one
    checkpoint.save_model(tiny_model(seed=5), best_path(run))
    trainer_saves_during_the_first_read(monkeypatch, lambda file: checkpoint.save_model(tiny_model(seed=6), file))
    warned = []
    file, ckpt = checkpoint.load_checkpoint(best_path(run), warn=warned.append)
    assert torch.equal(ckpt["model"]["tok_emb.weight"], tiny_model(seed=6).tok_emb.weight)
    assert warned == [f"warning: {best_path(run)} was replaced during the read (a training run's keep_last or its "
                      "next save); reading it again"]


def test_dcp_quiet_drops_torch_distributed_checkpoint_records_on_every_logger_it_logs_on():
    """torch.distributed.checkpoint logs on the root logger, on its module loggers and on its event logger, which
    does not propagate: a handler on any of them (a user's, or pytest's log capture, which attaches to each
    non-propagating logger) must see none of its records inside the block, and the rest as before."""
    import logging

    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint import logger as dcp_logger

    dcp_file = dcp_logger.__file__
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.pathname))

    handler = Keep(logging.DEBUG)
    loggers = [logging.getLogger(), dcp_logger._dcp_logger, default_planner.logger]
    names = {logger.name for logger in loggers}
    for logger in loggers:
        logger.addHandler(handler)

    def log_everywhere(pathname):
        for logger in loggers:
            logger.handle(logger.makeRecord(logger.name, logging.ERROR, pathname, 1, "read failed", None, None))

    try:
        with checkpoint.dcp_quiet():
            log_everywhere(dcp_file)
            assert seen == []
            log_everywhere(__file__)  # not torch.distributed.checkpoint's: kept
            assert {name for name, _ in seen} == names
        seen.clear()
        log_everywhere(dcp_file)  # after the block, nothing is dropped
        assert {name for name, _ in seen} == names
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_added_parameters_names_what_init_from_adds_and_what_it_would_drop():
    """train.init_from's shape check: a model with SSMax adds one scale per layer to a checkpoint without it (named
    once, as a pattern); a wider model would reshape every trained tensor but the prior's (one per head)."""
    base = tiny_config()
    state = tiny_model().state_dict()
    assert checkpoint.added_parameters(base, state) == ([], [])
    assert checkpoint.added_parameters(dataclasses.replace(base, ssmax=True), state) == (
        ["blocks.*.attn.ssmax_scale (2 tensors)"], [])
    added, lost = checkpoint.added_parameters(dataclasses.replace(base, n_embd=64), state)
    kept = [name for name in state if name not in lost]
    assert added == [] and all(name.startswith("priors.") for name in kept) and "tok_emb.weight" in lost, kept
