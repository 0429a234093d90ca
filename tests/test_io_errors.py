"""Every everyday input and output error of every command line is one `error: ...` line and a non-zero exit,
and nothing is lost: bad input files (binary, non-UTF-8, a directory where a file belongs, unreadable), an
output folder that cannot be written (checked before any work), a disk that fills up while a checkpoint, a
shard or results are written (the message names the file and says the disk is full; the previous file stays
whole; an evaluator still prints what it computed), token ids beyond the vocabulary, a report of nothing.

Tests run as root, for whom permission bits mean nothing, so an unwritable folder is either a path under a
regular file (NotADirectoryError) or a monkeypatched OSError (EROFS, EACCES); a full disk is an ENOSPC
raised by a monkeypatched os.fsync (where a real full disk often first shows) or write."""

import contextlib
import errno
import glob
import io
import json
import os

import numpy as np
import pytest
import torch

from bam import checkpoint, data, outputs, tokenizer
from bam.checkpoint import save_model
from bam.cli import WriteError, describe_os_error, run_cli, user_errors
from bam.tokenizer import load_tokenizer
from small_runs import small_config
from tiny_models import GPT2_VOCAB, tiny_model

pytestmark = pytest.mark.slow  # every command's main end to end, with its input and output failing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BINARY = bytes(range(256)) * 4  # NUL bytes and invalid UTF-8
LATIN1 = "Zürich café, crème brûlée: a text saved as Latin-1.\n".encode("latin-1")


