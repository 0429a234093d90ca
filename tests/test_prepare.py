"""prepare_fineweb.py: local corpora through `datasets` into shards, resume, bad input, demo corpus, and its
worker processes ending however a run stops."""

import contextlib
import glob
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import prepare_fineweb
from bam.data import EOT, ShardLoader, read_shard
from bam.tokenizer import load_tokenizer
from planted import checkout_like
from planted import snapshot as planted_snapshot
from prepare_fineweb import main

pytestmark = pytest.mark.slow  # prepare_fineweb.py end to end, its workers and its command line

# Real sentences of varied length and script; one is empty, which the corpus drops.
SENTENCES = [
    "The Bayesian Attention Mechanism treats positional encoding as a prior over key positions.",
    "Long-context extrapolation asks whether a model trained on 512 tokens can read 8,192.",
    "Naïve café owners in Zürich serve crème brûlée; 東京 is Tokyo; emoji 🙂 are tokens too.",
    "",
    "Shards hold uint16 tokens after a 256-integer header, exactly as llm.c writes them.",
]
DOCS = [" ".join(SENTENCES[j % len(SENTENCES)] for j in range(i % 7 + 1)) * (1 + i % 3) for i in range(60)]
DOCS[5] = ""


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    """`datasets` leaves a lock file per corpus in its cache even when streaming; keep them in tmp."""
    import datasets.config
    cache = str(tmp_path / "hf_datasets_cache")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", cache)  # for the CLI run in a subprocess


def expected_stream(docs):
    enc = load_tokenizer("gpt2")
    return np.array([t for d in docs if d.strip() for t in [EOT] + enc.encode_ordinary(d)], dtype=np.uint16)


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}) + "\n")
    return str(path)


def write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs, "url": [f"https://example.org/{i}" for i in range(len(docs))]}),
                   str(path), row_group_size=7)
    return str(path)


def shard_files(out_dir):
    """Shard paths in stream order: the val shard (index 0), then the train shards."""
    return sorted(glob.glob(os.path.join(out_dir, "*.bin")), key=lambda f: f.rsplit("_", 1)[-1])


def read_all(out_dir, prefix="local"):
    """The token stream of a prepared directory: val shard first, then the train shards."""
    files = [os.path.basename(f) for f in shard_files(out_dir)]
    assert files[0] == f"{prefix}_val_000000.bin"
    assert files[1:] == [f"{prefix}_train_{i:06d}.bin" for i in range(1, len(files))]
    return np.concatenate([read_shard(os.path.join(out_dir, f)) for f in files])


def snapshot(out_dir):
    """Every file of a directory with its mtime and bytes, to prove nothing was touched."""
    files = sorted(glob.glob(os.path.join(out_dir, "*")))
    return {f: (os.path.getmtime(f), open(f, "rb").read()) for f in files}


def run_error(argv):
    """main(argv) must exit non-zero with one line on stderr starting with 'error:' (after the progress
    bar, when it had started)."""
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(stderr):
        main(argv)
    lines = stderr.getvalue().splitlines()
    message = lines[-1] if lines else ""
    assert e.value.code != 0 and message.startswith("error: "), stderr.getvalue()
    assert [line for line in lines if line.startswith("error")] == [message], stderr.getvalue()
    return message


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_tokens_are_tiktokens_encoding_with_eots_between_documents(tmp_path, workers):
    out = tmp_path / "out"
    main(["--source", "local", "--input", write_jsonl(tmp_path / "c.jsonl", DOCS), "--out_dir", str(out),
          "--shard_size", "500", "--workers", str(workers)])
    expected = expected_stream(DOCS)
    assert np.array_equal(read_all(out), expected)
    sizes = [len(read_shard(f)) for f in shard_files(out)]
    assert all(s == 500 for s in sizes[:-1]) and 0 < sizes[-1] <= 500 and len(sizes) >= 3
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["tokenizer"]["name"] == "gpt2" and manifest["tokenizer"]["vocab_size"] == 50257
    assert manifest["finished"] and manifest["tokens"] == len(expected)
    assert manifest["documents"] == sum(1 for d in DOCS if d.strip())
    assert [s["name"] for s in manifest["shards"]] == [os.path.basename(f) for f in shard_files(out)]
    assert [s["tokens"] for s in manifest["shards"]] == sizes
    assert manifest["source"]["files"][0][0] == str(tmp_path / "c.jsonl")
    assert not glob.glob(str(out / "*tmp*"))


