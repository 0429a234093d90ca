"""retrieval.py: synthetic passkey documents, and their mixing into a corpus by prepare_fineweb.py."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from bam.data import EOT, ShardLoader, read_shard, shard_paths
from bam.retrieval import INFO, QUESTION, TASK, RetrievalDocuments, mix, passkey_answer_targets
from bam.tokenizer import load_tokenizer
from prepare_fineweb import main as prepare_main

REAL = ["Python is a programming language that lets you work quickly.",
        "The standard library contains built-in modules written in C.",
        "Each module documents its functions with a short summary line."]


@pytest.mark.parametrize("filler", ["garbage", "text", "mixed"])
def test_documents_hold_one_key_answered_at_the_end(filler):
    enc = load_tokenizer("gpt2")
    docs = RetrievalDocuments(enc, 128, key_digits=5, filler=filler, real_sentences=REAL, seed=3)
    depths = set()
    for _ in range(200):
        text = docs.document()
        key = re.search(r"The pass key is (\d+)\. Remember it\.", text).group(1)
        assert len(key) == 5
        assert text.startswith(TASK) and text.endswith(f"{QUESTION} {key}.")
        assert text.count(INFO.format(key=key)) == 1
        assert 64 - 8 <= len(enc.encode_ordinary(text)) + 1 <= 128
        depths.add(round(text.index("The pass key is") / len(text), 1))
        if filler == "garbage":
            assert not any(s in text for s in REAL)
    assert len(depths) >= 4, "the information line must move through the document"


@pytest.mark.parametrize("filler", ["garbage", "text", "mixed"])
@pytest.mark.parametrize("length", [80, 128, 200])
def test_exact_length_documents(filler, length):
    enc = load_tokenizer("gpt2")
    docs = RetrievalDocuments(enc, length, min_tokens=length, filler=filler, real_sentences=REAL, seed=5)
    for _ in range(100):
        text = docs.document()
        assert len(enc.encode_ordinary(text)) + 1 == length  # + the EOT that opens it in a shard
        key = re.search(r"The pass key is (\d+)\. Remember it\.", text).group(1)
        assert text.startswith(TASK) and text.count(f"{QUESTION} {key}.") == 1


@pytest.mark.parametrize("filler", ["garbage", "text", "mixed"])
def test_the_answer_of_exact_documents_moves_within_the_row(filler):
    """Documents of exactly the context length fill one row each; if the answer always ended the row,
    its distance from the row's start would be a shortcut a RoPE model can learn (docs/repro.md)."""
    enc = load_tokenizer("gpt2")
    docs = RetrievalDocuments(enc, 128, min_tokens=128, filler=filler, real_sentences=REAL, seed=7)
    ends = []
    for _ in range(60):
        row = torch.tensor([[EOT] + enc.encode_ordinary(docs.document())])
        assert row.shape[1] == 128
        answer = passkey_answer_targets(row[:, :-1], row[:, 1:], enc)[0]
        kept = (answer != -1).nonzero().flatten().tolist()
        ends.append(kept[-1])  # the position that predicts the answer's full stop
    assert len(set(ends)) >= 20, sorted(set(ends))
    assert max(ends) - min(ends) >= 20  # from well inside the row to near its end


@pytest.mark.parametrize("digits", [8, 16])
def test_long_keys_still_fit_exact_documents(digits):
    """A random key can take more tokens than the all-zero one the overhead is measured with."""
    enc = load_tokenizer("gpt2")
    docs = RetrievalDocuments(enc, 128, min_tokens=128, key_digits=digits, filler="garbage", seed=1)
    for _ in range(50):
        assert len(enc.encode_ordinary(docs.document())) + 1 == 128


def test_impossible_documents_fail_instead_of_looping():
    enc = load_tokenizer("gpt2")
    overhead = RetrievalDocuments(enc, 200, key_digits=16, filler="garbage").overhead
    # Room for the all-zero key (2 tokens) but not for any random 16-digit key (5 or more).
    docs = RetrievalDocuments(enc, overhead + 1, min_tokens=overhead + 1, key_digits=16, filler="garbage")
    with pytest.raises(ValueError, match="cannot fit a passkey document"):
        docs.document()


def _row(enc, *texts):
    return [t for text in texts for t in [EOT] + enc.encode_ordinary(text)]


def test_answer_targets_keep_only_answers_of_whole_documents():
    enc = load_tokenizer("gpt2")
    doc = f"{TASK} The sky is blue. {INFO.format(key='31415')} The sun is yellow. {QUESTION} 31415."
    tail = enc.encode_ordinary(doc)[-20:]  # the end of a document whose start is in an earlier row
    row = tail + _row(enc, doc) + _row(enc, "Some plain text.")
    row2 = _row(enc, "Plain text only, no question here.") + [EOT] * (len(row) - 9)
    row2 = row2[:len(row)]
    tokens = torch.tensor([row + [EOT], row2 + [EOT]])
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = passkey_answer_targets(x, y, enc)
    kept = out[0][out[0] != -1].tolist()
    # The whole document's key twice (repeated in the information line, then the answer with its
    # full stop); nothing from the document cut off at the row's start, nothing from plain text.
    assert enc.decode(kept) == " 31415 31415."
    assert (out[1] == -1).all()
    # Each kept target is the true next token at that position.
    assert torch.equal(out[out != -1], y[out != -1])


