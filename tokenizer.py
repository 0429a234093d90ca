"""The run's tokenizer: GPT-2 (tiktoken, the default) or any Hugging Face fast tokenizer, one interface.

    load_tokenizer("gpt2")                        # tiktoken's GPT-2, 50,257 tokens (data.get_tokenizer)
    load_tokenizer("mistralai/Mistral-7B-v0.3")   # the paper's, 32,768 tokens (docs/paper.md §4)
    load_tokenizer("path/to/folder")              # a folder with tokenizer.json (or what AutoTokenizer reads)

Every consumer (prepare_fineweb.py, the loader, train.py, the evaluators, sample.py, export_hf.py,
eval.downstream) goes through the `Tokenizer` below, whose method names are tiktoken's (`encode_ordinary`,
`decode`, `decode_single_token_bytes`, `n_vocab`), so GPT-2 runs through the very calls it always has.

Documents are separated as the tokenizer's own models expect (docs/training.md, "Tokenizers"):
    GPT-2, and any tokenizer with one special token for both ends: that token before every document
        ([EOT] doc), as llm.c writes GPT-2 shards;
    a tokenizer with distinct BOS and EOS tokens (Mistral, Llama): [BOS] doc [EOS], the paper's convention.
A document therefore opens with `doc_open`, and the loader's document ids count those.

`identity` is what the shards' manifest and every checkpoint record: the name, the vocabulary size, the
separators and a sha256 of the tokenizer's files (for GPT-2: of OpenAI's gpt2.tiktoken ranks), so shards
of another tokenizer are refused by content, whatever name or folder the tokenizer was loaded from.
"""

import functools
import hashlib
import os
import socket
import urllib.parse
from dataclasses import asdict, dataclass

GPT2 = "gpt2"
# The files AutoTokenizer reads for a fast tokenizer; their bytes are the tokenizer's hash, and only these
# are fetched from the Hub (never a model's weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "tokenizer.model.v3")
# How long to wait for the Hub before deciding it cannot be reached: huggingface_hub itself retries with
# back-off for a minute and more, printing each retry, before it looks for a cached copy.
HUB_PROBE_TIMEOUT_S = 5
UINT16_VOCAB = 2 ** 16
# Text that ends a word in every tokenizer, encoded before a continuation (HFTokenizer.encode_continuation)
CONTINUATION_ANCHOR = "\n"  # ids below this fit llm.c's version-1 (uint16) shards


class TokenizerError(RuntimeError):
    """A tokenizer that cannot be loaded or used; the message is one line that says what to do."""


@dataclass(frozen=True)
class TokenizerIdentity:
    name: str  # as given: "gpt2", a hub name or a folder
    vocab_size: int  # every id is below it
    sha256: str  # of the tokenizer's files: what two tokenizers are compared by
    doc_open: int  # the token before every document
    doc_close: int | None  # the token after every document, or None

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(**{k: values.get(k) for k in cls.__dataclass_fields__})

    def describe(self):
        return f"{self.name!r} ({self.vocab_size:,} tokens, sha256 {self.sha256[:12]})"


def _gpt2_identity():
    from data import EOT, GPT2_TIKTOKEN_SHA256

    return TokenizerIdentity(GPT2, 50257, GPT2_TIKTOKEN_SHA256, EOT, None)


GPT2_IDENTITY = _gpt2_identity()