def test_parquet_jsonl_and_txt_go_through_datasets_alike(tmp_path):
    main(["--source", "local", "--input", write_parquet(tmp_path / "c.parquet", DOCS), "--out_dir",
          str(tmp_path / "pq"), "--shard_size", "700", "--workers", "1"])
    assert np.array_equal(read_all(tmp_path / "pq"), expected_stream(DOCS))
    # txt: one document per file; globs expand in sorted order; two jsonl parts read as one corpus.
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS[:12]):
        (tmp_path / "txt" / f"doc{i:02d}.txt").write_text(d + "\n", encoding="utf-8")
    write_jsonl(tmp_path / "part1.jsonl", DOCS[:30])
    write_jsonl(tmp_path / "part2.jsonl", DOCS[30:])
    main(["--source", "local", "--input", str(tmp_path / "txt" / "*.txt"), str(tmp_path / "part*.jsonl"),
          "--out_dir", str(tmp_path / "mixed"), "--shard_size", "700", "--workers", "2"])
    # Grouped by type: json records first, then the txt files.
    assert np.array_equal(read_all(tmp_path / "mixed"),
                          expected_stream(DOCS + [d + "\n" for d in DOCS[:12]]))


def test_max_tokens_stops_early_and_a_rerun_extends(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    args = ["--source", "local", "--input", corpus, "--shard_size", "300", "--workers", "2"]
    main(args + ["--out_dir", str(tmp_path / "part"), "--max_tokens", "1000"])
    assert [len(read_shard(f)) for f in shard_files(tmp_path / "part")] == [300, 300, 300, 100]
    assert np.array_equal(read_all(tmp_path / "part"), expected_stream(DOCS)[:1000])
    before = snapshot(tmp_path / "part")
    main(args + ["--out_dir", str(tmp_path / "part"), "--max_tokens", "1000"])  # nothing left to do
    assert snapshot(tmp_path / "part") == before
    main(args + ["--out_dir", str(tmp_path / "part")])  # no limit now: the short shard is completed
    main(args + ["--out_dir", str(tmp_path / "full")])
    assert [open(f, "rb").read() for f in shard_files(tmp_path / "part")] == \
           [open(f, "rb").read() for f in shard_files(tmp_path / "full")]


def test_resume_after_an_interruption_gives_the_same_shards(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    args = ["--source", "local", "--input", corpus, "--shard_size", "400", "--workers", "1"]
    main(args + ["--out_dir", str(tmp_path / "clean")])

    real_write_shard = prepare_fineweb.write_shard
    written = []

    def crash_on_fourth_shard(path, tokens, *version):
        if len(written) == 3:
            # Killed mid-write: a partial temp file is all that reaches the disk.
            with open(f"{path}.tmp-99999", "wb") as f:
                f.write(b"\x00" * 100)
            raise KeyboardInterrupt
        written.append(path)
        real_write_shard(path, tokens, *version)

    monkeypatch.setattr(prepare_fineweb, "write_shard", crash_on_fourth_shard)
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(stderr):
        main(args + ["--out_dir", str(tmp_path / "resumed")])
    assert stop.value.code == 130
    assert stderr.getvalue().strip().endswith(prepare_fineweb.INTERRUPTED)
    assert len(shard_files(tmp_path / "resumed")) == 3
    monkeypatch.setattr(prepare_fineweb, "write_shard", real_write_shard)

    tokenized_docs = []
    real_tokenize = prepare_fineweb.tokenize
    monkeypatch.setattr(prepare_fineweb, "tokenize",
                        lambda text: tokenized_docs.append(text) or real_tokenize(text))
    main(args + ["--out_dir", str(tmp_path / "resumed")])
    clean, resumed = shard_files(tmp_path / "clean"), shard_files(tmp_path / "resumed")
    assert [os.path.basename(f) for f in clean] == [os.path.basename(f) for f in resumed]
    assert [open(f, "rb").read() for f in clean] == [open(f, "rb").read() for f in resumed]
    assert json.load(open(tmp_path / "clean" / "manifest.json")) == \
           json.load(open(tmp_path / "resumed" / "manifest.json"))
    assert not glob.glob(str(tmp_path / "resumed" / "*tmp*"))
    # The documents of the three finished shards were skipped, not tokenised again.
    assert 0 < len(tokenized_docs) < len(DOCS) - 10


def test_resume_after_kill_9_gives_the_same_shards(tmp_path):
    # A real, abrupt kill of the CLI in the middle of a run (no cleanup code gets to run).
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS * 150)  # ~1.2M tokens
    args = ["--source", "local", "--input", corpus, "--shard_size", "10000", "--workers", "2"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), *args, "--out_dir",
                             str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        manifest = killed / "manifest.json"
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 5:
            proc.kill()
            break
        time.sleep(0.01)
    proc.wait(timeout=120)
    assert proc.returncode == -9, "the run finished before it could be killed; make the corpus larger"
    main(args + ["--out_dir", str(killed)])
    main(args + ["--out_dir", str(tmp_path / "clean")])
    clean, resumed = shard_files(tmp_path / "clean"), shard_files(killed)
    assert [os.path.basename(f) for f in clean] == [os.path.basename(f) for f in resumed]
    assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(clean, resumed))
    assert not glob.glob(str(killed / "*tmp*"))


