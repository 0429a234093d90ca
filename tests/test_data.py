"""data.py: shard format, tokenizer routes, and the distributed, resumable loader."""

import io
import json
import os
import struct
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from bam import tokenizer
from bam.cli import UserError
from bam.data import EOT, ShardError, ShardLoader, read_shard, write_shard
from bam.fetch import fetch_gpt2_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# Shard format

def test_shard_round_trip(tmp_path):
    tokens = np.array([0, 1, EOT, 65535, 42, 50000], dtype=np.uint16)
    path = tmp_path / "x_val_000000.bin"
    write_shard(str(path), tokens)
    assert os.path.getsize(path) == 256 * 4 + 2 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, len(tokens)] and not header[3:].any()
    back = read_shard(str(path))
    assert back.dtype == np.uint16 and np.array_equal(back, tokens)
    assert not list(tmp_path.glob("*.tmp*"))  # the temp file of the atomic write is gone


def test_write_shard_rejects_tokens_outside_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        write_shard(str(tmp_path / "a.bin"), np.array([1, 70000]))
    assert not os.path.exists(tmp_path / "a.bin")


def _llmc_shard(path, tokens):
    """An llm.c / modded-nanogpt shard written straight from the format's description (struct +
    bytes), independently of data.write_shard."""
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def test_llmc_shards_load_as_they_are(tmp_path):
    val = list(range(100, 400))
    train = [[EOT] + list(range(1000, 1999)), list(range(5000, 5500))]
    _llmc_shard(tmp_path / "fineweb_val_000000.bin", val)
    _llmc_shard(tmp_path / "fineweb_train_000001.bin", train[0])
    _llmc_shard(tmp_path / "fineweb_train_000002.bin", train[1])
    assert read_shard(str(tmp_path / "fineweb_val_000000.bin")).tolist() == val
    loader = ShardLoader(str(tmp_path), "train", batch_size=2, seq_len=300)
    stream = train[0] + train[1]
    for i in range(2):  # the second batch reads across the boundary of the two train shards
        x, y, _ = loader.next_batch()
        window = stream[i * 600: i * 600 + 601]
        assert x.flatten().tolist() == window[:-1] and y.flatten().tolist() == window[1:]
    x, _, _ = ShardLoader(str(tmp_path), "val", batch_size=1, seq_len=200).next_batch()
    assert x.flatten().tolist() == val[:200]


def _corrupt(path, kind):
    raw = bytearray(open(path, "rb").read())
    if kind == "magic":
        raw[0:4] = struct.pack("<i", 20240521)
    elif kind == "version":
        raw[4:8] = struct.pack("<i", 7)  # llm.c's llama-3 (uint32) shards
    elif kind == "truncated":
        raw = raw[:-3]
    elif kind == "no header":
        raw = raw[:100]
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("kind, message", [("magic", "magic 20240521, expected 20240520"),
                                           ("version", "version 7, expected 1"),
                                           ("truncated", "declares 100 tokens"),
                                           ("no header", "shorter than the 1024-byte shard header")])
def test_bad_shard_gives_clear_error_naming_the_file(tmp_path, kind, message):
    write_shard(str(tmp_path / "d_train_000001.bin"), np.arange(100))
    write_shard(str(tmp_path / "d_train_000002.bin"), np.arange(100))
    bad = tmp_path / "d_train_000002.bin"
    _corrupt(bad, kind)
    with pytest.raises(ShardError, match=message) as error:
        read_shard(str(bad))
    assert str(bad) in str(error.value)
    with pytest.raises(ShardError, match=message):  # the loader checks every header up front
        ShardLoader(str(tmp_path), "train", batch_size=1, seq_len=10)


# ---------------------------------------------------------------------------------------------
# Tokenizer

@pytest.fixture
def fresh_tokenizer_cache():
    tokenizer.gpt2_encoding.cache_clear()
    yield
    tokenizer.gpt2_encoding.cache_clear()


