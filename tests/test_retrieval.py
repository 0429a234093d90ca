"""retrieval.py: synthetic passkey documents, and their mixing into a corpus by prepare_fineweb.py."""

import re

import numpy as np
import pytest

from data import EOT, get_tokenizer, read_shard, shard_paths
from eval.passkey import INFO, QUESTION, TASK
from prepare_fineweb import main as prepare_main
from retrieval import RetrievalDocuments, mix

REAL = ["Python is a programming language that lets you work quickly.",
        "The standard library contains built-in modules written in C.",
        "Each module documents its functions with a short summary line."]


@pytest.mark.parametrize("filler", ["garbage", "text", "mixed"])
def test_documents_hold_one_key_answered_at_the_end(filler):
    enc = get_tokenizer()
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


def test_same_seed_same_documents():
    enc = get_tokenizer()
    a = RetrievalDocuments(enc, 96, filler="mixed", real_sentences=REAL, seed=7)
    b = RetrievalDocuments(enc, 96, filler="mixed", real_sentences=REAL, seed=7)
    assert [a.document() for _ in range(20)] == [b.document() for _ in range(20)]


def test_too_short_documents_are_refused():
    with pytest.raises(ValueError, match="no room for filler"):
        RetrievalDocuments(get_tokenizer(), 40, filler="garbage")
    with pytest.raises(ValueError, match="allowed: garbage, text, mixed"):
        RetrievalDocuments(get_tokenizer(), 128, filler="lorem")


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
    enc = get_tokenizer()
    docs = enc.decode(tokens.tolist()).split("<|endoftext|>")[1:-1]
    assert docs and all(d.startswith(TASK) for d in docs)
    assert int(np.sum(tokens == EOT)) == len(docs) + 1


def test_prepare_rejects_bad_retrieval_options(tmp_path):
    with pytest.raises(SystemExit, match="give --max_tokens"):
        prepare_main(["--source", "retrieval", "--out_dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match=r"must be in \[0, 1\]"):
        prepare_main(["--source", "demo", "--retrieval_fraction", "1.5", "--out_dir", str(tmp_path / "b")])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