def one_error_line(call, *args, **kwargs):
    """Run a command's main (in-process), expect SystemExit != 0 and exactly one `error: ` line on stderr,
    which it returns; also returns stdout."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        call(*args, **kwargs)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert stop.value.code not in (0, None), err.getvalue()
    assert len(errors) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    return errors[0], out.getvalue()


def disk_full_after(monkeypatch, n_ok):
    """os.fsync succeeds n_ok times, then every call fails with ENOSPC, as on a disk that just filled up."""
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def temp_files(root):
    return glob.glob(os.path.join(str(root), "**", "*.tmp-*"), recursive=True)


# ---------------------------------------------------------------------------------------------------
# bam/cli.py and bam/checkpoint.py: the vocabulary every command uses


@pytest.mark.parametrize("code,words", [
    (errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only"), (errno.EACCES, "permission denied"),
    (errno.EISDIR, "is a directory"), (errno.ENOENT, "no such file"), (errno.EIO, os.strerror(errno.EIO)),
])
def test_an_os_error_is_one_line_naming_the_path(code, words, capsys):
    with pytest.raises(SystemExit) as stop:
        with user_errors():
            raise OSError(code, os.strerror(code), "/data/run/x.pt")
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1
    assert err.startswith("error: cannot use /data/run/x.pt: ") and words in err


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(OSError) as info:
        os.makedirs(tmp_path / "runs" / "x" / "eval")
    assert describe_os_error(info.value, "cannot write") == (
        f"cannot write {info.value.filename}: {tmp_path / 'runs'} is a file, not a directory")


def test_ctrl_c_is_one_line_with_status_130_and_only_where_asked(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as stop:
        run_cli(interrupted, [], interrupted="tool: interrupted; the lengths finished so far are saved")
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == "tool: interrupted; the lengths finished so far are saved"
    with pytest.raises(KeyboardInterrupt):  # without a message, Ctrl-C is not swallowed
        run_cli(interrupted, [])


def test_a_bug_is_still_a_traceback():
    with pytest.raises(ZeroDivisionError):
        with user_errors():
            1 / 0


@pytest.mark.parametrize("writer", ["save_atomic", "write_text", "write_bytes"])
def test_disk_full_names_the_file_and_keeps_the_previous_one(writer, tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoints" / "step_00000002.pt")
    write = {"save_atomic": lambda value, path: checkpoint.save_atomic({"v": value}, path),
             "write_text": lambda value, path: outputs.write_text(path, str(value)),
             "write_bytes": lambda value, path: outputs.write_bytes(path, [str(value).encode()])}[writer]
    write(1, path)
    before = open(path, "rb").read()
    disk_full_after(monkeypatch, 0)
    with pytest.raises(WriteError) as info:
        write(2, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == path
    assert str(info.value) == (f"cannot write {path}: the disk is full (no space left on device); "
                               f"its previous version is unchanged")
    assert open(path, "rb").read() == before and not temp_files(tmp_path)
    new = str(tmp_path / "checkpoints" / "new.pt")
    with pytest.raises(WriteError, match=r"the disk is full \(no space left on device\); nothing was written"):
        write(3, new)  # a new file: nothing half-written either
    assert not os.path.exists(new) and not temp_files(tmp_path)


def test_an_error_reading_another_file_inside_a_write_is_not_blamed_on_the_write(tmp_path):
    with pytest.raises(FileNotFoundError):
        outputs.write_bytes(str(tmp_path / "out.bin"), (open(tmp_path / "missing", "rb").read() for _ in [0]))
    assert not os.path.exists(tmp_path / "out.bin")


# ---------------------------------------------------------------------------------------------------
# train.py: config files, output folder, disk full during a checkpoint, token ids beyond the vocabulary


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    for name, n in (("syn_val_000000.bin", 2_000), ("syn_train_000001.bin", 6_000)):
        tokens = rng.integers(0, 2_000, n)
        tokens[::40] = data.EOT
        data.write_shard(str(path / name), tokens)
    return str(path)


@pytest.mark.parametrize("content,message", [
    (BINARY, "is not a UTF-8 text file"),
    (LATIN1, "is not a UTF-8 text file"),
    ("directory", "is a directory"),
    (None, "does not exist"),
], ids=["binary", "latin-1", "directory", "missing"])
def test_train_config_that_is_not_a_text_file(content, message, tmp_path):
    import train
    path = tmp_path / "config.toml"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    line, _ = one_error_line(train.main, [str(path)])
    assert message in line and str(path) in line


@pytest.mark.parametrize("setting", ["--model.layer_pattern=rope*1000000000",
                                     "--model.layer_pattern=rope@99999999999999999999",
                                     "--model.attn_window=99999999999999999999"])
def test_a_pattern_or_window_out_of_range_is_refused_before_the_run_folder_is_written(setting, tmp_path, shards):
    """Issue 59: these were accepted, the run folder written (.lock, config.toml, metrics.jsonl, checkpoints/), and
    the first forward died with a MemoryError or OverflowError traceback."""
    import train
    run_dir = tmp_path / "run"
    args = [small_config(tmp_path, shards), "--train.val_every=0", f"--log.out_dir={run_dir}", setting]
    line, _ = one_error_line(train.main, args)
    assert line.startswith("error: ") and ("does not divide" in line or "<= 2147483647" in line), line
    assert not run_dir.exists()


def test_train_output_folder_under_a_file_is_one_line(tmp_path, shards):
    import train
    (tmp_path / "runs").write_text("a file, not a folder")
    args = [small_config(tmp_path, shards), "--train.val_every=0", f"--log.out_dir={tmp_path / 'runs' / 'x'}"]
    line, _ = one_error_line(train.main, args)
    assert f"{tmp_path / 'runs'} is a file, not a directory" in line


def test_disk_full_while_training_keeps_the_previous_checkpoint(tmp_path, shards, monkeypatch):
    import train
    run_dir = tmp_path / "run"
    real_save = torch.save
    saves = []

    def save(obj, f, *args, **kwargs):  # the second checkpoint meets a full disk halfway through
        saves.append(obj.get("step"))
        if len(saves) == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    args = [small_config(tmp_path, shards), "--train.val_every=0", f"--log.out_dir={run_dir}"]
    line, _ = one_error_line(train.main, args)
    second = run_dir / "checkpoints" / "step_00000002.pt"
    assert line == (f"error: cannot write {second}: the disk is full (no space left on device); the previous checkpoint "
                    f"{run_dir / 'checkpoints' / 'step_00000001.pt'} is intact; make room and rerun with --resume")
    kept = sorted(os.listdir(run_dir / "checkpoints"))
    assert kept == ["step_00000001.pt"]  # no temp file, no torn step 2
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(run_dir / "checkpoints" / "step_00000001.pt", weights_only=True)["step"] == 1


def test_token_ids_beyond_the_vocabulary_are_found_before_training(tmp_path):
    tokens = np.arange(3000) % 1000
    tokens[2345] = 60_000  # not GPT-2: e.g. a shard of another tokenizer
    data.write_shard(str(tmp_path / "x_val_000000.bin"), np.arange(100))
    data.write_shard(str(tmp_path / "x_train_000001.bin"), tokens)
    loader = data.ShardLoader(str(tmp_path), "train", 2, 16)
    with pytest.raises(data.ShardError) as info:
        data.check_shard_tokens(loader.paths, 50304)
    assert str(info.value).startswith(f"{tmp_path / 'x_train_000001.bin'}: token 2,345 has id 60000, outside")
    data.check_shard_tokens(loader.paths, 60_001)  # fits: no complaint
    data.check_shard_tokens(loader.paths, 60_001, chunk=7)  # and the chunked scan agrees
    with pytest.raises(data.ShardError, match="token 2,345 has id 60000"):
        data.check_shard_tokens(loader.paths, 50304, chunk=7)


@pytest.mark.parametrize("kind", ["directory", "unreadable"])
def test_a_shard_that_cannot_be_read_is_named(kind, tmp_path, monkeypatch):
    path = tmp_path / "x_train_000001.bin"
    if kind == "directory":
        path.mkdir()
    else:
        data.write_shard(str(path), np.arange(100))
        real = np.fromfile

        def denied(file, *args, **kwargs):
            if os.fspath(file) == str(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(file, *args, **kwargs)
        monkeypatch.setattr(np, "fromfile", denied)
    with pytest.raises(data.ShardError, match=f"{path}"):
        data.shard_num_tokens(str(path))


# ---------------------------------------------------------------------------------------------------
# prepare_fineweb.py: --input files, --out_dir, disk full while writing shards


@pytest.fixture
def prepare_main(tmp_path, monkeypatch):
    import datasets.config

    import prepare_fineweb
    cache = str(tmp_path / "hf_datasets_cache")  # `datasets` leaves lock files in its cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return prepare_fineweb.main


def local_args(inputs, out_dir):
    return ["--source", "local", "--input", *map(str, inputs), "--out_dir", str(out_dir), "--workers", "1",
            "--shard_size", "300"]


@pytest.mark.parametrize("name,content,message", [
    ("corpus.txt", BINARY, "holds binary data"),
    ("corpus.jsonl", BINARY, "holds binary data"),
    ("corpus.txt", LATIN1, "is not UTF-8 text"),
    ("corpus.parquet", b"PAR1 but then not parquet at all", "is not a parquet file"),
    ("corpus.jsonl", b'{"text": "fine"}\n{"text": "torn', "cannot read"),
    ("corpus.jsonl", ('{"text": "' + "a" * 70_000 + '\xe9"}\n').encode("latin-1"), "cannot read"),
], ids=["binary txt", "binary jsonl", "latin-1 txt", "fake parquet", "torn jsonl", "latin-1 past the sniffed start"])
def test_bad_input_files_are_named_and_nothing_is_written(name, content, message, tmp_path, prepare_main):
    path = tmp_path / name
    path.write_bytes(content)
    out_dir = tmp_path / "out"
    line, _ = one_error_line(prepare_main, local_args([path], out_dir))
    assert message in line and str(path) in line
    assert not glob.glob(str(out_dir / "*.bin"))


def test_input_directory_and_unreadable_input(tmp_path, prepare_main, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A document.")
    line, _ = one_error_line(prepare_main, local_args([tmp_path / "corpus"], tmp_path / "out"))
    assert "is a directory; give its files" in line and os.path.join(str(tmp_path / "corpus"), "*.jsonl") in line

    real_open = open

    def denied(file, *args, **kwargs):
        if os.fspath(file).endswith("a.txt"):
            raise PermissionError(errno.EACCES, "Permission denied", file)
        return real_open(file, *args, **kwargs)
    import builtins
    monkeypatch.setattr(builtins, "open", denied)
    line, _ = one_error_line(prepare_main, local_args([tmp_path / "corpus" / "a.txt"], tmp_path / "out"))
    assert line == f"error: cannot read --input file {tmp_path / 'corpus' / 'a.txt'}: permission denied"


@pytest.mark.parametrize("how", ["under a file", "read-only"])
def test_unwritable_out_dir_fails_before_reading_the_corpus(how, tmp_path, prepare_main, monkeypatch):
    import prepare_fineweb
    corpus = tmp_path / "c.txt"
    corpus.write_text("A document about attention.")
    if how == "under a file":
        (tmp_path / "data").write_text("a file")
        out_dir = tmp_path / "data" / "shards"
        expected = f"{tmp_path / 'data'} is a file, not a directory"
    else:
        out_dir = tmp_path / "shards"

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(out_dir))
        monkeypatch.setattr(outputs.tempfile, "NamedTemporaryFile", read_only)
        expected = "the file system is read-only"
    monkeypatch.setattr(prepare_fineweb, "local_documents", lambda files: pytest.fail("read the corpus"))
    line, _ = one_error_line(prepare_main, local_args([corpus], out_dir))
    assert line.startswith(f"error: cannot write shards to {out_dir}") and expected in line
    assert "choose another --out_dir" in line


def test_disk_full_while_writing_shards_keeps_the_finished_ones(tmp_path, prepare_main, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i} is about the prior of head {i}. " * 20}) + "\n"
                              for i in range(8)))
    out_dir = tmp_path / "out"
    real_fsync = os.fsync
    # Two fsyncs per file (its data, then its folder): the manifest, shard 0, manifest, shard 1, manifest; then full
    disk_full_after(monkeypatch, 10)
    line, _ = one_error_line(prepare_main, local_args([corpus], out_dir))
    assert line == (f"error: cannot write {out_dir / 'local_train_000002.bin'}: the disk is full "
                    f"(no space left on device); nothing was written")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert [s["name"] for s in manifest["shards"]] == ["local_val_000000.bin", "local_train_000001.bin"]
    for shard in manifest["shards"]:
        assert data.shard_num_tokens(str(out_dir / shard["name"])) == shard["tokens"] == 300
    assert not temp_files(out_dir)
    monkeypatch.setattr(os, "fsync", real_fsync)  # room again: the same command resumes after the finished shards
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare_main(local_args([corpus], out_dir))
    assert json.loads((out_dir / "manifest.json").read_text())["finished"]


def test_a_torn_manifest_is_one_line(tmp_path, prepare_main):
    corpus = tmp_path / "c.txt"
    corpus.write_text("A document.")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_bytes(BINARY)
    line, _ = one_error_line(prepare_main, local_args([corpus], tmp_path / "out"))
    assert "manifest.json is not a manifest this script wrote" in line


# ---------------------------------------------------------------------------------------------------
# Evaluators and sample.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("io_eval")
    model = tiny_model(vocab_size=GPT2_VOCAB, block_size=64)
    save_model(model, str(root / "run" / "checkpoints" / "step_00000001.pt"))
    enc = load_tokenizer("gpt2")
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    data.write_shard(str(root / "data" / "x_val_000000.bin"), [data.EOT] + enc.encode_ordinary(text))
    return {"run": str(root / "run"), "data": str(root / "data")}


def evaluator(name):
    import importlib
    module = importlib.import_module(f"eval.{name}")
    return module


# The cheapest command line of each evaluator that writes results.
EVAL_ARGS = {
    "passkey": ["--lengths", "128", "--samples", "2", "--no_progress"],
    "niah": ["--lengths", "200", "--samples", "1", "--tasks", "single_number", "--haystacks", "repeat",
             "--no_progress"],
    "perplexity": ["--length", "128", "--num_seqs", "1", "--data_dir", "{data}", "--no_progress"],
    "priors": ["--max_distance", "256"],
    "attention": ["--lengths", "128", "--samples", "1", "--queries", "2", "--data_dir", "{data}", "--no_progress"],
}


def eval_argv(name, run_dir, *extra):
    return [run_dir["run"]] + [a.format(data=run_dir["data"]) for a in EVAL_ARGS[name]] + list(extra)


@pytest.mark.parametrize("name", list(EVAL_ARGS))
def test_unwritable_output_folder_fails_before_computing(name, run_dir, tmp_path, monkeypatch):
    module = evaluator(name)
    import eval.scoring
    monkeypatch.setattr(eval.scoring, "predict_spans", lambda *a, **k: pytest.fail("computed before checking --out"))
    (tmp_path / "results").write_text("a file")
    out = tmp_path / "results" / "eval"
    line, stdout = one_error_line(run_cli, module.main, eval_argv(name, run_dir, "--out", str(out)))
    assert line == (f"error: cannot write results to {out}: {tmp_path / 'results'} is a file, not a directory "
                    f"(choose another folder with --out)")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))
    monkeypatch.setattr(outputs.tempfile, "NamedTemporaryFile", read_only)
    line, _ = one_error_line(run_cli, module.main, eval_argv(name, run_dir, "--out", str(tmp_path / "ro")))
    assert "cannot write results to" in line and "the file system is read-only" in line


@pytest.mark.parametrize("name", list(EVAL_ARGS))
def test_disk_full_at_the_end_still_prints_the_results(name, run_dir, tmp_path, monkeypatch):
    module = evaluator(name)
    disk_full_after(monkeypatch, 0)
    out = tmp_path / "eval"
    line, stdout = one_error_line(run_cli, module.main, eval_argv(name, run_dir, "--out", str(out)))
    assert f"cannot write {out / name}.json: the disk is full" in line
    table_marker = {"passkey": "| 128 |", "niah": "| 200 |", "perplexity": "| 0-64 |", "priors": "layer",
                    "attention": "| 128 |"}[name]
    assert table_marker in stdout  # what was computed is on the screen
    assert not temp_files(tmp_path)


def test_a_sweep_keeps_going_when_a_write_fails_midway_and_saves_at_the_end(run_dir, tmp_path, monkeypatch, capsys):
    from eval import passkey
    real_fsync = os.fsync
    seen = {"n": 0}

    def full_once(fd):  # the first length's save fails, the disk has room again by the end
        seen["n"] += 1
        if seen["n"] == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", full_once)
    out = tmp_path / "eval"
    assert passkey.main([run_dir["run"], "--lengths", "128,160", "--samples", "2", "--no_progress",
                         "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "the disk is full" in captured.err and "going on" in captured.err
    saved = json.loads((out / "passkey.json").read_text())
    assert [r["length"] for r in saved["results"]] == [128, 160] and saved["complete"]


@pytest.mark.parametrize("content,message", [
    (BINARY, "not UTF-8 text"), (LATIN1, "not UTF-8 text"), ("directory", "it is a directory"),
    (None, "no such file or directory"),
], ids=["binary", "latin-1", "directory", "missing"])
def test_sample_prompt_file(content, message, run_dir, tmp_path):
    import sample
    path = tmp_path / "prompt.txt"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    line, _ = one_error_line(run_cli, sample.main, [run_dir["run"], "--prompt_file", str(path)])
    assert message in line and str(path) in line


def test_sample_prompt_file_is_read_as_utf8(run_dir, tmp_path, capsys):
    import sample
    path = tmp_path / "prompt.txt"
    path.write_text("Zürich café", encoding="utf-8")
    assert sample.main([run_dir["run"], "--prompt_file", str(path), "--max_new_tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Zürich café")
    line, _ = one_error_line(run_cli, sample.main, [run_dir["run"], "--prompt", "x", "--prompt_file", str(path)])
    assert "not both" in line


@pytest.mark.parametrize("name", list(EVAL_ARGS))
@pytest.mark.parametrize("source,message", [
    ("binary.pt", "binary.pt is not a checkpoint (torch.save writes a zip archive"),
    ("torn.pt", "cannot load the checkpoint"),
    ("small_vocab", "vocab_size 1000 cannot read GPT-2 tokens"),
    ("empty_dir", "no checkpoint in"),
    ("missing", "no checkpoint file or run directory"),
])
def test_a_source_that_is_not_a_checkpoint(name, source, message, tmp_path, run_dir):
    module = evaluator(name)
    path = tmp_path / source
    if source == "binary.pt":
        path.write_bytes(BINARY)
    elif source == "torn.pt":  # a checkpoint cut short: a zip archive without its end
        save_model(tiny_model(vocab_size=GPT2_VOCAB), str(path))
        whole = path.read_bytes()
        path.write_bytes(whole[:1000] + whole[-200:])
    elif source == "small_vocab":
        save_model(tiny_model(vocab_size=1000), str(path / "step_1.pt"))
        path = path / "step_1.pt"
    elif source == "empty_dir":
        path.mkdir()
    argv = [str(path)] + eval_argv(name, run_dir)[1:]
    line, _ = one_error_line(run_cli, module.main, argv)
    assert message in line


def test_report_with_nothing_to_report_fails(run_dir, tmp_path):
    from eval import report
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    out = tmp_path / "report.md"
    line, _ = one_error_line(run_cli, report.main, [str(empty), "--out", str(out)])
    assert line.startswith("error: nothing to report: no evaluation results in")
    assert not out.exists()


def test_report_survives_torn_files_and_checks_its_output(run_dir, tmp_path, capsys):
    from eval import passkey, report
    assert passkey.main(eval_argv("passkey", run_dir, "--out", str(tmp_path / "run" / "eval"))) == 0
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "broken.json").write_bytes(BINARY)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "tokens": 64}\n{"step": 2, "tok')  # killed mid-line
    out = tmp_path / "report.md"
    assert report.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Passkey retrieval" in text and "| 64 |" in text  # tokens from the last whole metrics row
    assert "skipping" in capsys.readouterr().err
    (tmp_path / "dir.md").mkdir()
    line, _ = one_error_line(run_cli, report.main, [str(tmp_path / "run"), "--out", str(tmp_path / "dir.md")])
    assert "is a directory" in line
    (tmp_path / "file").write_text("x")
    line, _ = one_error_line(run_cli, report.main, [str(tmp_path / "run"), "--out", str(tmp_path / "file" / "r.md")])
    assert f"{tmp_path / 'file'} is a file, not a directory" in line


def test_perplexity_checks_the_comparison_plot_folder_first(run_dir, tmp_path, monkeypatch):
    from eval import perplexity
    monkeypatch.setattr(perplexity, "window_nll", lambda *a, **k: pytest.fail("computed before checking --compare"))
    (tmp_path / "plots").write_text("a file")
    argv = eval_argv("perplexity", run_dir, "--compare", str(tmp_path / "plots" / "cmp.png"))
    line, _ = one_error_line(run_cli, perplexity.main, argv[:1] + argv)  # the run twice: a comparison
    assert line.endswith(f"{tmp_path / 'plots'} is a file, not a directory (choose another folder with --compare)")


def test_validation_tokens_outside_the_vocabulary(run_dir, tmp_path):
    from eval import perplexity
    data.write_shard(str(tmp_path / "f_val_000000.bin"), np.arange(3000)[::-1] * 20)  # ids from 59,980 down
    line, _ = one_error_line(run_cli, perplexity.main, [run_dir["run"], "--length", "128", "--num_seqs", "1",
                                                        "--data_dir", str(tmp_path), "--no_progress"])
    assert "hold token id 59980, outside the model's vocabulary of 50257" in line


def test_priors_metrics_that_is_not_a_file(run_dir, tmp_path):
    from eval import priors
    line, _ = one_error_line(run_cli, priors.main, [run_dir["run"], "--metrics", str(tmp_path)])
    assert "is not a file" in line


def test_tokenizer_file_that_is_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("BAM_GPT2_TIKTOKEN", str(tmp_path))
    tokenizer.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=f"cannot read the GPT-2 ranks file {tmp_path}"):
            tokenizer.gpt2_encoding()
    finally:
        monkeypatch.delenv("BAM_GPT2_TIKTOKEN")
        tokenizer.gpt2_encoding.cache_clear()


def test_broken_pipe_is_quiet(capsys, monkeypatch):
    def main(argv):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")
    monkeypatch.setattr(os, "dup2", lambda fd, fd2: None)  # keep pytest's stdout
    with pytest.raises(SystemExit) as stop:
        run_cli(main, [])
    assert stop.value.code == 1 and capsys.readouterr().err == ""