def test_hub_source_streams_the_named_sample(monkeypatch, tmp_path):
    import datasets
    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: calls.append((a, k)) or iter([{"text": "a"}, {"text": "b"}]))
    main(["--source", "fineweb-edu", "--sample", "sample-100BT", "--out_dir", str(tmp_path / "edu"), "--workers", "1"])
    assert calls == [(("HuggingFaceFW/fineweb-edu",),
                      {"name": "sample-100BT", "split": "train", "streaming": True})]
    assert read_shard(glob.glob(str(tmp_path / "edu" / "fineweb_val_*.bin"))[0]).tolist() == \
        expected_stream(["a", "b"]).tolist()


def test_any_hub_dataset_streams_through_the_same_call(tmp_path):
    """--source hub with a local folder as the dataset: `datasets.load_dataset(folder, split=...)` is the very
    call that streams wikimedia/wikipedia from the Hub; the split and the text field are the user's."""
    folder = tmp_path / "wiki"
    folder.mkdir()
    for split, docs in (("train", DOCS[:30]), ("test", DOCS[30:])):
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"title": str(i), "body": d}) + "\n" for i, d in enumerate(docs))
    out = tmp_path / "out"
    main(["--source", "hub", "--dataset", str(folder), "--split", "test", "--text_field", "body", "--out_dir",
          str(out), "--shard_size", "2000", "--workers", "1"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == {"kind": "hub", "dataset": str(folder), "config": None, "split": "test",
                                  "text_field": "body"}
    stream = np.concatenate([read_shard(f) for f in shard_files(out)])
    assert stream.tolist() == expected_stream(DOCS[30:]).tolist()
    assert os.path.basename(shard_files(out)[0]) == "wiki_val_000000.bin"

    assert "no 'text' field (fields: title, body); choose one with --text_field" in run_error(
        ["--source", "hub", "--dataset", str(folder), "--out_dir", str(tmp_path / "o2"), "--workers", "1"])
    assert "validation" in run_error(["--source", "hub", "--dataset", str(folder), "--split", "validation",
                                      "--out_dir", str(tmp_path / "o3"), "--workers", "1"])
    assert "needs --dataset" in run_error(["--source", "hub", "--out_dir", str(tmp_path / "o4")])
    assert "only to --source hub" in run_error(["--source", "demo", "--text_field", "x", "--out_dir",
                                                str(tmp_path / "o5")])
    assert not any(os.path.exists(tmp_path / o) for o in ("o3", "o4", "o5"))


def test_an_out_dir_that_holds_an_input_or_lies_in_the_dataset_folder_is_refused(tmp_path):
    """Shards written in among the corpus would be read back as corpus by a later glob over that folder (or
    refused as an unsupported file); the user's folder of text would fill with the command's files. One line,
    nothing written."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    source = write_jsonl(corpus / "c.jsonl", DOCS)
    for argv, words in (
            (["--source", "local", "--input", source, "--out_dir", str(corpus)],
             f"--out_dir {corpus} contains --input file {source}"),
            (["--source", "local", "--input", str(corpus / "*.jsonl"), "--out_dir", str(tmp_path)],
             f"--out_dir {tmp_path} contains --input file {source}"),
            (["--source", "hub", "--dataset", str(corpus), "--out_dir", str(corpus / "shards")],
             f"--out_dir {corpus}/shards lies inside --dataset {corpus}")):
        before = sorted(os.listdir(tmp_path)), sorted(os.listdir(corpus))
        message = run_error([*argv, "--workers", "1"])
        assert words in message and "lie apart" in message, message
        assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(corpus))) == before


def test_hub_errors_are_one_line_and_out_dir_is_checked_first(tmp_path, monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    assert "offline, use --source demo or --source local" in run_error(
        ["--source", "fineweb", "--out_dir", str(tmp_path / "fw")])
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"tokenizer": "llama3", "shards": [], "tokens": 0, "finished": False,
                                                   "exhausted": False}))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("network before checks"))
    assert "'llama3' tokenizer" in run_error(["--source", "fineweb", "--out_dir", str(out)])


# ---------------------------------------------------------------------------------------------
# Bad input: one clear line, non-zero exit, nothing written or touched.

def test_bad_arguments(tmp_path):
    out = str(tmp_path / "out")
    assert "sample-10BT, sample-100BT, sample-350BT" in run_error(
        ["--source", "fineweb", "--sample", "sample-1T", "--out_dir", out])
    assert "matches no files" in run_error(
        ["--source", "local", "--input", str(tmp_path / "nothing*.jsonl"), "--out_dir", out])
    assert "--input is required" in run_error(["--source", "local", "--out_dir", out])
    assert "--input is required" in run_error(["--source", "fineweb", "--input", "x", "--out_dir", out])
    assert "invalid choice" in run_error(["--source", "c4", "--out_dir", out])
    assert "--shard_size: '0' is not allowed: an integer >= 1" in run_error(["--source", "demo", "--shard_size", "0",
                                                                               "--out_dir", out])
    (tmp_path / "a.csv").write_text("text\nhello\n")
    assert "unsupported file type '.csv'" in run_error(
        ["--source", "local", "--input", str(tmp_path / "a.csv"), "--out_dir", out])
    assert not os.path.exists(out)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", ["", "  \n", ""])
    for name in ("empty.jsonl", "blank.jsonl"):
        out = tmp_path / f"out_{name}"
        assert "empty" in run_error(["--source", "local", "--input", str(tmp_path / name), "--out_dir",
                                     str(out), "--workers", "1"])
        assert not shard_files(out) and not os.path.exists(out / "manifest.json")


@pytest.mark.parametrize("workers", [1, 2])
def test_records_without_text(tmp_path, workers):
    (tmp_path / "c.jsonl").write_text('{"content": "hello there"}\n')
    assert "no 'text' field (fields: content)" in run_error(
        ["--source", "local", "--input", str(tmp_path / "c.jsonl"), "--out_dir", str(tmp_path / "o"),
         "--workers", str(workers)])


def test_out_dir_of_another_tokenizer_or_setting_is_left_untouched(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    args = ["--source", "local", "--input", corpus, "--out_dir", str(out), "--workers", "1"]
    main(args + ["--shard_size", "500", "--max_tokens", "1200"])
    manifest = json.load(open(out / "manifest.json"))
    manifest["tokenizer"] = "cl100k_base"
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    assert "'cl100k_base' tokenizer" in run_error(args + ["--shard_size", "500"])
    assert snapshot(out) == before
    manifest["tokenizer"] = "gpt2"
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    assert "shard_size 500, not 400" in run_error(args + ["--shard_size", "400"])
    assert "prefix 'local', not 'other'" in run_error(args + ["--shard_size", "500", "--prefix", "other"])
    assert "more than --max_tokens 1000" in run_error(args + ["--shard_size", "500", "--max_tokens", "1000"])
    other = write_jsonl(tmp_path / "d.jsonl", DOCS[:10])
    assert "source" in run_error(["--source", "local", "--input", other, "--out_dir", str(out),
                                  "--shard_size", "500"])
    assert snapshot(out) == before


def test_foreign_shards_without_manifest_are_left_untouched(tmp_path):
    out = tmp_path / "llmc"
    out.mkdir()
    (out / "fineweb_val_000000.bin").write_bytes(b"downloaded from elsewhere")
    before = snapshot(out)
    assert "without a manifest.json" in run_error(
        ["--source", "local", "--input", write_jsonl(tmp_path / "c.jsonl", DOCS), "--out_dir", str(out)])
    assert snapshot(out) == before


def test_a_checkout_as_out_dir_gets_shards_beside_its_files_and_a_foreign_manifest_is_refused(tmp_path):
    """prepare_fineweb.py replaces no folder: in a folder of the user's (a checkout with notes) it adds its shards,
    manifest and lock and changes nothing that was there; a manifest.json it did not write (a web app's) is refused
    in one line, not extended."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "checkout"
    before = checkout_like(out)
    main(["--source", "local", "--input", corpus, "--out_dir", str(out), "--workers", "1", "--shard_size", "2000"])
    after = planted_snapshot(out)
    assert {name: after[name] for name in before} == before
    shards = [os.path.basename(f) for f in shard_files(out)]
    assert len(shards) > 1 and sorted(set(after) - set(before)) == sorted([".lock", "manifest.json"] + shards)
    other = tmp_path / "webapp"
    checkout_like(other)
    (other / "manifest.json").write_text(json.dumps({"name": "my app", "start_url": "/"}))
    before = planted_snapshot(other)
    message = run_error(["--source", "local", "--input", corpus, "--out_dir", str(other)])
    assert "manifest.json is not a manifest this script wrote (it has no shards, tokens, finished, exhausted)" \
        in message, message
    assert planted_snapshot(other) == before


def test_cli_prints_one_line_not_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "prepare_fineweb.py"), "--source",
                           "fineweb-edu", "--sample", "sample-1BT", "--out_dir", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "unknown FineWeb sample 'sample-1BT'" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The offline demo corpus

def test_demo_corpus_is_real_english_and_prepares_end_to_end(tmp_path):
    out = tmp_path / "demo"
    main(["--source", "demo", "--out_dir", str(out), "--max_tokens", "120000", "--workers", "2"])
    docs = [json.loads(line)["text"] for line in open(out / "demo_corpus.jsonl", encoding="utf-8")]
    text = "\n".join(docs)
    words = text.lower().split()
    assert len(docs) > 300 and len(text) > 2_000_000
    # English prose: the commonest English words are a large share of the text; gibberish or code
    # alone would not pass.
    common = {"the", "of", "and", "to", "a", "is", "in", "that", "for", "be", "it", "this", "if", "an"}
    assert sum(w in common for w in words) / len(words) > 0.15
    assert "The \"assert\" statement" in text  # the language reference topics are in
    assert [len(read_shard(f)) for f in shard_files(out)] == [50_000, 50_000, 20_000]
    assert np.array_equal(read_all(out, "demo"), expected_stream(docs)[:120_000])
    x, y, doc_ids = ShardLoader(str(out), "train", 4, 256).next_batch()
    assert x.shape == (4, 256) and int(doc_ids.max()) >= 0


# ---------------------------------------------------------------------------------------------
# Worker processes end however a run stops (issue 26: multiprocessing.Pool could hang for ever after
# --max_tokens was reached). Each case runs in a subprocess with its own timeout, so a hang fails one
# test, not the whole run. Documents of ~35k characters make every chunk's results (~130 KB of tokens)
# larger than a pipe buffer (64 KiB), which is what the hang needed.

BIG_DOCS = [" ".join(DOCS[i:] + DOCS[:i]) for i in range(60)]
SUBPROCESS_TIMEOUT = 120

PARALLEL_MAP_CASES = """
import contextlib, json, multiprocessing, sys
import numpy as np
import prepare_fineweb as p
from bam.data import read_shard
from bam.tokenizer import EOT, load_tokenizer

docs = json.load(open(sys.argv[1]))
out = sys.argv[2]
p.CHUNK_CHARS = 100_000  # 3 documents a chunk, 8 chunks in flight on 2 workers: more than they can take
enc = load_tokenizer("gpt2")
reference = np.array([t for d in docs for t in [EOT] + enc.encode_ordinary(d)], dtype=np.uint16)

def no_workers_left(case):
    assert not multiprocessing.active_children(), (case, multiprocessing.active_children())

# Stopped early by --max_tokens, many times in a row, at varied points: inside the first chunk, at a
# shard boundary, several chunks in.
for i, max_tokens in enumerate([1, 20_000, 33_333, 8_000, 50_001, 40_000, 2_500, 61_234] * 3):
    manifest = p.prepare(docs, f"{out}/{i}", source={"kind": "stress"}, prefix="s", shard_size=20_000,
                         max_tokens=max_tokens, workers=2, progress=False)
    no_workers_left(f"stopped at {max_tokens}")
    tokens = np.concatenate([read_shard(f"{out}/{i}/{s['name']}") for s in manifest["shards"]])
    assert np.array_equal(tokens, reference[:max_tokens]), max_tokens

# Run to the end, in order.
assert [len(t) for t in p.tokenized(iter(docs), 2)] == [len(enc.encode_ordinary(d)) + 1 for d in docs]
no_workers_left("exhausted")

# The consumer raises.
with contextlib.suppress(RuntimeError), contextlib.closing(p.tokenized(iter(docs), 2)) as stream:
    next(stream)
    raise RuntimeError("the consumer failed")
no_workers_left("consumer raised")

# fn raises in a worker: a WorkerError naming it, after the items before its chunk.
seen = []
try:
    for value in p.parallel_map(p.tokenize, ["a"] * 9 + [5] + ["b"] * 30, 2, chunk_size=4):
        seen.append(value)
except p.WorkerError as e:
    assert str(e) == "tokenize() failed in a worker process: AttributeError: 'int' object has no attribute " \
                     "'isspace'", str(e)
else:
    raise AssertionError("no WorkerError")
assert len(seen) == 8, seen
no_workers_left("fn raised")
print("ok")
"""


def run_python(script, *args, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)


def test_parallel_map_ends_its_workers_however_it_stops(tmp_path):
    (tmp_path / "docs.json").write_text(json.dumps(BIG_DOCS[:20]))
    proc = run_python(f"import sys; sys.path.insert(0, {ROOT!r})\n" + PARALLEL_MAP_CASES,
                      str(tmp_path / "docs.json"), str(tmp_path / "out"))
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-3000:]


LEFTOVER_CASE = """
import gc, os, sys
import prepare_fineweb as p

class Leftover:  # garbage the caller left, as a DDP model in a reference cycle holds its process group
    def __del__(self):
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")

def collect(item):  # what a worker's allocations do sooner or later
    gc.collect()
    return item

gc.disable()  # the leftover stays garbage until the workers have started and collected
leftover = Leftover()
leftover.cycle = leftover
del leftover
assert list(p.parallel_map(collect, list(range(8)), 2, chunk_size=1)) == list(range(8))
gc.collect()
print(open(sys.argv[1]).read().split() == [str(os.getpid())])
"""


def test_workers_leave_the_garbage_they_inherit_to_the_main_process(tmp_path):
    """A worker is a fork of the main process; garbage collected there would be finalized there: a gloo process
    group left in a reference cycle by an earlier test hung a worker for ever in its destructor (pytest-xdist,
    torch 2.15), waiting for threads only the main process has."""
    proc = run_python(f"import sys; sys.path.insert(0, {ROOT!r})\n" + LEFTOVER_CASE, str(tmp_path / "finalized"))
    assert proc.returncode == 0 and proc.stdout == "True\n", proc.stdout + proc.stderr[-3000:]


def worker_pids(pid):
    """The child processes of `pid` (its workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def gone(pid):
    """Not running: exited and reaped, or at least exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


needs_proc = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                                reason="finds the worker processes through Linux's /proc")