class Tokenizer:
    """A tokenizer as this repository uses it. `encode_ordinary` reads special-token text ("<|endoftext|>",
    "</s>") as ordinary text, so a document can never inject a separator."""

    identity: TokenizerIdentity

    @property
    def name(self):
        return self.identity.name

    @property
    def n_vocab(self):
        return self.identity.vocab_size

    @property
    def doc_open(self):
        return self.identity.doc_open

    @property
    def doc_close(self):
        return self.identity.doc_close

    @property
    def separators(self):
        """The separator tokens (dropped where text is concatenated across documents)."""
        return tuple(t for t in (self.doc_open, self.doc_close) if t is not None)

    def encode_continuation(self, text):
        """The tokens `text` adds inside a document, after other text (a slot of a prompt template, a sentence
        of filler). GPT-2's BPE and byte-level BPEs: encode_ordinary(text). A SentencePiece-style tokenizer
        (Llama 2, Mistral) puts a word boundary before any text it encodes on its own, which mid-document
        would be a space that is not there; see HFTokenizer."""
        return self.encode_ordinary(text)

    def document(self, text):
        """The tokens of one document in the token stream, separators included."""
        close = [] if self.doc_close is None else [self.doc_close]
        return [self.doc_open] + self.encode_ordinary(text) + close

    def decode_single_token_bytes(self, i):
        return self.decode([i]).encode("utf-8")


