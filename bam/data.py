"""Token shards (their formats in one table) and a resumable distributed loader.

Shard format (llm.c's, so the FineWeb shards that llm.c and modded-nanogpt publish,
`fineweb_val_000000.bin`, `fineweb_train_000001.bin`, ..., load as they are), in two widths:

    header  256 little-endian int32; [0] = magic, [1] = version, [2] = n, the number of tokens that
            follow the header; the other 253 are zero. As llm.c's dev/data/data_common.py defines them:
            magic 20240520, version 1: uint16 tokens (GPT-2, any vocabulary of at most 65,536 ids);
            magic 20240801, version 7: uint32 tokens (llm.c's Llama-3 shards; any larger vocabulary).
    body    n little-endian token ids of that width.
    size    exactly 256 * 4 + width * n bytes; anything else is a truncated or corrupt file.

Every document opens with the tokenizer's document token (GPT-2: EOT 50256 *before* every document, as in
llm.c's fineweb.py; a tokenizer with BOS and EOS: [BOS] doc [EOS], see bam/tokenizer.py), and a document may
continue from one shard into the next: the shards of a split, in name order, are one token stream.
The first shard of a prepared directory (`<prefix>_val_000000.bin`) is the validation split. The
manifest.json that prepare_fineweb.py writes beside the shards names their tokenizer; the loader refuses
shards of another tokenizer than the run's.
"""

import bisect
import glob
import json
import os

import numpy as np
import torch

from bam.outputs import write_bytes
from bam.tokenizer import EOT, GPT2, GPT2_IDENTITY, TokenizerIdentity

SHARD_VERSION_UINT16 = 1  # GPT-2's, and any vocabulary of at most 65,536 ids
SHARD_VERSION_UINT32 = 7  # llm.c's Llama-3 shards, and any larger vocabulary
# The one table of the shard formats: version -> (magic, token dtype), as llm.c's dev/data/data_common.py
# writes them ("gpt-2", "llama-3"). Readers, writers and prepare_fineweb.py's manifest all read it.
SHARD_FORMATS = {SHARD_VERSION_UINT16: (20240520, np.dtype("<u2")),
                 SHARD_VERSION_UINT32: (20240801, np.dtype("<u4"))}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MANIFEST = "manifest.json"  # written by prepare_fineweb.py next to its shards


class ShardError(ValueError):
    """A shard file that is not a valid llm.c token shard; the message names the file."""


# ----------------------------------------------------------------------------------------------
# Shards

def shard_version(vocab_size):
    """The shard version whose token width holds every id below vocab_size: 1 (uint16) or 7 (uint32)."""
    return SHARD_VERSION_UINT16 if vocab_size <= 2 ** 16 else SHARD_VERSION_UINT32


def write_shard(path: str, tokens, version: int = SHARD_VERSION_UINT16) -> None:
    """Write `tokens` as an llm.c shard of `version` (1: ids < 2**16 as uint16; 7: ids < 2**32 as uint32),
    atomically."""
    magic, dtype = SHARD_FORMATS[version]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** (8 * dtype.itemsize)):
        raise ValueError(f"{path}: token ids must be in [0, {2 ** (8 * dtype.itemsize)}) to fit "
                         f"{dtype.name} (version {version} shards)")
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens do not fit the int32 count of the header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, tokens.size
    write_bytes(path, [header.tobytes(), tokens.astype(dtype, copy=False).tobytes()])


def shard_num_tokens(path: str) -> int:
    """Validate a shard's header against its file size and return its token count."""
    return shard_header(path)[1]


def shard_header(path: str):
    """(version, token count, token dtype) of a shard, after validating its header against its size."""
    if os.path.isdir(path):
        raise ShardError(f"{path} is a directory, not a shard file")
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as e:
        raise ShardError(f"{path}: cannot read it ({e.strerror or e})") from None
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    magic, version, n = (int(v) for v in header[:3])
    magics = {m for m, _ in SHARD_FORMATS.values()}
    if magic not in magics:
        raise ShardError(f"{path}: magic {magic}, expected {' or '.join(map(str, sorted(magics)))} (not an llm.c "
                         f"token shard)")
    if version not in SHARD_FORMATS or SHARD_FORMATS[version][0] != magic:
        expected = next(v for v, (m, _) in SHARD_FORMATS.items() if m == magic)
        width = "uint16 tokens" if expected == SHARD_VERSION_UINT16 else "uint32 tokens"
        raise ShardError(f"{path}: version {version}, expected {expected} with magic {magic} ({width})")
    dtype = SHARD_FORMATS[version][1]
    expected = HEADER_BYTES + dtype.itemsize * n
    if n < 0 or size != expected:
        raise ShardError(f"{path}: header declares {n} tokens ({expected} bytes) but the file has "
                         f"{size} bytes (truncated or corrupt)")
    return version, n, dtype