# The CLI whose workers stop working (for ever) after their first 10 documents each: the run is still
# going when a test kills or signals it, however fast the machine tokenizes the rest (with the real tokenizer a
# loaded machine could let the run finish between the test's seeing two shards and its signal), and the main
# process waits on a worker that will not answer. The first 2 x 10 documents are ~160,000 tokens, 8 shards.
HELD_TOKENIZER = f"""
import signal, sys, threading, time
sys.path.insert(0, {ROOT!r})
import prepare_fineweb

# Ctrl-C as at a shell prompt: a suite started in the background of a script (`nohup bash scripts/test.sh &`)
# ignores SIGINT, and so would every process it starts.
signal.signal(signal.SIGINT, signal.default_int_handler)
# A signal sent to the process goes to one of its threads, the kernel's choice, and a read the main thread is
# blocked in is interrupted only if it is that one (tqdm's monitor and torch's threads are candidates): here
# always another, as the main thread blocks the signals and a thread that does nothing takes them.
threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT, signal.SIGTERM}})

real_tokenize = prepare_fineweb.tokenize
done = 0

def tokenize(text):
    global done
    done += 1
    while done > 10:  # each forked worker counts its own
        time.sleep(1)
    return real_tokenize(text)

prepare_fineweb.tokenize = tokenize  # the workers are forked after this: they run it too
prepare_fineweb.main(sys.argv[1:])
"""


