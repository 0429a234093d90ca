"""data.tokenizer: Hugging Face tokenizers next to GPT-2. Both shard widths (llm.c versions 1 and 7), the
separators and document ids of BOS/EOS tokenizers, GPT-2's own tokenizer.json giving tiktoken's ids, shards of
another tokenizer refused, and a run with a locally trained tokenizer from prepare_fineweb.py through training,
resume, every evaluator, sample.py, the export and eval.downstream. The tokenizers are trained here
(tests/local_tokenizers.py): no Hub."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import prepare_fineweb
import train
from bam import data
from bam.checkpoint import check_checkpoint_tokenizer
from bam.cli import UserError
from bam.config import load_config
from bam.tokenizer import GPT2_IDENTITY, TokenizerError, load_run_tokenizer, load_tokenizer
from local_tokenizers import bpe_folder
from small_runs import small_config

pytestmark = pytest.mark.slow  # tokenizers trained here, then runs that train, evaluate and export with them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["The pass key is 48213. Remember it.", "Naïve café in Zürich; 東京 🙂 <|endoftext|> </s> <s> done.",
         "  leading spaces\n\nand paragraphs\tand tabs  ", "x"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A byte-level BPE of 2,002 tokens with BOS (2000) and EOS (2001)."""
    return bpe_folder(str(tmp_path_factory.mktemp("tok") / "small"), vocab_size=2000)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    """A SentencePiece-style BPE (Metaspace "▁" boundaries, prepended to the text), as Llama 2's and Mistral's."""
    return bpe_folder(str(tmp_path_factory.mktemp("tok") / "sp"), vocab_size=2000, sentencepiece_style=True)


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """The same BPE with 66,000 more tokens before BOS and EOS: ids past 65,535, uint32 shards."""
    return bpe_folder(str(tmp_path_factory.mktemp("tok") / "large"), vocab_size=2000, padding_tokens=66_000)


def corpus(path, n=80):
    from local_tokenizers import training_text

    docs = [d for d in training_text(limit=n) if d.strip()]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return str(path), docs


def prepare(out_dir, source, tokenizer, shard_size=4096):
    args = ["--source", "local", "--input", source, "--out_dir", str(out_dir), "--shard_size", str(shard_size),
            "--workers", "1", "--tokenizer", tokenizer]
    prepare_fineweb.main(args)
    return str(out_dir)


# ----------------------------------------------------------------------------------------------
# Shards

def test_both_shard_widths_round_trip_with_llm_c_headers(tmp_path):
    rng = np.random.default_rng(0)
    small_ids, big_ids = rng.integers(0, 2**16, 1000), rng.integers(0, 2**32, 1000, dtype=np.uint64)
    data.write_shard(str(tmp_path / "a_train_000001.bin"), small_ids)
    data.write_shard(str(tmp_path / "b_train_000001.bin"), big_ids, version=7)
    for name, ids, (magic, version, width) in (("a", small_ids, (20240520, 1, 2)), ("b", big_ids, (20240801, 7, 4))):
        path = str(tmp_path / f"{name}_train_000001.bin")
        # The header exactly as llm.c's dev/data/data_common.py writes it: 256 int32, magic, version, count.
        header = np.fromfile(path, dtype="<i4", count=256)
        assert header[:3].tolist() == [magic, version, len(ids)] and not header[3:].any()
        assert os.path.getsize(path) == 1024 + width * len(ids)
        raw = np.fromfile(path, dtype=f"<u{width}", offset=1024)
        assert np.array_equal(raw, ids) and np.array_equal(data.read_shard(path), ids)
        assert data.shard_header(path) == (version, len(ids), np.dtype(f"<u{width}"))
    with pytest.raises(ValueError, match="fit uint16"):
        data.write_shard(str(tmp_path / "c_train_000001.bin"), [70_000])


