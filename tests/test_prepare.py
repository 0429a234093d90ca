"""prepare_fineweb.py: local corpora through `datasets` into shards, resume, bad input, demo corpus."""

import contextlib
import glob
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import prepare_fineweb  # noqa: E402
from data import EOT, ShardLoader, get_tokenizer, read_shard  # noqa: E402
from prepare_fineweb import main  # noqa: E402

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
    enc = get_tokenizer()
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
    assert manifest["tokenizer"] == "gpt2" and manifest["finished"] and manifest["tokens"] == len(expected)
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

    def crash_on_fourth_shard(path, tokens):
        if len(written) == 3:
            # Killed mid-write: a partial temp file is all that reaches the disk.
            with open(f"{path}.tmp-99999", "wb") as f:
                f.write(b"\x00" * 100)
            raise KeyboardInterrupt
        written.append(path)
        real_write_shard(path, tokens)

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
    proc.wait()
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


def test_hub_errors_are_one_line_and_out_dir_is_checked_first(tmp_path, monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    assert "offline, use --source demo or --source local" in run_error(
        ["--source", "fineweb", "--out_dir", str(tmp_path / "fw")])
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"tokenizer": "llama3"}))
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
    assert "positive" in run_error(["--source", "demo", "--shard_size", "0", "--out_dir", out])
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
