"""The run's tokenizer: GPT-2 (tiktoken, the default) or any Hugging Face fast tokenizer, one interface.

    load_tokenizer("gpt2")                        # tiktoken's GPT-2, 50,257 tokens (gpt2_encoding)
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
import glob
import hashlib
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.parse
from dataclasses import asdict, dataclass

from bam.cli import UserError, error_line
from bam.outputs import write_bytes

GPT2 = "gpt2"
# The files AutoTokenizer reads for a fast tokenizer; their bytes are the tokenizer's hash, and only these
# are fetched from the Hub (never a model's weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "tokenizer.model.v3")
# How long to wait for the Hub before deciding it cannot be reached: huggingface_hub itself retries with
# back-off for a minute and more, printing each retry, before it looks for a cached copy.
HUB_PROBE_TIMEOUT_S = 5
# Text that ends a word in every tokenizer, encoded before a continuation (HFTokenizer.encode_continuation)
CONTINUATION_ANCHOR = "\n"  # ids below this fit llm.c's version-1 (uint16) shards


# ----------------------------------------------------------------------------------------------
# GPT-2 through tiktoken: its ranks online, from a local file, or from the PyPI package that ships them

# The GPT-2 ranks as OpenAI ship them in `gpt2.tiktoken`; byte-identical to tiktoken's r50k_base
# file, so this is also the hash tiktoken itself checks that download against.
EOT = 50256  # GPT-2's <|endoftext|>; llm.c writes it *before* every document
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# An sdist on PyPI that carries `whisper/assets/gpt2.tiktoken`: the offline route needs only the
# package registry, which every machine that can `pip install -r requirements.txt` can reach.
WHISPER_SDIST = "openai-whisper==20250625"
# GPT-2's pre-tokenisation regex, identical to tiktoken_ext.openai_public.r50k_pat_str
# (tests/test_data.py pins the equality, so a tiktoken change cannot silently alter our tokens).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
HELLO_WORLD_IDS = [15496, 995]
# tiktoken's own route downloads with `requests` and no timeout: on a network that drops packets
# instead of refusing them that would hang for minutes, so we stop waiting after this long.
TIKTOKEN_ONLINE_TIMEOUT_S = 30


def gpt2_tiktoken_cache_path() -> str:
    """Where the offline route keeps gpt2.tiktoken; $BAM_GPT2_TIKTOKEN overrides it."""
    if os.environ.get("BAM_GPT2_TIKTOKEN"):
        return os.environ["BAM_GPT2_TIKTOKEN"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "bam", "gpt2.tiktoken")


def _check_encoding(enc, origin: str):
    ids = enc.encode_ordinary("Hello world")
    if ids != HELLO_WORLD_IDS or enc.n_vocab != 50257 or enc.eot_token != EOT:
        raise RuntimeError(f"the GPT-2 tokenizer from {origin} is wrong: 'Hello world' -> {ids}, "
                           f"n_vocab {enc.n_vocab}, eot {enc.eot_token} (expected {HELLO_WORLD_IDS}, "
                           f"50257, {EOT})")
    return enc


def load_gpt2_from_file(path: str):
    """GPT-2 tiktoken Encoding from a local gpt2.tiktoken ranks file, checked before use."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:  # a directory, or a file this user cannot read
        raise RuntimeError(f"cannot read the GPT-2 ranks file {path}: {e.strerror or e}") from None
    if digest != GPT2_TIKTOKEN_SHA256:
        raise RuntimeError(f"{path} is not OpenAI's gpt2.tiktoken (sha256 {digest}, expected "
                           f"{GPT2_TIKTOKEN_SHA256}); delete it and run again")
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=load_tiktoken_bpe(path),
                            special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)
    return _check_encoding(enc, path)


def download_gpt2_tiktoken(path: str) -> str:
    """Fetch gpt2.tiktoken from the openai-whisper sdist on PyPI (via pip, so through the index, proxy and
    find-links that pip is configured with) into `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        # The sdist alone, not its build requirements: setuptools may come as a wheel to read its metadata.
        args = ["download", "--quiet", "--no-deps", "--no-binary", WHISPER_SDIST.split("==")[0], WHISPER_SDIST]
        proc = subprocess.run([sys.executable, "-m", "pip", *args, "-d", tmp], capture_output=True, text=True,
                              timeout=600)
        sdists = glob.glob(os.path.join(tmp, "*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()] or ["no output"]
            errors = [line for line in lines if line.startswith("ERROR:")]  # pip's reason, not its closing note
            raise RuntimeError(f"`pip {' '.join(args)}` failed: {(errors or lines)[-1]}")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken")),
                          None)
            if member is None:
                raise RuntimeError(f"{os.path.basename(sdists[0])} has no whisper/assets/gpt2.tiktoken")
            ranks = tar.extractfile(member).read()
    if hashlib.sha256(ranks).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise RuntimeError(f"gpt2.tiktoken in {WHISPER_SDIST} has an unexpected sha256")
    write_bytes(path, [ranks])
    return path


def gpt2_ranks_by_hand(path: str) -> str:
    """How to put GPT-2's ranks at `path` without this machine reaching PyPI: the fix every failure names."""
    return (f"on any machine run `pip download --no-deps --no-binary :all: {WHISPER_SDIST}`, take "
            f"whisper/assets/gpt2.tiktoken out of the tarball and put it at {path} (or point $BAM_GPT2_TIKTOKEN "
            f"at it)")