def test_loader_reads_uint32_shards_and_refuses_a_split_of_two_widths(tmp_path):
    ids = np.arange(100_000, 100_000 + 3000) % (2**17)
    ids[::50] = 99_999  # the document token of a made-up large tokenizer
    data.write_shard(str(tmp_path / "d_val_000000.bin"), ids[:1000], version=7)
    data.write_shard(str(tmp_path / "d_train_000001.bin"), ids[1000:], version=7)
    from bam.tokenizer import TokenizerIdentity
    identity = TokenizerIdentity("made-up", 2**17, "0" * 64, 99_999, None)
    loader = data.ShardLoader(str(tmp_path), "train", 2, 16, tokenizer=identity)
    x, y, doc_ids = loader.next_batch()
    assert np.array_equal(x.flatten().numpy(), ids[1000:1032]) and int(x.max()) > 65_535
    assert torch.equal(doc_ids, torch.cumsum(x == 99_999, dim=-1))
    data.write_shard(str(tmp_path / "d_train_000002.bin"), ids[:100] % 1000)  # version 1 next to version 7
    with pytest.raises(data.ShardError, match="mix llm.c versions 1 .* and 7"):
        data.ShardLoader(str(tmp_path), "train", 2, 16, tokenizer=identity)


# ----------------------------------------------------------------------------------------------
# Tokenizers

def test_gpt2s_own_tokenizer_json_gives_tiktokens_ids_and_shards(tmp_path):
    """GPT-2's tokenizer.json as export_hf.py builds it, loaded as any Hugging Face tokenizer folder: the ids
    are tiktoken's, one EOT opens each document, and the shards equal those of data.tokenizer = "gpt2"."""
    from export_hf import hf_tokenizer

    folder = str(tmp_path / "gpt2_hf")
    hf_tokenizer(load_tokenizer("gpt2").enc).save_pretrained(folder)
    hf, tiktoken_gpt2 = load_tokenizer(folder), load_tokenizer("gpt2")
    assert (hf.n_vocab, hf.doc_open, hf.doc_close) == (50257, data.EOT, None)
    for text in TEXTS:
        assert hf.encode_ordinary(text) == load_tokenizer("gpt2").encode_ordinary(text)
        assert hf.document(text) == tiktoken_gpt2.document(text) == [data.EOT] + hf.encode_ordinary(text)
        assert hf.decode(hf.encode_ordinary(text)) == text
    source, _ = corpus(tmp_path / "docs.jsonl", n=20)
    a, b = prepare(tmp_path / "a", source, folder), prepare(tmp_path / "b", source, "gpt2")
    for name in sorted(os.listdir(b)):
        if name.endswith(".bin"):
            assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read()


def test_bos_eos_documents_and_their_document_ids(small, tmp_path):
    enc = load_tokenizer(small)
    assert (enc.n_vocab, enc.doc_open, enc.doc_close) == (2002, 2000, 2001)
    # Special-token text inside a document is text: only document() adds separators.
    assert 2000 not in enc.encode_ordinary("<s> </s>") and 2001 not in enc.encode_ordinary("<s> </s>")
    source, docs = corpus(tmp_path / "docs.jsonl", n=30)
    out = prepare(tmp_path / "shards", source, small, shard_size=2048)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["tokenizer"] == enc.identity.to_dict() and "version 1" in manifest["format"]
    paths = data.shard_paths(out, "val") + data.shard_paths(out, "train")
    stream = np.concatenate([data.read_shard(p) for p in paths])
    expected = [t for d in docs for t in [2000] + enc.encode_ordinary(d) + [2001]]
    assert stream.tolist() == expected
    loader = data.ShardLoader(out, "train", 4, 64, tokenizer=enc.identity)
    x, _, doc_ids = loader.next_batch()
    for row, ids in zip(x.tolist(), doc_ids.tolist()):  # an independent count: BOS opens, EOS closes
        current, expect = 0, []
        for token in row:
            current += token == 2000
            expect.append(current)
            assert token != 2001 or current == 0 or expect[-1] == current  # EOS stays in its document
        assert ids == expect
        for i, token in enumerate(row):
            if token == 2001 and i + 1 < len(row):
                assert row[i + 1] == 2000 and ids[i + 1] == ids[i] + 1  # the next document opens right after