class GPT2Tokenizer(Tokenizer):
    """tiktoken's GPT-2 Encoding (data.get_tokenizer: online or from local ranks), unchanged."""

    def __init__(self, enc):
        self.enc, self.identity = enc, GPT2_IDENTITY

    def encode_ordinary(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(ids)

    def decode_single_token_bytes(self, i):
        return self.enc.decode_single_token_bytes(i)


class HFTokenizer(Tokenizer):
    """A `transformers` fast tokenizer read from a folder (a hub name is first resolved to one)."""

    def __init__(self, name, folder):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # prepare_fineweb forks its own workers
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
        except ImportError:
            raise TokenizerError("a Hugging Face tokenizer needs transformers: pip install -r requirements.txt") \
                from None
        try:
            hf = AutoTokenizer.from_pretrained(folder, use_fast=True)
        except Exception as e:  # a folder without tokenizer files, a torn tokenizer.json, ...
            reason = (str(e) or type(e).__name__).splitlines()[0][:200]
            raise TokenizerError(f"cannot load the tokenizer {name!r} from {folder}: {reason}") from None
        if not isinstance(hf, PreTrainedTokenizerFast):
            raise TokenizerError(f"the tokenizer {name!r} is a slow ({type(hf).__name__}) tokenizer; only fast "
                                 f"tokenizers (a tokenizer.json) are supported")
        self.hf, self.folder = hf, folder
        self.backend = hf.backend_tokenizer
        # Special tokens inside a document's text are text: the separators come only from document().
        self.backend.encode_special_tokens = True
        vocab_size = max(max(hf.get_vocab().values()) + 1, len(hf))
        bos, eos = hf.bos_token_id, hf.eos_token_id
        if bos is None and eos is None:
            raise TokenizerError(f"the tokenizer {name!r} has neither a BOS nor an EOS token, so documents "
                                 f"cannot be separated; use a tokenizer that has one")
        if bos is not None and eos is not None and bos != eos:
            doc_open, doc_close = bos, eos
        else:
            doc_open, doc_close = (bos if bos is not None else eos), None
        self.identity = TokenizerIdentity(name, vocab_size, files_sha256(folder), doc_open, doc_close)
        # Does encoding text on its own add a word boundary (Metaspace's prepended "▁")? Then a continuation
        # is encoded after an anchor whose tokens are cut off again.
        self._anchor = self.encode_ordinary(CONTINUATION_ANCHOR)
        self._prepends = self._continued("a") != self.encode_ordinary("a")

    def _continued(self, text):
        ids = self.encode_ordinary(CONTINUATION_ANCHOR + text)
        n = len(self._anchor)
        return ids[n:] if ids[:n] == self._anchor else None

    def encode_continuation(self, text):
        if self._prepends:
            ids = self._continued(text)
            if ids is not None:
                return ids
        return self.encode_ordinary(text)

    def encode_ordinary(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.backend.decode(list(ids), skip_special_tokens=False)


def files_sha256(folder):
    """sha256 over the tokenizer files in `folder` (name, size and bytes of each, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def hub_reachable(timeout=HUB_PROBE_TIMEOUT_S):
    """Whether a TCP connection to the Hub opens within `timeout` seconds (no request is made). Behind a proxy
    the Hub is not reached directly, so then the answer is yes and huggingface_hub finds out itself."""
    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_folder(name):
    """The local folder of hub tokenizer `name`: the cached snapshot of its tokenizer files, fetched first
    when the Hub can be reached. One TokenizerError line otherwise."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        raise TokenizerError("a Hugging Face tokenizer needs huggingface_hub: pip install -r requirements.txt") \
            from None
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or not hub_reachable()
    fix = (f"give data.tokenizer / --tokenizer a local folder with its tokenizer.json, or fetch it once on a "
           f"machine with network (`hf download {name} {' '.join(TOKENIZER_FILES[:3])}`) and set HF_HUB_OFFLINE=1")
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # no retry messages before our one line
    try:
        return snapshot_download(name, allow_patterns=list(TOKENIZER_FILES), local_files_only=offline)
    except Exception as e:
        kind = type(e).__name__
        if "Gated" in kind:
            raise TokenizerError(f"the Hub tokenizer {name!r} is gated: accept its terms on huggingface.co and "
                                 f"log in (`hf auth login`), or {fix}") from None
        if "RepositoryNotFound" in kind:
            raise TokenizerError(f"no tokenizer {name!r} on the Hugging Face Hub (and no local folder of that "
                                 f"name); check the name") from None
        where = "the Hub cannot be reached and there is no cached copy" if offline else \
            f"fetching it failed ({(str(e) or kind).splitlines()[0][:120]})"
        raise TokenizerError(f"cannot load the tokenizer {name!r}: {where}; {fix}") from None
    finally:
        hub_logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=None)
def as_tokenizer(enc):
    """`enc` as a Tokenizer: itself, or tiktoken's GPT-2 Encoding (what data.get_tokenizer returns) wrapped."""
    return enc if isinstance(enc, Tokenizer) else GPT2Tokenizer(enc)


@functools.lru_cache(maxsize=None)
def load_tokenizer(name=GPT2):
    """The Tokenizer `name` names: "gpt2", a local folder, or a Hugging Face Hub name (fast tokenizers only).
    Raises TokenizerError with one line."""
    if not isinstance(name, str) or not name.strip():
        raise TokenizerError(f"a tokenizer is 'gpt2', a Hugging Face Hub name or a local folder, got {name!r}")
    if name == GPT2:
        from data import get_tokenizer

        try:
            return as_tokenizer(get_tokenizer())
        except RuntimeError as e:
            raise TokenizerError(str(e)) from None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return HFTokenizer(name, path)
    if os.path.exists(path):
        raise TokenizerError(f"the tokenizer {name!r} is a file; give the folder that holds its tokenizer.json")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        raise TokenizerError(f"no tokenizer folder {name!r}; give 'gpt2', a Hugging Face Hub name "
                             f"(e.g. mistralai/Mistral-7B-v0.3) or an existing folder")
    return HFTokenizer(name, hub_folder(name))


def check_vocab(vocab_size, identity, what="model.vocab_size"):
    """None, or the one line that says a model of `vocab_size` cannot hold every id of the tokenizer."""
    if vocab_size < identity.vocab_size:
        return (f"{what} = {vocab_size:,} cannot hold every id of the tokenizer {identity.describe()}; use "
                f"{identity.vocab_size:,} or more (or leave model.vocab_size unset: it follows the tokenizer)")
    return None


def shard_version(vocab_size):
    """The llm.c shard version whose token width holds ids below vocab_size: 1 (uint16) or 7 (uint32)."""
    from data import SHARD_VERSION_UINT16, SHARD_VERSION_UINT32

    return SHARD_VERSION_UINT16 if vocab_size <= UINT16_VOCAB else SHARD_VERSION_UINT32
