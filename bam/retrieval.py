"""
Synthetic passkey-retrieval documents for training, in the paper's passkey wording (docs/paper.md §5):
task description, filler, the information line with a random key at a random depth, the question and
the answer. The wording lives here, with the documents that train on it; `eval.passkey` builds its
prompts from the same strings, so training never has to import the evaluators.
`prepare_fineweb.py --retrieval_fraction F` mixes the documents into any corpus (a fraction F of the
tokens), so the same generator serves the CPU demo of the paper's headline (docs/repro.md) and a
FineWeb run.

Filler is the passkey garbage sentences, real sentences from a text corpus, or both (`mixed`, one
choice per document), so a model cannot solve the task by spotting the one sentence that is not
garbage.
"""

import functools
import random
import re

import torch

from bam.data import document_ids

# The paper's passkey texts, verbatim (docs/paper.md §5)
# The longest pass key: the evaluator draws keys as int64 (numpy), and 10**19 no longer is one.
MAX_DIGITS = 18

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INFO = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

FILLERS = ("garbage", "text", "mixed")
GARBAGE_SENTENCES = [s.strip() + "." for s in GARBAGE.split(".") if s.strip()]


def text_sentences(documents, min_words=4, max_words=40):
    """Plain prose sentences from real documents (code, tables and headings dropped)."""
    sentences = []
    for doc in documents:
        for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            words = s.split()
            if min_words <= len(words) <= max_words and s[0].isupper() and s[-1] in ".!?" \
                    and sum(c.isalpha() or c == " " for c in s) > 0.9 * len(s):
                sentences.append(s)
    return sentences