def test_a_vocabulary_past_65535_makes_uint32_shards(large, tmp_path):
    enc = load_tokenizer(large)
    assert enc.n_vocab == 68_002 and enc.doc_open == 68_000
    source, docs = corpus(tmp_path / "docs.jsonl", n=10)
    out = prepare(tmp_path / "shards", source, large, shard_size=2048)
    paths = data.shard_paths(out, "val") + data.shard_paths(out, "train")
    assert {data.shard_header(p)[0] for p in paths} == {7}
    stream = np.concatenate([data.read_shard(p) for p in paths])
    assert stream.tolist() == [t for d in docs for t in enc.document(d)] and stream.max() == 68_001


@pytest.mark.parametrize("kind", ["gpt2", "byte-level BPE", "sentencepiece-style BPE"])
def test_prompts_are_exactly_the_tokens_of_their_text(kind, small, sentencepiece):
    """Passkey and NIAH prompts, built from token pieces, are the run's tokenizer's encoding of the prompt's text
    (a SentencePiece-style tokenizer would otherwise put a word boundary before every piece), of exactly the
    length asked for; and the passkey training targets are found in documents that tokenizer encoded whole."""
    from bam.retrieval import RetrievalDocuments, passkey_answer_targets
    from eval.niah import NeedlePrompts
    from eval.passkey import PasskeyPrompts

    enc = load_tokenizer({"gpt2": "gpt2", "byte-level BPE": small, "sentencepiece-style BPE": sentencepiece}[kind])
    sample = PasskeyPrompts(enc=enc).build(300, 0.4, 48213)
    assert len(sample.tokens) == 301 and sample.tokens[0] == enc.doc_open
    text = enc.decode(sample.tokens[1:].tolist())
    assert "  " not in text and text.endswith("The pass key is 48213")
    assert enc.encode_ordinary(text) == sample.tokens[1:].tolist()
    (start, end), = sample.spans
    assert sample.tokens[start:end].tolist() == enc.encode_continuation(" 48213")
    needle = NeedlePrompts(enc=enc).build("single_number", "repeat", 400, np.random.default_rng(0))
    assert len(needle.tokens) == 401
    assert enc.encode_ordinary(enc.decode(needle.tokens[1:].tolist())) == needle.tokens[1:].tolist()
    documents = RetrievalDocuments(enc, 128, 128, filler="garbage", seed=1)
    rows = [enc.document(documents.document()) for _ in range(4)]
    assert all(len(r) == 128 for r in rows)
    x = torch.tensor([r[:-1] for r in rows])
    y = torch.tensor([r[1:] for r in rows])
    targets = passkey_answer_targets(x, y, enc)
    assert ((targets != -1).sum(dim=1) >= 3).all()  # the key (at least a token) twice and the full stop, every row