def start_and_wait_for_shards(argv, out, stderr, shards=2, **popen):
    """The CLI started in a subprocess (its stderr to the file `stderr`), its workers held after their first
    documents (HELD_TOKENIZER), once it has finished `shards` shards and waits for more."""
    with open(stderr, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", HELD_TOKENIZER, *argv], cwd=out.parent,
                                stdout=subprocess.DEVNULL, stderr=f, **popen)
    deadline = time.time() + SUBPROCESS_TIMEOUT
    seen, since = None, time.time()
    while proc.poll() is None and time.time() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not there yet
            manifest = (out / "manifest.json").read_text()
            if manifest != seen:
                seen, since = manifest, time.time()
            # the main process has written all its held workers gave it (no new shard for a second): it is
            # waiting on a worker, where a signal must still reach it
            elif len(json.loads(manifest)["shards"]) >= shards and time.time() - since > 1:
                return proc
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    pytest.fail(f"no {shards} shards before the run ended: {open(stderr).read()[-3000:]}")


def wait_or_kill(proc):
    """Wait for the CLI to end; if it hangs, kill it (its workers then exit too) and fail."""
    try:
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the run did not end within {SUBPROCESS_TIMEOUT} s")


def assert_finished_shards_intact_and_a_rerun_completes(argv, out, docs):
    assert len(docs) % len(BIG_DOCS) == 0 and docs[:len(BIG_DOCS)] == BIG_DOCS
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["finished"] and len(manifest["shards"]) >= 2
    assert [len(read_shard(out / s["name"])) for s in manifest["shards"]] == [s["tokens"] for s in manifest["shards"]]
    main(argv)
    assert np.array_equal(read_all(out), np.tile(expected_stream(BIG_DOCS), len(docs) // len(BIG_DOCS)))
    assert json.loads((out / "manifest.json").read_text())["finished"]
    assert not glob.glob(str(out / "*tmp*"))


@needs_proc
def test_a_worker_killed_mid_run_is_one_error_line_and_a_rerun_resumes(tmp_path):
    docs = BIG_DOCS * 2  # ~1M tokens in 50 shards
    out = tmp_path / "out"
    argv = ["--source", "local", "--input", write_jsonl(tmp_path / "c.jsonl", docs), "--shard_size", "20000",
            "--workers", "2", "--out_dir", str(out)]
    proc = start_and_wait_for_shards(argv, out, tmp_path / "stderr")
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # as the out-of-memory killer would
    wait_or_kill(proc)
    stderr = (tmp_path / "stderr").read_text()
    lines = stderr.splitlines()
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1] == "error: a worker process died (killed by SIGKILL, as the out-of-memory killer does when " \
                        f"memory runs out); {prepare_fineweb.KEPT}", stderr[-3000:]
    assert [line for line in lines if "error" in line] == [lines[-1]]
    assert gone(workers[0])
    assert_finished_shards_intact_and_a_rerun_completes(argv, out, docs)


POISONED_TOKENIZER = """
import sys
import prepare_fineweb

real_tokenize = prepare_fineweb.tokenize

def tokenize(text):
    if "POISON" in text:
        raise ValueError("a poisoned document\\nwith a second line")
    return real_tokenize(text)

prepare_fineweb.tokenize = tokenize  # the workers are forked after this: they run it too
prepare_fineweb.main(sys.argv[1:])
"""


def test_an_exception_in_a_worker_is_one_error_line(tmp_path):
    docs = BIG_DOCS[:12] + ["POISON"] + BIG_DOCS[12:24]
    out = tmp_path / "out"
    argv = ["--source", "local", "--input", write_jsonl(tmp_path / "c.jsonl", docs), "--shard_size", "20000",
            "--workers", "2", "--out_dir", str(out)]
    proc = run_python(POISONED_TOKENIZER, *argv)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1] == "error: tokenize() failed in a worker process: ValueError: a poisoned document; " \
                        f"{prepare_fineweb.KEPT}", proc.stderr[-3000:]
    assert [line for line in lines if "error" in line] == [lines[-1]]
    # The shards of the documents before the poisoned one's chunk were finished and kept.
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3 and not manifest["finished"]
    assert np.array_equal(read_all(out), expected_stream(docs[:12])[:manifest["tokens"]])


@needs_proc
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_at_once_and_a_rerun_resumes(tmp_path, signum, code):
    docs = BIG_DOCS * 2
    out = tmp_path / "out"
    argv = ["--source", "local", "--input", write_jsonl(tmp_path / "c.jsonl", docs), "--shard_size", "20000",
            "--workers", "2", "--out_dir", str(out)]
    # Its own process group, signalled as a whole, as a terminal's Ctrl-C or a job scheduler does.
    proc = start_and_wait_for_shards(argv, out, tmp_path / "stderr", start_new_session=True)
    workers = worker_pids(proc.pid)
    os.killpg(proc.pid, signum)
    wait_or_kill(proc)
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == code and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.splitlines()[-1] == prepare_fineweb.INTERRUPTED
    assert len(workers) == 2 and all(gone(pid) for pid in workers)
    assert_finished_shards_intact_and_a_rerun_completes(argv, out, docs)