class RetrievalDocuments:
    """An endless, seeded stream of passkey documents of about `min_tokens` ... `max_tokens` tokens of
    `enc` (the run's tokenizer) each, counting the separators of every document in a shard (GPT-2's EOT;
    BOS and EOS) (the count is approximate: filler is added a sentence at a time).

    With `min_tokens == max_tokens` every document is exactly that many tokens: the filler is topped
    up with the first words of one more sentence. Shards of such documents, trained at a context of
    the same length, put exactly one whole document in every row of a batch (docs/repro.md). Then a
    random part of the filler (up to half) goes after the answer, so the answer does not always end
    the row: were it always at the same distance from the row's start, a model that can read absolute
    distances (RoPE) could learn that distance instead of the copy.
    """

    def __init__(self, enc, max_tokens, min_tokens=None, key_digits=5, filler="mixed", real_sentences=(),
                 seed=0):
        if filler not in FILLERS:
            raise ValueError(f"unknown retrieval filler {filler!r}; allowed: {', '.join(FILLERS)}")
        if filler != "garbage" and not real_sentences:
            raise ValueError(f"retrieval filler {filler!r} needs real text sentences")
        self.enc, self.key_digits, self.filler = enc, key_digits, filler
        self.text_tokens = max_tokens - len(enc.separators)  # of an exact document, without its separators
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens or max_tokens // 2
        self.real = list(real_sentences)
        self.rng = random.Random(seed)
        self._lengths = {}
        fixed = f"{TASK} {INFO.format(key='0' * key_digits)} {QUESTION} {'0' * key_digits}."
        # + the separators, and 3 more: keys and joins may tokenise differently
        self.overhead = self._length(fixed) + len(enc.separators) + 3
        self._zero_key = len(enc.encode_continuation(" " + "0" * key_digits))
        if self.overhead >= self.max_tokens:
            raise ValueError(f"retrieval documents of {self.max_tokens} tokens leave no room for filler: the "
                             f"task, information line, question and answer alone take {self.overhead}")

    def _length(self, sentence):
        if sentence not in self._lengths:
            self._lengths[sentence] = len(self.enc.encode_continuation(" " + sentence))
        return self._lengths[sentence]

    def document(self):
        for _ in range(1000):  # _exact() gives up on about one document in a thousand
            text = self._draw()
            if text is not None:
                return text
        raise ValueError(f"cannot fit a passkey document of {self.min_tokens}-{self.max_tokens} tokens with "
                         f"{self.key_digits}-digit keys; use longer documents or shorter keys")

    def _draw(self):
        rng = self.rng
        key = str(rng.randrange(10 ** (self.key_digits - 1), 10 ** self.key_digits))
        # The key appears three times; it may take more tokens than the all-zero key of `overhead`.
        key_extra = 3 * max(0, len(self.enc.encode_continuation(" " + key)) - self._zero_key)
        budget = rng.randint(self.min_tokens, self.max_tokens) - self.overhead - key_extra
        exact = self.min_tokens == self.max_tokens
        after = rng.randint(0, max(0, budget) // 2) if exact else 0  # filler tokens after the answer
        budget -= after
        source = self.filler if self.filler != "mixed" else rng.choice(("garbage", "text"))
        filler, used, g = [], 0, rng.randrange(len(GARBAGE_SENTENCES))
        while True:
            if source == "garbage":  # in order, as in the evaluation's repeated garbage
                sentence, g = GARBAGE_SENTENCES[g], (g + 1) % len(GARBAGE_SENTENCES)
            else:
                sentence = rng.choice(self.real)
            if used + self._length(sentence) > budget:
                break
            filler.append(sentence)
            used += self._length(sentence)
        depth = rng.randint(0, len(filler))
        body = filler[:depth] + [INFO.format(key=key)] + filler[depth:]
        text = f"{TASK} {' '.join(body)} {QUESTION} {key}."
        if not exact:
            return text
        return self._exact(text, source, g)

    def _exact(self, text, source, g):
        """`text` followed by filler up to exactly max_tokens tokens with the document's separators (GPT-2:
        max_tokens - 1 text tokens and the EOT), or None when that does not work out for this document
        (rare: then another one is drawn)."""
        missing = self.text_tokens - len(self.enc.encode_ordinary(text))
        if missing < 0:
            return None
        if missing == 0:
            return text
        # Filler cut to `missing` tokens (for garbage, going on in order). Garbage words are one token
        # each, so its prefix always re-encodes to exactly `missing` tokens; real sentences cut
        # mid-word may not, and then garbage is used instead.
        if source == "garbage":
            g = (g - 1) % len(GARBAGE_SENTENCES)  # the sentence that did not fit
        garbage = GARBAGE_SENTENCES[g:] + GARBAGE_SENTENCES[:g]
        candidates = [" ".join(garbage * (1 + missing // len(garbage)))]
        if source == "text":  # every real sentence has at least one token, most several
            candidates.insert(0, " ".join(self.rng.choice(self.real) for _ in range(missing)))
        for filler in candidates:
            tail = self.enc.decode(self.enc.encode_continuation(" " + filler)[:missing]).strip()
            topped = f"{text} {tail}"
            if len(self.enc.encode_ordinary(topped)) == self.text_tokens:
                return topped
        return None

    def __iter__(self):
        while True:
            yield self.document()


def mix(documents, synthetic, fraction, length_of):
    """Interleave `synthetic` documents into `documents` so that about `fraction` of all tokens are
    synthetic (fraction 1: only synthetic). `length_of(text)` estimates a document's tokens."""
    if fraction >= 1:
        yield from synthetic
        return
    real_tokens = synthetic_tokens = 0
    synthetic = iter(synthetic)
    for doc in documents:
        yield doc
        real_tokens += length_of(doc)
        while synthetic_tokens < fraction / (1 - fraction) * real_tokens:
            doc = next(synthetic)
            synthetic_tokens += length_of(doc)
            yield doc


@functools.lru_cache(maxsize=None)
def _patterns(enc):
    """Token ids of the two places a key is asked for, of every all-digit token and of the tokens a tokenizer
    that splits digits writes the space before a key with (" 5" -> " ", "5"; GPT-2 has none: " 5" is one)."""
    # As they read inside a document (Tokenizer.encode_continuation), where the patterns are looked for
    question = tuple(enc.encode_continuation(" " + QUESTION))  # ... The pass key is| 12345.
    remember = tuple(enc.encode_continuation(INFO.split("{key}")[1].rstrip()))  # . Remember it.| 12345 is
    specials = set(enc.separators)
    texts = [(i, enc.decode([i])) for i in range(enc.n_vocab) if i not in specials]
    digits = frozenset(i for i, text in texts if text.strip().isdigit())
    spaces = frozenset(t for d in "0123456789" for t in enc.encode_continuation(" " + d)[:-1])
    return question, remember, digits, spaces, enc.encode_continuation(".")[0]


def passkey_answer_targets(x, y, enc):
    """Targets `y` (B, T) with every position set to -1 (ignored by the loss) except the tokens of a
    passkey document that only a copy of its key can predict: the answer after "What is the pass
    key? The pass key is" (the key and its full stop), and the key repeated in the information line
    after "Remember it." (a copy over a few tokens, the same skill at a short distance).

    A target counts only when its whole document is in the row (its opening token, GPT-2's EOT or the
    BOS, is there), so the model is never asked for a key whose information line fell into the previous row.
    """
    question, remember, digits, spaces, full_stop = _patterns(enc)
    out = torch.full_like(y, -1)
    opened = document_ids(x, enc.doc_open) > 0  # a document opened at or before this position, in this row
    y_list = y.tolist()
    for pattern, then_full_stop in ((question, True), (remember, False)):
        m = len(pattern)
        if x.shape[1] < m:
            continue
        starts = (x.unfold(1, m, 1) == torch.tensor(pattern, device=x.device)).all(-1).nonzero().tolist()
        for row, start in starts:
            j = start + m - 1  # the pattern's last token: its target is the key's first token
            if not opened[row, j]:
                continue
            k = j
            if k + 1 < x.shape[1] and y_list[row][k] in spaces and y_list[row][k + 1] in digits:
                out[row, k] = y_list[row][k]  # the key's own space token, before its digits
                k += 1
            while k < x.shape[1] and y_list[row][k] in digits:
                out[row, k] = y_list[row][k]
                k += 1
            if then_full_stop and k < x.shape[1] and y_list[row][k] == full_stop:
                out[row, k] = full_stop
    return out