def read_shard(path: str) -> np.memmap:
    """The tokens of a shard as a read-only memmap (no copy; uint16 or uint32), after validating it."""
    _, n, dtype = shard_header(path)
    if n == 0:
        return np.zeros(0, dtype=dtype)  # numpy cannot map zero bytes
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


def _tokenizer_words(tokenizer_name):
    return "the GPT-2 tokenizer" if tokenizer_name in (None, "gpt2") else f"the run's tokenizer ({tokenizer_name})"


def check_token_ids(tokens, vocab_size: int, where: str, tokenizer_name=None) -> None:
    """ShardError naming `where` when a token id is outside the model's vocabulary [0, vocab_size)
    (tokens are unsigned: uint16 in shards, non-negative int64 in batches)."""
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise ShardError(f"{where} holds token id {top}, outside the model's vocabulary (model.vocab_size = "
                         f"{vocab_size}); raise model.vocab_size or re-tokenize with "
                         f"{_tokenizer_words(tokenizer_name)}")


def check_shard_tokens(paths, vocab_size: int, chunk: int = 1 << 24, tokenizer_name=None) -> None:
    """ShardError naming the shard and position of the first token id >= vocab_size. The embedding would
    otherwise fail with an IndexError deep inside the first forward that meets it (or, on a GPU, an
    asynchronous device assert). A chunked, memmapped scan: about one read of the data."""
    for path in paths:
        tokens = read_shard(path)
        for start in range(0, len(tokens), chunk):
            piece = np.asarray(tokens[start:start + chunk])
            if piece.size and int(piece.max()) >= vocab_size:
                where = start + int(np.argmax(piece >= vocab_size))
                raise ShardError(f"{path}: token {where:,} has id {int(piece[where - start])}, outside the model's "
                                 f"vocabulary (model.vocab_size = {vocab_size}); raise model.vocab_size or "
                                 f"re-tokenize with {_tokenizer_words(tokenizer_name)}")


def document_ids(tokens, eot=EOT):
    """(..., T) tokens -> the document of each token, counted along the last dimension: `eot`, the token
    that opens every document (GPT-2's EOT, or the BOS of a BOS/EOS tokenizer, whose EOS then belongs to
    the document it closes), opens a document, so positions with equal ids are one document, and 0 marks
    tokens before the row's first opening token (the tail of a document that began earlier)."""
    return torch.cumsum(tokens == eot, dim=-1)


