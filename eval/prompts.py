"""The text the evaluators feed a model: the tokenizer, templates whose slots tokenise exactly as the
answer must be reproduced, filler haystacks, and held-out validation text. Every prompt is built from
text with the run's tokenizer (EvalModel.tokenizer), so lengths are exact token counts of that tokenizer."""

import os
import re
from dataclasses import dataclass

import numpy as np

from bam.data import EOT, ShardError, check_shards_tokenizer, read_shard, shard_paths
from eval import EvalError


def encode_template(enc, template, values):
    """Tokens of a template with {slots}, each slot's value tokenised on its own together with the space
    before it, so a value's tokens inside the haystack are exactly the tokens the answer must reproduce.
    Returns (tokens, {slot: [(start, end), ...]}). Every piece is encoded as it reads inside the prompt
    (Tokenizer.encode_continuation)."""
    parts = re.split(r"(\{\w+\})", template)  # text, slot, text, slot, ..., text
    tokens, spans = [], {}
    for i, part in enumerate(parts):
        if i % 2 == 0:
            text = part[:-1] if i + 1 < len(parts) and part.endswith(" ") else part
            tokens += enc.encode_continuation(text) if text else []
        else:
            prefix = " " if parts[i - 1].endswith(" ") else ""
            piece = enc.encode_continuation(prefix + str(values[part[1:-1]]))
            spans.setdefault(part[1:-1], []).append((len(tokens), len(tokens) + len(piece)))
            tokens += piece
    return tokens, spans


@dataclass
class Haystack:
    """A filler token stream and the positions where a sentence ends (where an insertion reads naturally)."""

    tokens: np.ndarray
    boundaries: np.ndarray  # sorted positions p such that tokens[:p] ends a sentence (0 included)

    def cut(self, depth, n):
        """The sentence boundary in [0, n] nearest to depth * n (n itself counts as one)."""
        candidates = self.boundaries[self.boundaries <= n]
        candidates = np.append(candidates, n)
        return int(candidates[np.argmin(np.abs(candidates - depth * n))])


def repeat_haystack(enc, text, n):
    """`text`'s sentences, each tokenised with a leading space, repeated to at least n tokens."""
    sentences = [enc.encode_continuation(" " + s.strip() + ".") for s in text.split(".") if s.strip()]
    unit = np.array([t for s in sentences for t in s], dtype=np.int64)
    reps = n // len(unit) + 1
    ends = np.cumsum([len(s) for s in sentences])
    boundaries = np.concatenate([[0], (np.arange(reps)[:, None] * len(unit) + ends[None, :]).ravel()])
    return Haystack(np.tile(unit, reps), boundaries)


def validation_tokens(data_dir, max_tokens=None, tokenizer=None):
    """The validation split (the first shard(s), `*_val_*.bin`) as int64, at most max_tokens of it. With
    `tokenizer` (a TokenizerIdentity), shards whose manifest names another tokenizer are refused."""
    paths = shard_paths(data_dir, "val") if data_dir and os.path.isdir(data_dir) else []
    if not paths:
        raise EvalError(f"no validation shards (*_val_*.bin) in {data_dir!r}; pass --data_dir with the folder "
                        f"prepare_fineweb.py wrote")
    if tokenizer is not None:
        try:
            check_shards_tokenizer(data_dir, tokenizer)
        except ShardError as e:
            raise EvalError(str(e).replace("set data.tokenizer", "pass the matching --data_dir, or train with "
                                           "data.tokenizer")) from None
    pieces, total = [], 0
    for path in paths:
        try:
            tokens = read_shard(path)
        except ShardError as e:
            raise EvalError(str(e)) from None
        if max_tokens is not None:
            tokens = tokens[:max_tokens - total]
        pieces.append(np.asarray(tokens, dtype=np.int64))
        total += len(tokens)
        if max_tokens is not None and total >= max_tokens:
            break
    return np.concatenate(pieces)


SOURCES = ("concat", "documents")


def validation_sequences(data_dir, length, num_seqs, source="concat", separators=(EOT,), tokenizer=None):
    """(n, length + 1) int64 sequences of held-out tokens; n <= num_seqs when the split is short.
    `concat` (the official code's protocol): the validation stream with its document separators (GPT-2's
    <|endoftext|>; BOS and EOS) removed, cut into consecutive sequences; `documents`: only documents at
    least length + 1 tokens long, each from its opening separator (`separators[0]`)."""
    need = num_seqs * (length + 1)
    if source == "concat":
        # EOTs are about 1 in 700 tokens of FineWeb: read a little more than needed, then drop them
        tokens = validation_tokens(data_dir, int(need * (1.1 if len(separators) == 1 else 1.2)) + 4096, tokenizer)
        tokens = tokens[~np.isin(tokens, separators)]
        n = min(num_seqs, len(tokens) // (length + 1))
        if n == 0:
            raise EvalError(f"the validation split in {data_dir} has {len(tokens):,} tokens without separators, "
                            f"fewer than one sequence of {length + 1:,}; use a shorter --length")
        return tokens[:n * (length + 1)].reshape(n, length + 1)
    if tokenizer is not None:
        validation_tokens(data_dir, 1, tokenizer)  # the manifest's tokenizer is the run's
    sequences = []
    for path in shard_paths(data_dir, "val") if data_dir and os.path.isdir(data_dir) else []:
        tokens = read_shard(path)
        starts = np.flatnonzero(tokens == separators[0])
        ends = np.append(starts[1:], len(tokens))
        for start in starts[ends - starts >= length + 1][:num_seqs - len(sequences)]:
            sequences.append(np.asarray(tokens[start:start + length + 1], dtype=np.int64))
        if len(sequences) == num_seqs:
            break
    if not sequences:
        validation_tokens(data_dir, max_tokens=1)  # the clearer error when there are no shards at all
        raise EvalError(f"no validation document in {data_dir} has {length + 1:,} tokens or more; use a "
                        f"shorter --length or --source concat")
    return np.stack(sequences)