@pytest.fixture(scope="session")
def gpt2_ranks_file():
    """The gpt2.tiktoken the set-up step fetched (tests/conftest.py points $BAM_GPT2_TIKTOKEN at it)."""
    return tokenizer.gpt2_tiktoken_cache_path()


def test_tokenizer_is_gpt2():
    enc = tokenizer.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256
    text = "Bayesian attention, naïve café — 東京 🙂\n\n  indented"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_pattern_is_tiktokens_gpt2_pattern():
    from tiktoken_ext.openai_public import r50k_pat_str
    assert tokenizer.GPT2_PAT_STR == r50k_pat_str


def test_offline_route_from_local_ranks_file(gpt2_ranks_file, fresh_tokenizer_cache, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the offline route must not call tiktoken's download")
    monkeypatch.setattr("tiktoken.get_encoding", no_network)
    monkeypatch.setattr(tokenizer, "download_gpt2_tiktoken", no_network)
    monkeypatch.setenv("BAM_GPT2_TIKTOKEN", gpt2_ranks_file)
    enc = tokenizer.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    # The same ranks as tiktoken's registry encoding, token for token, on real text.
    text = open(tokenizer.__file__, encoding="utf-8").read()
    assert enc.encode_ordinary(text) == tokenizer.load_gpt2_from_file(gpt2_ranks_file).encode_ordinary(text)
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]