def test_exact_documents_fill_one_row_each(tmp_path, capsys):
    out = tmp_path / "pk"
    prepare_main(["--source", "retrieval", "--max_tokens", "8000", "--shard_size", "800",
                  "--retrieval_length", "80", "--retrieval_min_length", "80", "--workers", "1",
                  "--retrieval_filler", "garbage", "--out_dir", str(out)])
    assert "will not line up" not in capsys.readouterr().err
    loader = ShardLoader(str(out), "train", 4, 80)
    enc = load_tokenizer("gpt2")
    for _ in range(5):  # across shard boundaries too
        x, y, _ = loader.next_batch()
        assert (x[:, 0] == EOT).all() and ((x == EOT).sum(1) == 1).all()
        answers = passkey_answer_targets(x, y, enc)
        assert ((answers != -1).sum(1) >= 3).all()  # every row: the key twice and a full stop
    # A shard size that is not a multiple of the document length: said, not silently wasted.
    prepare_main(["--source", "retrieval", "--max_tokens", "2000", "--shard_size", "1000",
                  "--retrieval_length", "80", "--retrieval_min_length", "80", "--workers", "1",
                  "--retrieval_filler", "garbage", "--out_dir", str(tmp_path / "misaligned")])
    assert "documents will not line up with training rows" in capsys.readouterr().err


def test_same_seed_same_documents():
    enc = load_tokenizer("gpt2")
    a = RetrievalDocuments(enc, 96, filler="mixed", real_sentences=REAL, seed=7)
    b = RetrievalDocuments(enc, 96, filler="mixed", real_sentences=REAL, seed=7)
    assert [a.document() for _ in range(20)] == [b.document() for _ in range(20)]


def test_too_short_documents_are_refused():
    with pytest.raises(ValueError, match="no room for filler"):
        RetrievalDocuments(load_tokenizer("gpt2"), 40, filler="garbage")
    with pytest.raises(ValueError, match="allowed: garbage, text, mixed"):
        RetrievalDocuments(load_tokenizer("gpt2"), 128, filler="lorem")


def test_mix_reaches_the_requested_fraction():
    real = ["x" * 400] * 100
    synthetic = iter(["y" * 100] * 10_000)
    out = list(mix(real, synthetic, 0.25, len))
    synth = sum(len(d) for d in out if d[0] == "y")
    assert synth / sum(len(d) for d in out) == pytest.approx(0.25, abs=0.01)
    assert [d for d in out if d[0] == "x"] == real  # the corpus itself is unchanged and in order


def test_prepare_writes_a_passkey_corpus(tmp_path):
    out = tmp_path / "pk"
    prepare_main(["--source", "retrieval", "--max_tokens", "20000", "--shard_size", "5000",
                  "--retrieval_length", "100", "--retrieval_filler", "garbage", "--workers", "1",
                  "--out_dir", str(out)])
    tokens = np.concatenate([read_shard(p) for p in shard_paths(str(out), "val") + shard_paths(str(out), "train")])
    assert len(tokens) == 20000
    enc = load_tokenizer("gpt2")
    docs = enc.decode(tokens.tolist()).split("<|endoftext|>")[1:-1]
    assert docs and all(d.startswith(TASK) for d in docs)
    assert int(np.sum(tokens == EOT)) == len(docs) + 1


def test_prepare_rejects_bad_retrieval_options(tmp_path, capsys):
    def error_of(args):
        with pytest.raises(SystemExit) as exit_info:
            prepare_main(args)
        assert exit_info.value.code != 0
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("error: ")
        return lines[-1]

    assert "give --max_tokens" in error_of(["--source", "retrieval", "--out_dir", str(tmp_path / "a")])
    assert "--retrieval_fraction: '1.5' is not allowed: a finite number >= 0, <= 1" in error_of(
        ["--source", "demo", "--retrieval_fraction", "1.5", "--out_dir", str(tmp_path / "b")])
    assert "--retrieval_min_length must be in" in error_of(["--source", "retrieval", "--max_tokens", "100",
                                                            "--retrieval_min_length", "200",
                                                            "--out_dir", str(tmp_path / "c")])
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.slow
def test_training_does_not_import_the_evaluators():
    # bam/retrieval.py holds the passkey wording so that train.py (which imports it) never pulls in eval/
    # and matplotlib; a fresh interpreter, since this test session has imported eval already.
    check = ("import sys, train; loaded = [m for m in sys.modules if m == 'eval' or m.startswith('eval.') "
             "or m.startswith('matplotlib')]; assert not loaded, loaded")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
