"""
Synthetic passkey-retrieval documents for training, in the passkey evaluation's own words
(PAPER.md §5): task description, filler, the information line with a random key at a random depth,
the question and the answer. `prepare_fineweb.py --retrieval_fraction F` mixes them into any corpus
(a fraction F of the tokens), so the same generator serves the CPU demo of the paper's headline
(docs/repro.md) and a FineWeb run.

Filler is the passkey garbage sentences, real sentences from a text corpus, or both (`mixed`, one
choice per document), so a model cannot solve the task by spotting the one sentence that is not
garbage.
"""

import random
import re

from eval.passkey import GARBAGE, INFO, QUESTION, TASK

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
    """An endless, seeded stream of passkey documents of about `min_tokens` ... `max_tokens` GPT-2
    tokens each (the count is approximate: filler is added a sentence at a time)."""

    def __init__(self, enc, max_tokens, min_tokens=None, key_digits=5, filler="mixed", real_sentences=(),
                 seed=0):
        if filler not in FILLERS:
            raise ValueError(f"unknown retrieval filler {filler!r}; allowed: {', '.join(FILLERS)}")
        if filler != "garbage" and not real_sentences:
            raise ValueError(f"retrieval filler {filler!r} needs real text sentences")
        self.enc, self.key_digits, self.filler = enc, key_digits, filler
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens or max_tokens // 2
        self.real = list(real_sentences)
        self.rng = random.Random(seed)
        self._lengths = {}
        fixed = f"{TASK} {INFO.format(key='0' * key_digits)} {QUESTION} {'0' * key_digits}."
        self.overhead = self._length(fixed) + 4  # +EOT, and keys and joins may tokenise differently
        if self.overhead >= self.max_tokens:
            raise ValueError(f"retrieval documents of {self.max_tokens} tokens leave no room for filler: the "
                             f"task, information line, question and answer alone take {self.overhead}")

    def _length(self, sentence):
        if sentence not in self._lengths:
            self._lengths[sentence] = len(self.enc.encode_ordinary(" " + sentence))
        return self._lengths[sentence]

    def document(self):
        rng = self.rng
        key = str(rng.randrange(10 ** (self.key_digits - 1), 10 ** self.key_digits))
        budget = rng.randint(self.min_tokens, self.max_tokens) - self.overhead
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
        return f"{TASK} {' '.join(body)} {QUESTION} {key}."

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