def _tiktoken_online():
    """tiktoken's usual route (its cache or the network), given up on after a timeout."""
    import tiktoken

    result = {}

    def load():
        try:
            result["enc"] = tiktoken.get_encoding("gpt2")
        except Exception as e:  # any failure just means "try the offline route"
            result["error"] = e

    # A daemon thread, because a hung download cannot be cancelled, only abandoned.
    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(TIKTOKEN_ONLINE_TIMEOUT_S)
    if "enc" in result:
        return _check_encoding(result["enc"], "tiktoken")
    raise RuntimeError(str(result.get("error", f"no answer within {TIKTOKEN_ONLINE_TIMEOUT_S}s")))


def _fetched_on_first_use(path):
    print(f"fetching GPT-2 ranks: pip download {WHISPER_SDIST} (sdist) -> {path}", file=sys.stderr)
    return load_gpt2_from_file(download_gpt2_tiktoken(path))


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """tiktoken's GPT-2 Encoding (50257 tokens, EOT = 50256), online or from local ranks: what
    GPT2Tokenizer wraps. Everything else gets GPT-2 from load_tokenizer("gpt2").

    Order: a local gpt2.tiktoken when one exists (the same ranks, checked by sha256, and no network
    call that could hang); tiktoken's own download or cache; else fetch gpt2.tiktoken from PyPI
    (the openai-whisper sdist) into the local cache, so every later call is offline. The set-up step,
    `python -m bam.fetch`, takes that last route ahead of time, and the tests read only the local file.
    """
    path = gpt2_tiktoken_cache_path()
    if os.environ.get("BAM_GPT2_TIKTOKEN") and not os.path.exists(path):
        raise RuntimeError(f"$BAM_GPT2_TIKTOKEN points to {path}, which does not exist")
    if os.path.exists(path):
        return load_gpt2_from_file(path)
    errors = []
    for route in (_tiktoken_online, lambda: _fetched_on_first_use(path)):
        try:
            return route()
        except Exception as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise RuntimeError(
        "cannot load the GPT-2 tokenizer: tiktoken's download failed (" + errors[0] + ") and so did the "
        "offline route (" + errors[1] + "). Fix: " + gpt2_ranks_by_hand(path))


# ----------------------------------------------------------------------------------------------
# The Tokenizer interface

class TokenizerError(UserError, RuntimeError):
    """A tokenizer that cannot be loaded or used; the message is one line that says what to do (a UserError:
    every command prints it as its one `error:` line)."""


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


GPT2_IDENTITY = TokenizerIdentity(GPT2, 50257, GPT2_TIKTOKEN_SHA256, EOT, None)


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
    """tiktoken's GPT-2 Encoding (gpt2_encoding: online or from local ranks), unchanged."""

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
            raise TokenizerError(f"cannot load the tokenizer {name!r} from {folder}: {error_line(e, limit=300)}") \
                from None
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
def load_tokenizer(name=GPT2):
    """The Tokenizer `name` names: "gpt2", a local folder, or a Hugging Face Hub name (fast tokenizers only).
    Raises TokenizerError with one line."""
    if not isinstance(name, str) or not name.strip():
        raise TokenizerError(f"a tokenizer is 'gpt2', a Hugging Face Hub name or a local folder, got {name!r}")
    if name == GPT2:
        try:
            return GPT2Tokenizer(gpt2_encoding())
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


def tokenizer_identity(name):
    """The TokenizerIdentity of the tokenizer `name` names; GPT-2's without loading tiktoken (only what reads
    text needs it)."""
    return GPT2_IDENTITY if name == GPT2 else load_tokenizer(name).identity


def load_run_tokenizer(name, recorded_sha256=None, vocab_size=None, where="the run"):
    """The Tokenizer a run was trained with, checked: the one place every consumer of a run's tokenizer
    (the evaluators, sample.py, export_hf.py) loads it. TokenizerError, one line, for a tokenizer that
    cannot be loaded, for one whose files changed since training (its sha256 is not the one recorded), and
    for one with ids past the model's vocabulary (`vocab_size`)."""
    try:
        enc = load_tokenizer(name)
    except TokenizerError as e:
        raise TokenizerError(f"the run's tokenizer: {e}") from None
    if recorded_sha256 and recorded_sha256 != enc.identity.sha256:
        raise TokenizerError(f"the run was trained with the tokenizer {name!r} of sha256 {recorded_sha256[:12]}, but "
                             f"{name!r} now loads one of sha256 {enc.identity.sha256[:12]}: its files changed; "
                             f"restore them")
    too_small = check_vocab(vocab_size, enc.identity, "the model's vocab_size") if vocab_size else None
    if too_small:
        raise TokenizerError(f"{where}: {too_small}")  # where: the checkpoint
    return enc