def shard_paths(data_dir: str, split: str) -> list:
    """The shards of one split, in stream order: any `*_<split>_*.bin` (ours, llm.c's, modded-nanogpt's)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return sorted(glob.glob(os.path.join(glob.escape(data_dir), f"*_{split}_*.bin")))


def manifest_tokenizer(data_dir):
    """The tokenizer.TokenizerIdentity that data_dir's manifest.json records, or None without a manifest
    (llm.c's and modded-nanogpt's shards have none). A manifest older than the tokenizer fields is GPT-2's."""
    path = os.path.join(data_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    record = manifest.get("tokenizer") if isinstance(manifest, dict) else None
    if isinstance(record, dict):
        return TokenizerIdentity.from_dict(record)
    if record == GPT2:
        return GPT2_IDENTITY
    raise ShardError(f"{path} names no tokenizer this version knows ({record!r})")


def check_shards_tokenizer(data_dir, tokenizer):
    """ShardError, one line, when data_dir's manifest records another tokenizer than `tokenizer`."""
    recorded = manifest_tokenizer(data_dir)
    if recorded is not None and recorded.sha256 != tokenizer.sha256:
        raise ShardError(f"the shards in {data_dir} were made with the tokenizer {recorded.describe()}, not the "
                         f"run's {tokenizer.describe()}; set data.tokenizer = {recorded.name!r} or prepare the "
                         f"data again with --tokenizer {tokenizer.name}")


# ----------------------------------------------------------------------------------------------
# Loader

class ShardLoader:
    """(x, y, doc_ids) batches of shape (B, T) from the shards of one split, for one DDP rank.

    The split's shards, in name order, are one token stream (a shard's tail continues into the
    next shard's head, as documents do). Each step all ranks together take W consecutive windows
    of B*T+1 tokens starting at `position`; rank r gets window r, so over a run window k of the
    stream goes to rank k % W. Consecutive windows overlap by one token, so every token after the
    first is a target exactly once per epoch. When the next W windows no longer fit, the epoch
    ends (the short remainder is skipped) and the stream starts over from the beginning.

    The state is a position in the stream, the same on every rank, so any rank's `state_dict()`
    restores all ranks, also under a different world size. doc_ids are `document_ids(x)` counted from
    the run's document token: positions with equal ids belong to the same document.

    `tokenizer` is the run's tokenizer.TokenizerIdentity (default GPT-2's): shards whose manifest names
    another tokenizer, or a split whose shards mix the two widths, are a ShardError up front. With
    `vocab_size` (the model's), a batch holding a token id outside the vocabulary is a ShardError naming the
    split and the tokens it read, instead of an IndexError deep in the embedding.
    """

    def __init__(self, data_dir, split, batch_size, seq_len, rank=0, world_size=1, tokenizer=None, vocab_size=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        self.data_dir, self.split, self.vocab_size = data_dir, split, vocab_size
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.paths = shard_paths(data_dir, split)
        if not self.paths:
            raise FileNotFoundError(f"no {split} shards (*_{split}_*.bin) in {data_dir}")
        headers = [shard_header(p) for p in self.paths]  # validates every header up front
        self.counts = [n for _, n, _ in headers]
        counts = self.counts
        if tokenizer is None:
            tokenizer = GPT2_IDENTITY
        self.tokenizer = tokenizer
        check_shards_tokenizer(data_dir, tokenizer)
        versions = sorted({v for v, _, _ in headers})
        if len(versions) > 1:
            first = {v: next(p for p, (w, _, _) in zip(self.paths, headers) if w == v) for v in versions}
            raise ShardError(f"the {split} shards in {data_dir} mix llm.c versions {versions[0]} "
                             f"({os.path.basename(first[versions[0]])}) and {versions[1]} "
                             f"({os.path.basename(first[versions[1]])}): shards of two tokenizers")
        self.dtype = headers[0][2]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).tolist()  # stream offset of each shard
        self.num_tokens = self.starts[-1]
        if seq_len + 1 > max(counts):
            raise ValueError(f"seq_len {seq_len} is longer than the {split} shards in {data_dir} "
                             f"(at most {max(counts)} tokens each); use a shorter seq_len or a larger "
                             f"--shard_size")
        self.window = batch_size * seq_len  # tokens a rank advances per batch
        if world_size * self.window + 1 > self.num_tokens:
            raise ValueError(f"one step needs {world_size} x {batch_size} x {seq_len} + 1 tokens but the "
                             f"{split} split in {data_dir} has only {self.num_tokens}")
        self.reset()

    @property
    def batches_per_epoch(self) -> int:
        return (self.num_tokens - 1) // (self.world_size * self.window)

    def reset(self):
        """Back to the start of the stream: validation iterates the same batches every time."""
        self.epoch, self.position = 0, 0

    def _read(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = bisect.bisect_right(self.starts, start) - 1
        while filled < length:
            if self.counts[shard]:
                # A fresh memmap per read, dropped right after, as nanoGPT does: the loader never
                # holds more than one shard's mapping, and resident memory does not creep up over
                # a multi-day run. Headers were validated once, in __init__.
                tokens = np.memmap(self.paths[shard], dtype=self.dtype, mode="r", offset=HEADER_BYTES,
                                   shape=(self.counts[shard],))
                offset = start + filled - self.starts[shard]
                piece = tokens[offset:offset + length - filled]
                out[filled:filled + len(piece)] = piece
                filled += len(piece)
                del tokens, piece
            shard += 1
        return out

    def next_batch(self):
        if self.position + self.world_size * self.window + 1 > self.num_tokens:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position + self.rank * self.window
        buf = torch.from_numpy(self._read(start, self.window + 1))
        if self.vocab_size is not None:
            where = f"the {self.split} split in {self.data_dir} (tokens {start}..{start + self.window})"
            for tokens in (buf[:-1], buf[-1:]):  # x, then the one token y adds: the id named is x's largest first
                check_token_ids(tokens, self.vocab_size, where, tokenizer_name=self.tokenizer.name)
        self.position += self.world_size * self.window
        B, T = self.batch_size, self.seq_len
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        return x, y, document_ids(x, self.tokenizer.doc_open)

    def state_dict(self) -> dict:
        shard = bisect.bisect_right(self.starts, self.position) - 1
        return {"split": self.split, "epoch": self.epoch, "position": self.position,
                "shard": shard, "shard_offset": self.position - self.starts[shard],  # for humans
                "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict):
        if state["num_tokens"] != self.num_tokens or state["split"] != self.split:
            raise ValueError(f"loader state is for a {state['split']} stream of {state['num_tokens']} "
                             f"tokens but {self.data_dir} holds a {self.split} stream of "
                             f"{self.num_tokens}: the data changed since the checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