def test_corrupt_ranks_file_is_rejected(tmp_path, gpt2_ranks_file, fresh_tokenizer_cache, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(open(gpt2_ranks_file, "rb").read()[:-100])
    monkeypatch.setenv("BAM_GPT2_TIKTOKEN", str(bad))
    with pytest.raises(RuntimeError, match="sha256"):
        tokenizer.gpt2_encoding()
    monkeypatch.setenv("BAM_GPT2_TIKTOKEN", str(tmp_path / "missing.tiktoken"))
    with pytest.raises(RuntimeError, match="does not exist"):
        tokenizer.gpt2_encoding()


def test_no_route_says_how_to_fix(tmp_path, fresh_tokenizer_cache, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no route to host")
    monkeypatch.delenv("BAM_GPT2_TIKTOKEN", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("tiktoken.get_encoding", fail)
    monkeypatch.setattr(tokenizer, "download_gpt2_tiktoken", fail)
    with pytest.raises(RuntimeError, match="pip download --no-deps --no-binary :all: openai-whisper") as e:
        tokenizer.gpt2_encoding()
    assert str(tmp_path / "bam" / "gpt2.tiktoken") in str(e.value) and "BAM_GPT2_TIKTOKEN" in str(e.value)


# The route that fetches the ranks from PyPI (the set-up step, and gpt2_encoding on first use), run through
# the real pip against a local find-links folder instead of the registry: no network.

WHISPER_BACKEND = """
import os

def prepare_metadata_for_build_wheel(directory, config_settings=None):
    os.makedirs(os.path.join(directory, "openai_whisper-20250625.dist-info"))
    with open(os.path.join(directory, "openai_whisper-20250625.dist-info", "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: openai-whisper\\nVersion: 20250625\\n")
    return "openai_whisper-20250625.dist-info"
"""


def local_index(folder, ranks):
    """pip's environment for a find-links `folder` holding an openai-whisper sdist laid out as PyPI's is, with
    `ranks` as whisper/assets/gpt2.tiktoken (None: an empty folder, a registry without it). Its build backend
    ships in the tarball, so pip reads the sdist's metadata without fetching setuptools."""
    os.makedirs(folder, exist_ok=True)
    if ranks is not None:
        files = {"pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
                 "backend.py": WHISPER_BACKEND.encode(), "whisper/assets/gpt2.tiktoken": ranks}
        with tarfile.open(os.path.join(folder, "openai-whisper-20250625.tar.gz"), "w:gz") as tar:
            for name, content in files.items():
                info = tarfile.TarInfo(f"openai_whisper-20250625/{name}")
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder), "PIP_CACHE_DIR": os.path.join(folder, "pip-cache")}


def fetch(tmp_path, index_env):
    env = {k: v for k, v in os.environ.items() if k != "BAM_GPT2_TIKTOKEN"}
    env.update(index_env, XDG_CACHE_HOME=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "bam.fetch"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # pip and the command in subprocesses
def test_set_up_step_fetches_the_ranks_once_through_pip(tmp_path, gpt2_ranks_file):
    ranks = open(gpt2_ranks_file, "rb").read()
    index = local_index(tmp_path / "index", ranks)
    done = fetch(tmp_path, index)
    fetched = tmp_path / "cache" / "bam" / "gpt2.tiktoken"  # the default place, where gpt2_encoding looks first
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"fetched GPT-2's ranks from PyPI ({tokenizer.WHISPER_SDIST}) into {fetched}\n"
    assert fetched.read_bytes() == ranks
    os.remove(tmp_path / "index" / "openai-whisper-20250625.tar.gz")  # pip would fail now: it is not asked
    again = fetch(tmp_path, index)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")


@pytest.mark.slow  # pip and the command in subprocesses
@pytest.mark.parametrize("registry", ["unreachable", "wrong ranks"])
def test_set_up_step_that_cannot_fetch_is_one_line_with_the_fix(tmp_path, gpt2_ranks_file, registry):
    ranks = None if registry == "unreachable" else open(gpt2_ranks_file, "rb").read()[:-100]
    done = fetch(tmp_path, local_index(tmp_path / "index", ranks))
    fetched = tmp_path / "cache" / "bam" / "gpt2.tiktoken"
    assert done.returncode == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: cannot fetch GPT-2's ranks from the package registry (")
    assert ("No matching distribution" if ranks is None else "unexpected sha256") in done.stderr
    assert f"pip download --no-deps --no-binary :all: {tokenizer.WHISPER_SDIST}" in done.stderr
    assert f"put it at {fetched}" in done.stderr
    assert not fetched.exists()


def test_set_up_step_refuses_a_torn_ranks_file_and_leaves_it(tmp_path, gpt2_ranks_file, monkeypatch):
    torn = tmp_path / "gpt2.tiktoken"
    torn.write_bytes(open(gpt2_ranks_file, "rb").read()[:-100])
    monkeypatch.setenv("BAM_GPT2_TIKTOKEN", str(torn))
    with pytest.raises(UserError, match="is not OpenAI's gpt2.tiktoken"):
        fetch_gpt2_ranks()
    assert torn.stat().st_size == os.path.getsize(gpt2_ranks_file) - 100


@pytest.mark.slow  # pip in a subprocess
def test_first_use_without_tiktokens_download_fetches_the_ranks_from_the_registry(
        tmp_path, gpt2_ranks_file, fresh_tokenizer_cache, monkeypatch, capsys):
    def unreachable(*args, **kwargs):  # what tiktoken's download does on a machine that reaches only PyPI
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")
    monkeypatch.setattr("tiktoken.get_encoding", unreachable)
    monkeypatch.delenv("BAM_GPT2_TIKTOKEN")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key, value in local_index(tmp_path / "index", open(gpt2_ranks_file, "rb").read()).items():
        monkeypatch.setenv(key, value)
    enc = tokenizer.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    fetched = tmp_path / "cache" / "bam" / "gpt2.tiktoken"
    assert f"fetching GPT-2 ranks: pip download {tokenizer.WHISPER_SDIST} (sdist) -> {fetched}" in capsys.readouterr().err
    assert fetched.read_bytes() == open(gpt2_ranks_file, "rb").read()


# ---------------------------------------------------------------------------------------------
# Loader

def _write_stream(directory, stream, sizes, prefix="t", split="train"):
    """Split `stream` into shards of the given sizes (the last takes the rest)."""
    start = 0
    for i, size in enumerate(list(sizes) + [len(stream)]):
        if start >= len(stream):
            break
        write_shard(os.path.join(directory, f"{prefix}_{split}_{i + 1:06d}.bin"), stream[start:start + size])
        start += size


def test_loader_reads_the_stream_across_shards(tmp_path):
    stream = np.arange(10_000) % 50_000
    _write_stream(tmp_path, stream, [1000, 3, 2500, 0, 1234])  # a tiny and an empty shard too
    B, T = 4, 100
    loader = ShardLoader(str(tmp_path), "train", B, T)
    assert loader.num_tokens == 10_000 and loader.batches_per_epoch == 9_999 // (B * T)
    for i in range(loader.batches_per_epoch):
        x, y, doc_ids = loader.next_batch()
        assert x.shape == y.shape == doc_ids.shape == (B, T)
        assert x.dtype == y.dtype == doc_ids.dtype == torch.int64
        # windows of B*T+1 tokens, consecutive windows overlapping by one token
        window = stream[i * B * T: (i + 1) * B * T + 1]
        assert np.array_equal(x.numpy().ravel(), window[:-1])
        assert np.array_equal(y.numpy().ravel(), window[1:])
    x, _, _ = loader.next_batch()  # the remainder is skipped and the next epoch starts over
    assert loader.epoch == 1 and x[0, 0].item() == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_are_disjoint_and_cover_the_stream(tmp_path, world_size):
    stream = np.arange(20_000)  # every token value is its position in the stream
    _write_stream(tmp_path, stream, [3000, 7777, 100])
    B, T = 2, 64
    loaders = [ShardLoader(str(tmp_path), "train", B, T, rank=r, world_size=world_size)
               for r in range(world_size)]
    steps = loaders[0].batches_per_epoch
    assert steps == (20_000 - 1) // (world_size * B * T)
    seen = {r: [] for r in range(world_size)}
    for step in range(steps):
        for r, loader in enumerate(loaders):
            x, y, _ = loader.next_batch()
            first = x[0, 0].item()
            assert first == (step * world_size + r) * B * T  # window k goes to rank k % W
            seen[r].append(x.numpy().ravel())
    per_rank = [set(np.concatenate(seen[r]).tolist()) for r in range(world_size)]
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not per_rank[a] & per_rank[b]
    assert set().union(*per_rank) == set(range(steps * world_size * B * T))
    assert len({json.dumps(l.state_dict()) for l in loaders}) == 1  # one state serves every rank


def test_state_restore_gives_the_identical_next_batches(tmp_path):
    rng = np.random.default_rng(0)
    _write_stream(tmp_path, rng.integers(0, 50257, 30_000), [4000, 9000, 500])
    B, T, W = 3, 128, 2
    loaders = [ShardLoader(str(tmp_path), "train", B, T, r, W) for r in range(W)]
    for _ in range(17):  # past an epoch end: 30_000 tokens make 39 steps
        for loader in loaders:
            loader.next_batch()
    state = json.loads(json.dumps(loaders[1].state_dict()))  # must survive a checkpoint round trip
    assert set(state) >= {"epoch", "position", "shard"} and len(json.dumps(state)) < 300
    expected = [[loader.next_batch() for loader in loaders] for _ in range(40)]
    restored = [ShardLoader(str(tmp_path), "train", B, T, r, W) for r in range(W)]
    for loader in restored:
        loader.load_state_dict(state)
    for step in range(40):
        for r, loader in enumerate(restored):
            for got, want in zip(loader.next_batch(), expected[step][r]):
                assert torch.equal(got, want)
    assert restored[0].epoch == 1


def test_state_of_other_data_is_refused(tmp_path):
    _write_stream(tmp_path, np.arange(5000), [])
    state = ShardLoader(str(tmp_path), "train", 1, 10).state_dict()
    write_shard(str(tmp_path / "t_train_000009.bin"), np.arange(100))
    with pytest.raises(ValueError, match="data changed"):
        ShardLoader(str(tmp_path), "train", 1, 10).load_state_dict(state)


def test_doc_ids_follow_eots(tmp_path):
    # Documents as llm.c writes them: EOT, then the document's tokens (values < EOT).
    rng = np.random.default_rng(1)
    stream, owner = [], []
    for doc in range(300):
        length = int(rng.integers(1, 40))
        stream += [EOT] + rng.integers(0, 50000, length).tolist()
        owner += [doc] * (length + 1)
    stream, owner = np.array(stream), np.array(owner)
    _write_stream(tmp_path, stream, [777])
    B, T = 4, 50
    loader = ShardLoader(str(tmp_path), "train", B, T)
    for step in range(loader.batches_per_epoch):
        _, _, doc_ids = loader.next_batch()
        rows_owner = owner[step * B * T: (step + 1) * B * T].reshape(B, T)
        for row in range(B):
            same_doc = rows_owner[row][:, None] == rows_owner[row][None, :]
            same_id = (doc_ids[row][:, None] == doc_ids[row][None, :]).numpy()
            assert np.array_equal(same_doc, same_id)
            # ids only ever grow by one, exactly where an EOT opens a document
            steps = np.diff(doc_ids[row].numpy())
            assert set(steps.tolist()) <= {0, 1}


def test_validation_is_deterministic(tmp_path):
    _write_stream(tmp_path, np.random.default_rng(2).integers(0, 50257, 5000), [], split="val")
    first = ShardLoader(str(tmp_path), "val", 2, 100)
    batches = [first.next_batch()[0] for _ in range(first.batches_per_epoch)]
    first.reset()
    again = [first.next_batch()[0] for _ in range(first.batches_per_epoch)]
    other = ShardLoader(str(tmp_path), "val", 2, 100)
    fresh = [other.next_batch()[0] for _ in range(other.batches_per_epoch)]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(batches, again, fresh))


def test_loader_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no train shards"):
        ShardLoader(str(tmp_path), "train", 1, 10)
    _write_stream(tmp_path, np.arange(1000), [400])
    with pytest.raises(ValueError, match="seq_len 700 is longer than the train shards"):
        ShardLoader(str(tmp_path), "train", 1, 700)
    with pytest.raises(ValueError, match="only 1000"):
        ShardLoader(str(tmp_path), "train", 4, 500)
    with pytest.raises(ValueError, match="rank 2"):
        ShardLoader(str(tmp_path), "train", 1, 10, rank=2, world_size=2)


def test_a_loader_given_the_vocabulary_refuses_a_batch_with_a_token_outside_it(tmp_path):
    """train.py's check of every training batch: one line naming the split and the tokens this rank read, also
    when the id is only y's last target; a loader without vocab_size (validation, scanned whole up front) reads on."""
    tokens = np.arange(400) % 100
    tokens[64] = 60_000  # another tokenizer's id: the last token that rank 1's first batch reads
    write_shard(str(tmp_path / "x_train_000001.bin"), tokens)
    ShardLoader(str(tmp_path), "train", 2, 16, rank=0, world_size=2, vocab_size=50257).next_batch()  # tokens 0..32
    with pytest.raises(ShardError) as error:
        ShardLoader(str(tmp_path), "train", 2, 16, rank=1, world_size=2, vocab_size=50257).next_batch()
    assert str(error.value) == (f"the train split in {tmp_path} (tokens 32..64) holds token id 60000, outside the "
                                "model's vocabulary (model.vocab_size = 50257); raise model.vocab_size or re-tokenize "
                                "with the GPT-2 tokenizer")
    _, y, _ = ShardLoader(str(tmp_path), "train", 2, 16, rank=1, world_size=2).next_batch()
    assert int(y.max()) == 60_000


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_loader_keeps_no_shard_mapped_between_batches(tmp_path):
    _write_stream(tmp_path, np.arange(20_000), [5000, 5000])
    loader = ShardLoader(str(tmp_path), "train", 2, 1000)
    for _ in range(5):
        loader.next_batch()
        maps = open("/proc/self/maps").read()
        assert str(tmp_path) not in maps