def test_hub_name_that_cannot_be_fetched_is_one_line(tmp_path, capfd):
    source, _ = corpus(tmp_path / "docs.jsonl", n=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "prepare_fineweb.py", "--source", "local", "--input", source, "--out_dir",
                           str(tmp_path / "d"), "--tokenizer", "nobody-here/no-such-tokenizer"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "no cached copy" in done.stderr and "HF_HUB_OFFLINE" in done.stderr and "local folder" in done.stderr
    assert not os.path.exists(tmp_path / "d" / "manifest.json")
    # Without HF_HUB_OFFLINE: the probe finds no Hub here (or, with a network, the Hub has no such name);
    # either way one line, and no retry messages from huggingface_hub before it.
    capfd.readouterr()
    with pytest.raises(TokenizerError) as error:
        load_tokenizer("nobody-here/no-such-tokenizer-2")
    assert "\n" not in str(error.value) and "nobody-here/no-such-tokenizer-2" in str(error.value)
    assert capfd.readouterr().err == ""
    with pytest.raises(TokenizerError, match="no tokenizer folder"):
        load_tokenizer(str(tmp_path / "missing" / "folder"))


# ----------------------------------------------------------------------------------------------
# A run with a locally trained tokenizer, end to end

def test_vocab_size_follows_the_tokenizer_and_must_hold_its_ids(small, tmp_path):
    cfg = load_config(overrides=[f"--data.tokenizer={small}"])
    assert cfg.model.vocab_size == 2002
    assert load_config(overrides=[f"--data.tokenizer={small}", "--model.vocab_size=4096"]).model.vocab_size == 4096
    assert load_config().model.vocab_size == 50257
    with pytest.raises(UserError, match=r"model.vocab_size = 1,000 cannot hold every id of the tokenizer"):
        train.load_checked_config(None, [f"--data.tokenizer={small}", "--model.vocab_size=1000"], 1, True)


def test_a_run_with_a_local_tokenizer_trains_resumes_evaluates_and_exports(small, tmp_path):
    from eval.downstream import evaluate_downstream
    from eval.niah import evaluate_niah
    from eval.options import EvalOptions
    from eval.passkey import PasskeyPrompts, evaluate_passkey
    from eval.perplexity import evaluate_perplexity

    enc = load_tokenizer(small)
    source, _ = corpus(tmp_path / "docs.jsonl", n=60)
    shards = prepare(tmp_path / "shards", source, small, shard_size=4096)
    # checkpoints at steps 2 and 4, so that a resume from step 2 replays two steps
    cfg = [small_config(tmp_path, shards), f"--data.tokenizer={small}", "--train.max_steps=4", "--train.ckpt_every=2",
           "--train.val_every=2"]
    straight, run = str(tmp_path / "straight"), str(tmp_path / "run")
    train.main([*cfg, f"--log.out_dir={straight}"])
    shutil.copytree(straight, run)
    os.remove(os.path.join(run, "checkpoints", "step_00000004.pt"))
    train.main([*cfg, f"--log.out_dir={run}", "--resume"])  # from step 2, as after a crash
    ckpt = torch.load(os.path.join(run, "checkpoints", "step_00000004.pt"), weights_only=False)
    assert ckpt["config"]["data"]["tokenizer"] == small and ckpt["tokenizer"] == enc.identity.to_dict()
    assert ckpt["model_config"]["vocab_size"] == 2002
    straight_weights = torch.load(os.path.join(straight, "checkpoints", "step_00000004.pt"), weights_only=False)["model"]
    assert all(torch.equal(ckpt["model"][k], straight_weights[k]) for k in straight_weights)

    options = EvalOptions(out=str(tmp_path / "eval"), verbose=False, device="cpu")
    passkey = evaluate_passkey(run, options=options, lengths=[128], samples=2)
    prompts = PasskeyPrompts(enc=enc)
    sample = prompts.build(128, 0.5, 48213)
    assert len(sample.tokens) == 129 and sample.tokens[0] == enc.doc_open  # exact length, the run's BOS
    answer = enc.encode_ordinary(" 48213")
    assert sample.tokens[-len(answer):].tolist() == answer  # the key's tokens are this tokenizer's
    assert passkey["results"][0]["length"] == 128
    niah = evaluate_niah(run, options=options, lengths=[256], samples=1, tasks=["single_number"])
    assert niah["results"]
    ppl = evaluate_perplexity(run, options=options, length=128, num_seqs=2)
    assert ppl["windows"] or ppl["results"]
    with open(os.path.join(options.out, "perplexity.json")) as f:
        assert json.load(f)["model"]["tokenizer"] == small

    done = subprocess.run([sys.executable, "sample.py", run, "--prompt", "The", "--max_new_tokens", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("The"), done.stderr[-2000:]

    from transformers import AutoTokenizer

    import export_hf
    hf_dir = str(tmp_path / "hf")
    export_hf.export(run, hf_dir)
    exported = AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS[:1] + TEXTS[2:]:
        assert exported(text, add_special_tokens=False)["input_ids"] == enc.encode_ordinary(text)
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (2000, 2001)

    task = tmp_path / "tasks"
    task.mkdir()
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"q": f"Question {i}: where?", "choices": ["here", "there"],
                                                             "answer": i % 2}) + "\n" for i in range(6)))
    (task / "tok_choice.yaml").write_text(
        "task: tok_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'test.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    result = evaluate_downstream(run, options=options, tasks="tok_choice", include_path=str(task))
    assert result["results"][0]["samples"] == 6


def test_shards_of_another_tokenizer_are_refused(small, large, tmp_path):
    source, _ = corpus(tmp_path / "docs.jsonl", n=20)
    shards = prepare(tmp_path / "shards", source, small)
    with pytest.raises(data.ShardError, match=r"made with the tokenizer .* not the run's 'gpt2'"):
        data.ShardLoader(shards, "train", 2, 16, tokenizer=GPT2_IDENTITY)
    with pytest.raises(data.ShardError, match="not the run's"):
        data.ShardLoader(shards, "train", 2, 16, tokenizer=load_tokenizer(large).identity)
    with pytest.raises(SystemExit):  # prepare_fineweb.py into it with another tokenizer: one line, nothing lost
        prepare(shards, source, "gpt2")
    assert json.load(open(os.path.join(shards, "manifest.json")))["tokenizer"]["name"] == small
    done = subprocess.run([sys.executable, "train.py", small_config(tmp_path, shards), "--data.tokenizer=gpt2",
                           f"--log.out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "made with the tokenizer" in done.stderr and "data.tokenizer" in done.stderr


def test_checkpoints_of_another_tokenizer_are_refused(small, large):
    """Resuming, train.init_from and the evaluators compare the checkpoint's recorded tokenizer with the run's."""
    cfg = load_config(overrides=[f"--data.tokenizer={small}"])
    mine = {"config": {"data": {"tokenizer": small}}, "tokenizer": load_tokenizer(small).identity.to_dict()}
    check_checkpoint_tokenizer(mine, cfg, "ckpt")
    for other in ({"config": {"data": {"tokenizer": large}}, "tokenizer": load_tokenizer(large).identity.to_dict()},
                  {"config": {"data": {}}}):  # a checkpoint from before data.tokenizer: GPT-2's
        with pytest.raises(UserError, match="was trained with the tokenizer"):
            check_checkpoint_tokenizer(other, cfg, "ckpt")
    with pytest.raises(TokenizerError, match="its files changed"):
        load_run_tokenizer(small, "f" * 64)
    sha = load_tokenizer(small).identity.sha256
    assert load_run_tokenizer(small, sha) is load_tokenizer(small)
    with pytest.raises(TokenizerError, match="cannot hold every id"):
        load_run_tokenizer(small, sha, vocab_size=100)
    assert issubclass(TokenizerError, UserError)  # every command's one line, with no wrapper of its own


def test_an_export_refuses_a_tokenizer_whose_files_changed_since_training(small, tmp_path):
    """Two tokens swap ids in the run's tokenizer.json after training (same vocabulary size): the evaluators
    refuse it, and so does export_hf.py (it shipped the changed tokenizer before), in one line, writing nothing."""
    import export_hf

    folder = shutil.copytree(small, str(tmp_path / "tok"))
    source, _ = corpus(tmp_path / "docs.jsonl", n=30)
    shards = prepare(tmp_path / "shards", source, folder, shard_size=4096)
    run = str(tmp_path / "run")
    train.main([small_config(tmp_path, shards), f"--data.tokenizer={folder}", f"--log.out_dir={run}",
                "--train.max_steps=2", "--train.val_every=0"])
    path = os.path.join(folder, "tokenizer.json")
    spec = json.load(open(path))
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(spec, f)
    load_tokenizer.cache_clear()
    done = subprocess.run([sys.executable, "export_hf.py", run, str(tmp_path / "hf")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "was trained with the tokenizer" in done.stderr and "its files changed" in done.stderr
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(UserError, match="its files changed"):
        export_hf.read_checkpoint(run)
