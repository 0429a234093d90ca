"""Turn a text corpus into token shards (llm.c format, see bam/data.py) once; train on them many times.

    python prepare_fineweb.py --source fineweb --out_dir data/fineweb10B            # sample-10BT
    python prepare_fineweb.py --source fineweb-edu --sample sample-100BT --out_dir data/edu100B
    python prepare_fineweb.py --source hub --dataset wikimedia/wikipedia --config 20231101.en --out_dir data/wiki
    python prepare_fineweb.py --source local --input 'corpus/*.jsonl' --out_dir data/mine
    python prepare_fineweb.py --source demo --out_dir data/demo                     # offline
    python prepare_fineweb.py --source demo --retrieval_fraction 0.5 --out_dir data/demo_passkey
    python prepare_fineweb.py --source fineweb --tokenizer mistralai/Mistral-7B-v0.3 --out_dir data/fineweb10B_mistral

Sources: FineWeb / FineWeb-Edu samples streamed from the Hugging Face Hub with `datasets` (nothing
is downloaded in full first); any other text dataset streamed the same way (`--source hub` with
--dataset, --config, --split and --text_field: e.g. Wikipedia, the paper's second perplexity corpus;
--dataset may also be a local folder of data files, which `datasets` reads through the same call);
local parquet / jsonl / json files (a "text" field per record) and
txt files (one document per file), read through the same `datasets` streaming path; and `demo`, a
real English corpus that needs no network: the documentation that ships inside Python's standard
library (the language reference topics of `pydoc_data`, every stdlib module's docstrings with the
signatures they document, the prose comments of its source and IDLE's text files).
`--retrieval_fraction F` mixes synthetic passkey documents (bam/retrieval.py) into any of them, F of the
tokens; `--source retrieval` is those documents alone (bounded by --max_tokens).

--tokenizer is GPT-2 (tiktoken, the default) or any Hugging Face fast tokenizer by Hub name or local folder
(bam/tokenizer.py). Each document becomes [EOT] + its GPT-2 tokens, or [BOS] + its tokens + [EOS] with a
tokenizer that has both (empty documents are dropped); ids are uint16 (llm.c version 1) while the
vocabulary fits, uint32 (version 7) otherwise. Documents are packed
back to back into shards of --shard_size tokens (a document may continue into the next shard) and
the first shard is the validation split. Shards are written to a temp file and renamed, and a
manifest.json next to them records the source, tokenizer and every finished shard with where in the
document stream it ends, so an interrupted run started again skips the finished shards (without
re-tokenising them) and produces exactly the shards of an uninterrupted run.
"""

import argparse
import ast
import codecs
import collections
import contextlib
import gc
import glob
import hashlib
import html.parser
import itertools
import json
import multiprocessing
import os
import queue
import random
import signal
import sys
import sysconfig
import threading
import time

import numpy as np
from tqdm import tqdm

from bam import outputs
from bam.cli import Parser, UserError, describe_os_error, os_reason, usable_cores, user_errors
from bam.data import MANIFEST, SHARD_FORMATS, ShardError, shard_num_tokens, shard_version, write_shard
from bam.outputs import check_writable, write_bytes
from bam.ranges import number
from bam.retrieval import MAX_DIGITS, RetrievalDocuments, mix, text_sentences
from bam.tokenizer import GPT2, GPT2_IDENTITY, TokenizerError, TokenizerIdentity, load_tokenizer

HUB_DATASETS = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
FINEWEB_SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")
SOURCES = ("fineweb", "fineweb-edu", "hub", "demo", "local", "retrieval")
DEFAULT_SHARD_SIZE = 100_000_000  # llm.c's shard size: 200 MB of uint16 per shard
# The demo corpus is ~1M tokens; 50k-token shards give one validation shard of ~5% of it and
# ~20 training shards, so the demo also exercises the loader's crossing of shard boundaries.
DEMO_SHARD_SIZE = 50_000
RETRIEVAL_SHARD_SIZE = 2**16
LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
TOKENIZER = GPT2  # the tokenizer of this process's tokenize() calls; tokenized() sets it, forked workers inherit it
LOCK = ".lock"  # held by the prepare_fineweb.py that writes the folder (pid and host inside)
MANIFEST_KEYS = ("shards", "tokens", "finished", "exhausted")  # what every manifest of this script has had
CHUNK_DOCS = 64  # documents per chunk sent to a worker: fewer, larger messages keep the main process light
CHUNK_CHARS = 1 << 18  # ... and fewer when they are long: a chunk ends once it holds this many characters
CHUNKS_PER_WORKER = 4  # chunks in flight per worker: enough that it never waits for the main process


class PrepareError(UserError):
    """A user mistake (bad input or output directory); main() prints it as one line."""


# ----------------------------------------------------------------------------------------------
# Sources: each returns an iterable of document texts, always in the same order.

def hub_documents(dataset: str, config=None, split: str = "train", text_field: str = "text"):
    """The `text_field` of every record of a dataset streamed from the Hub (FineWeb's samples and any other
    text dataset alike; this is the only code that needs the Hub). `dataset` may also be a local folder of
    data files: `datasets` then reads it through this same call, which is how the tests run it offline."""
    import datasets
    where = f"{dataset}" + (f" ({config})" if config else "")
    try:
        ds = datasets.load_dataset(dataset, name=config, split=split, streaming=True)
    except (OSError, ConnectionError) as e:  # `datasets` retries for ~30 s before it gives up
        raise PrepareError(f"cannot stream {where} from the Hugging Face Hub "
                           f"({str(e).splitlines()[0]}); offline, use --source demo or --source local")
    except ValueError as e:  # an unknown split or config: `datasets` names the ones that exist
        raise PrepareError(f"{where}: {str(e).splitlines()[0]}")

    def texts():  # the dataset is opened above, so a wrong name fails before anything is written
        for row in ds:
            if text_field not in row:
                raise PrepareError(f"records of {where} have no {text_field!r} field (fields: {', '.join(row)}); "
                                   f"choose one with --text_field")
            yield row[text_field]
    return texts()


def resolve_inputs(patterns) -> list:
    """Expand --input globs into a sorted, de-duplicated list of supported files."""
    files = []
    for pattern in patterns:
        matches = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matches and os.path.isdir(os.path.expanduser(pattern)):
            raise PrepareError(f"--input {pattern!r} is a directory; give its files, e.g. "
                               f"'{os.path.join(pattern, '*.jsonl')}' or '{os.path.join(pattern, '**', '*.parquet')}'")
        if not matches:
            raise PrepareError(f"--input {pattern!r} matches no files")
        files += matches
    files = sorted(set(os.path.abspath(p) for p in files))
    for path in files:
        check_input_file(path)  # fail on an unsupported or unreadable file before anything is written
    return files


SNIFF_BYTES = 1 << 16


def check_input_file(path):
    """Refuse, up front and by name, a file of an unsupported type, one that cannot be read, and one whose
    start shows it is not what its name says: binary data or non-UTF-8 text in a .txt/.json(l), or a
    .parquet without parquet's magic bytes. (The rest of a file is checked as it is read.)"""
    builder = local_builder(path)
    compressed = path.lower().endswith(COMPRESSIONS)
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
            if builder == "parquet" and not compressed and os.path.getsize(path) > 0:
                f.seek(-min(4, os.path.getsize(path)), os.SEEK_END)
                tail = f.read(4)
    except OSError as e:
        raise PrepareError(f"cannot read --input file {path}: {os_reason(e)}") from None
    if compressed or not head:
        return
    if builder == "parquet":
        if not (head.startswith(b"PAR1") and tail == b"PAR1"):
            raise PrepareError(f"{path} is not a parquet file (no PAR1 magic bytes at its start and end)")
        return
    if b"\x00" in head:
        raise PrepareError(f"{path} holds binary data (NUL bytes), not {'JSON' if builder == 'json' else 'plain'} text")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. with "
                           f"iconv -t utf-8") from None


def local_builder(path: str) -> str:
    """The `datasets` builder that reads this file: parquet, json (also jsonl) or text."""
    name = path.lower()
    for compression in COMPRESSIONS:
        name = name.removesuffix(compression)
    ext = os.path.splitext(name)[1]
    if ext not in LOCAL_BUILDERS:
        raise PrepareError(f"{path}: unsupported file type {ext or '(none)'!r}; use one of "
                           f"{', '.join(LOCAL_BUILDERS)} (optionally compressed: {', '.join(COMPRESSIONS)})")
    return LOCAL_BUILDERS[ext]


def local_documents(files):
    """Texts of local files through `datasets` streaming, the same reader as the Hub path.

    Files are grouped by type (parquet, json, text, each group in sorted path order); a txt file is
    one document (`sample_by="document"`), parquet and json records need a "text" field.
    """
    files = [f for f in files if os.path.getsize(f) > 0]  # no documents, and `datasets` trips on them
    for builder in ("parquet", "json", "text"):
        for path in (f for f in files if local_builder(f) == builder):
            yield from file_documents(path, builder)


def file_documents(path, builder):
    """The texts of one local file, streamed by `datasets`; one file at a time, so that a file it cannot
    read (bad JSON, a torn parquet, invalid UTF-8 further in than check_input_file looks) is named."""
    import datasets
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True, **kwargs)
        for row in ds:
            if "text" not in row:
                raise PrepareError(f"records in {path} have no 'text' field (fields: {', '.join(row)})")
            yield row["text"]
    except UserError:
        raise
    except Exception as e:  # whatever the reader of this format raises for a malformed file
        cause = e.__cause__ or e.__context__ or e  # `datasets` wraps the reader's own error
        reason = (str(cause) or type(cause).__name__).splitlines()[0][:200]
        raise PrepareError(f"cannot read {path} as {builder}: {reason}") from None


class _HTMLText(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")
        if tag in ("p", "div", "pre", "li", "dt", "dd", "h1", "h2", "h3", "h4", "tr"):
            self.parts.append("\n")

    def handle_data(self, text):
        if not self.skip:
            self.parts.append(text)


def _module_document(path_and_module) -> str:
    """A module's documentation as pydoc would show it, then the prose comments of its source."""
    path, module = path_and_module
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # also UnicodeDecodeError: a few modules are not UTF-8
        return ""
    sections = [f"Module {module}"]
    if doc := ast.get_docstring(tree):
        sections.append(doc)

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if doc := ast.get_docstring(child):
                    sections.append(f"class {owner}{child.name}\n\n{doc}")
                visit(child, f"{owner}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if doc := ast.get_docstring(child):
                    sections.append(f"{owner}{child.name}({ast.unparse(child.args)})\n\n{doc}")

    visit(tree, "")
    # Runs of full-line comments form paragraphs; keep those that read as sentences, not the
    # commented-out code, tables and banners that also live in comments.
    paragraphs, current = [], []
    for line in source.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("#"):
            current.append(stripped.lstrip("#").strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    for paragraph in paragraphs:
        letters = sum(c.isalpha() or c == " " for c in paragraph)
        if len(paragraph.split()) >= 8 and letters >= 0.85 * len(paragraph):
            sections.append(paragraph)
    return "\n\n".join(sections) if len(sections) > 1 else ""


def demo_documents(workers: int = 1) -> list:
    """Real English that ships with every Python: the stdlib's own documentation, one doc per
    pydoc topic, module and IDLE text file, in a fixed shuffled order (so the validation shard,
    the first one, samples all kinds of text rather than only the first kind)."""
    docs = []
    try:
        from pydoc_data.topics import topics
        docs += [topics[k].strip() for k in sorted(topics)]
    except ImportError:  # some distributions package pydoc_data separately
        pass
    stdlib = sysconfig.get_paths()["stdlib"]
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                 "encodings"}  # encodings: character tables, not prose
    modules = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            idle_text = name.endswith(".txt") and "idlelib" in dirpath  # IDLE's README, NEWS, ...
            if name.endswith(".py"):
                module = os.path.relpath(path, stdlib)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules.append((path, module))
            elif idle_text or name in ("architecture.rst", "LICENSE.txt"):
                with open(path, encoding="utf-8", errors="replace") as f:
                    docs.append(f.read())
            elif name == "help.html":
                parser = _HTMLText()
                with open(path, encoding="utf-8", errors="replace") as f:
                    parser.feed(f.read())
                docs.append("".join(parser.parts))
    if workers > 1:  # parsing ~600 modules takes seconds on one core
        docs += parallel_map(_module_document, modules, workers, chunk_size=8)
    else:
        docs += map(_module_document, modules)
    docs = [d.strip() for d in docs if d.strip()]
    random.Random(0).shuffle(docs)
    return docs


# ----------------------------------------------------------------------------------------------
# Tokenisation

def token_dtype(identity) -> np.dtype:
    """uint16 while every id of the tokenizer fits (llm.c version-1 shards), else uint32 (version 7)."""
    return np.dtype(SHARD_FORMATS[shard_version(identity.vocab_size)][1].name)


def tokenize(text: str, tokenizer: str = None) -> np.ndarray:
    """The tokens of one document with its separators ([EOT] + GPT-2 tokens; [BOS] + tokens + [EOS]), as the
    tokenizer's shard dtype (empty documents give nothing). `tokenizer` defaults to TOKENIZER."""
    enc = load_tokenizer(tokenizer or TOKENIZER)
    dtype = token_dtype(enc.identity)
    if not text or text.isspace():
        return np.zeros(0, dtype=dtype)
    tokens = np.array(enc.document(text), dtype=np.uint64)
    if tokens.max() >= np.iinfo(dtype).max + 1:
        raise ValueError(f"token id {int(tokens.max())} does not fit {dtype.name}")
    return tokens.astype(dtype)


def tokenized(texts, workers: int, tokenizer: str = GPT2):
    """tokenize() over texts, in order, on `workers` processes."""
    global TOKENIZER
    TOKENIZER = tokenizer  # before the workers fork, so that they inherit it
    if workers == 1:
        yield from map(tokenize, texts)
        return
    load_tokenizer(tokenizer)  # load once here; forked workers inherit it instead of each loading it
    yield from parallel_map(tokenize, texts, workers, chunk_chars=CHUNK_CHARS)


# ----------------------------------------------------------------------------------------------
# Worker processes
#
# multiprocessing.Pool could hang for ever when a run stopped early (issue 26): its result handler stops
# reading once the pool is terminated, so a worker sending a result larger than the pipe buffer blocks
# inside the result queue's write lock, shared by all; terminate() then kills it there, and the pool's
# task-handler thread, which sends its sentinel through that queue, waits for the dead worker's lock
# while terminate() waits for the task handler. ProcessPoolExecutor fails alike when a worker dies in
# the middle of sending a result (the out-of-memory killer): its manager thread waits in recv() for
# the rest of the message. So here no lock or queue is shared at all: each worker has a pipe from the
# main process and one back, and each end of a pipe is open in one process only.

class WorkerError(PrepareError):
    """A worker process raised an exception or died (killed from outside, e.g. by the OOM killer)."""


def parallel_map(fn, items, workers: int, chunk_size: int = CHUNK_DOCS, chunk_chars=None):
    """fn(item) for every item, in order, computed on `workers` processes (a generator).

    Items go to the workers in chunks of `chunk_size` (with `chunk_chars`, a chunk also ends once the
    len() of its items adds up to that many characters), round robin, at most CHUNKS_PER_WORKER
    chunks per worker at a time, so what is in flight is bounded whatever the items are. An exception
    in fn, or a worker that dies, raises WorkerError. However this generator ends (exhausted, closed
    early, an exception here or in its consumer, Ctrl-C), its workers are gone when it has ended.

    Why nothing here can wait for ever: a pipe end is open in one process only (fork copies the open
    ends into each new worker: the main process closes the worker's ends once it has started, the
    worker closes the main process's), so a worker that dies is an end of file when the main process
    reads from it and a broken pipe when it writes to it, and a main process that dies is an end of
    file to its workers, which then exit. A send to a live worker always completes, because a thread
    in the worker does nothing but receive. A receive from the worker of the oldest chunk completes,
    because that worker computes and sends its chunks in order. And as no lock or queue is shared,
    killing the workers at any moment leaves nothing locked: stopping kills and reaps them at once.
    """
    context = multiprocessing.get_context()
    processes, to_workers, from_workers = [], [], []
    try:
        # The garbage a worker inherits by fork is this process's to finalize, not the worker's: freed there,
        # a process group an earlier caller left (a DDP model in a reference cycle) waited in its destructor
        # for threads the worker does not have, for ever, and a buffered file would be written twice. Frozen
        # objects are out of the collector's reach, in the workers too.
        gc.freeze()
        try:
            for _ in range(workers):
                tasks, to_worker = context.Pipe(duplex=False)
                from_worker, results = context.Pipe(duplex=False)
                to_workers.append(to_worker)
                from_workers.append(from_worker)
                process = context.Process(target=_worker, args=(fn, tasks, results, to_workers + from_workers),
                                          daemon=True)
                try:
                    process.start()
                    processes.append(process)
                finally:
                    tasks.close()
                    results.close()
        finally:
            gc.unfreeze()

        def send(worker, chunk):
            try:
                to_workers[worker].send(chunk)
            except OSError:  # a broken pipe: the worker is dead
                raise WorkerError(_death(processes[worker])) from None

        def receive(worker):
            try:
                # Waited for in slices: a signal (Ctrl-C, SIGTERM) goes to one of this process's threads, the
                # kernel's choice (tqdm's monitor and torch's threads are candidates), and only on this one does it
                # interrupt a blocked read; on another its handler waits for this thread to run Python again,
                # which a read blocked on a worker busy with a long document would put off as long as it lasts.
                # Between slices, the death of another worker than this one: its chunks will never come.
                while not from_workers[worker].poll(0.1):
                    dead = next((process for process in processes if not process.is_alive()), None)
                    if dead is not None:
                        raise WorkerError(_death(dead))
                ok, value = from_workers[worker].recv()
            except (EOFError, OSError):  # the worker died, perhaps in the middle of its message
                raise WorkerError(_death(processes[worker])) from None
            if not ok:
                raise WorkerError(f"{fn.__name__}() failed in a worker process: {value}")
            return value

        in_flight = collections.deque()  # the worker of each chunk sent and not yet received, oldest first
        for index, chunk in enumerate(_chunks(items, chunk_size, chunk_chars)):
            if len(in_flight) == CHUNKS_PER_WORKER * workers:
                yield from receive(in_flight.popleft())
            worker = index % workers
            send(worker, chunk)
            in_flight.append(worker)
        while in_flight:
            yield from receive(in_flight.popleft())
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.join()
        for conn in to_workers + from_workers:
            conn.close()


def _chunks(items, size: int, max_chars=None):
    """Consecutive items in lists of `size`; with max_chars, a list also ends once its texts' lengths
    add up to max_chars (one web page can be megabytes)."""
    chunk, chars = [], 0
    for item in items:
        chunk.append(item)
        if max_chars is not None and isinstance(item, str):
            chars += len(item)
        if len(chunk) == size or (max_chars is not None and chars >= max_chars):
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _worker(fn, tasks, results, inherited):
    """A worker process: fn over each chunk from `tasks`, the results sent back on `results` in order."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the main process's; it stops us
    for conn in inherited:
        conn.close()  # the main process's ends of the pipes, copied here by fork (see parallel_map)
    chunks = queue.SimpleQueue()

    def receive():
        code = 1  # anything but an end of file (no memory left for a chunk) ends the worker too, audibly
        try:
            while True:
                chunks.put(tasks.recv())
        except (EOFError, OSError):  # the main process has gone
            code = 0
        finally:
            os._exit(code)  # a worker that cannot receive must not live on deaf, or the main process waits

    threading.Thread(target=receive, daemon=True).start()
    while True:
        chunk = chunks.get()
        try:
            outcome = (True, [fn(item) for item in chunk])
        except Exception as e:
            outcome = (False, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        try:
            results.send(outcome)
        except OSError:  # the main process has gone
            os._exit(0)


def _death(process) -> str:
    """Why a worker process whose pipe broke is gone, in words."""
    process.join(timeout=10)  # it closed its pipes by dying: its exit status follows at once
    code = process.exitcode
    if code == -signal.SIGKILL:
        how = "killed by SIGKILL, as the out-of-memory killer does when memory runs out"
    elif code is not None and code < 0:
        how = f"killed by signal {-code}"
    else:
        how = f"exit status {code}"
    return f"a worker process died ({how})"


# ----------------------------------------------------------------------------------------------
# Shards and the manifest

def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def _read_manifest(out_dir: str):
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {os_reason(e)}; use another --out_dir") from None
    except ValueError as e:  # torn JSON, or not text at all
        raise PrepareError(f"{path} is not a manifest this script wrote ({e}); use another --out_dir") from None
    if not isinstance(manifest, dict):
        raise PrepareError(f"{path} is not a manifest this script wrote (not a JSON object); use another --out_dir")
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing or not isinstance(manifest["shards"], list):  # a web app's manifest.json, say: not ours to extend
        raise PrepareError(f"{path} is not a manifest this script wrote (it has no {', '.join(missing or ['shards'])})"
                           f"; use another --out_dir")
    return manifest


def _write_manifest(out_dir: str, manifest: dict):
    write_bytes(os.path.join(out_dir, MANIFEST), [json.dumps(manifest, indent=1).encode()])


def _manifest_tokenizer(manifest) -> TokenizerIdentity:
    record = manifest.get("tokenizer")
    if isinstance(record, dict):
        return TokenizerIdentity.from_dict(record)
    return GPT2_IDENTITY if record == GPT2 else TokenizerIdentity(str(record), 0, "?", 0, None)


def _check_out_dir(out_dir, manifest, *, prefix, source, shard_size, max_tokens, tokenizer=GPT2_IDENTITY):
    """Refuse to mix these shards with shards of another corpus, tokenizer or shard size."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise PrepareError(f"--out_dir {out_dir} is a file, not a directory")
    if manifest is None:
        foreign = glob.glob(os.path.join(glob.escape(out_dir), "*_train_*.bin")) + \
            glob.glob(os.path.join(glob.escape(out_dir), "*_val_*.bin"))
        if foreign:
            raise PrepareError(f"{out_dir} already holds token shards without a {MANIFEST} (e.g. "
                               f"{os.path.basename(sorted(foreign)[0])}); use an empty --out_dir")
        return
    recorded = _manifest_tokenizer(manifest)
    if recorded.sha256 != tokenizer.sha256:
        details = f" ({recorded.vocab_size:,} tokens, sha256 {recorded.sha256[:12]})" if recorded.vocab_size else ""
        raise PrepareError(f"{out_dir} holds shards of the {recorded.name!r} tokenizer{details}, not "
                           f"{tokenizer.describe()}; use another --out_dir")
    for key, value in (("source", source), ("prefix", prefix), ("shard_size", shard_size)):
        if manifest.get(key) != value:
            raise PrepareError(f"{out_dir} holds shards made with {key} {manifest.get(key)!r}, not "
                               f"{value!r}; use another --out_dir")
    if max_tokens is not None and manifest["tokens"] > max_tokens:
        raise PrepareError(f"{out_dir} already holds {manifest['tokens']} tokens, more than --max_tokens "
                           f"{max_tokens}; use another --out_dir")


def prepare(documents, out_dir, *, source: dict, prefix: str, shard_size: int,
            max_tokens=None, workers: int = 1, progress: bool = True, tokenizer: str = GPT2) -> dict:
    """Tokenise `documents` (an iterable of texts, the same on every call) into shards in out_dir, with the
    tokenizer that `tokenizer` names (tokenizer.load_tokenizer).

    Returns the manifest. Resumes after the last full shard of an earlier run on the same source;
    raises PrepareError, before writing anything, when out_dir holds incompatible shards or another
    prepare_fineweb.py writes it (OUT_DIR/.lock, held until the shards are written).
    """
    identity = load_tokenizer(tokenizer).identity
    _check_out_dir(out_dir, _read_manifest(out_dir), prefix=prefix, source=source, shard_size=shard_size,
                   max_tokens=max_tokens, tokenizer=identity)
    # refused before a shard was written: a folder it made is removed again
    with outputs.locked_folder(out_dir, LOCK, out_dir, "prepare_fineweb.py", refused=PrepareError):
        return _prepare(documents, out_dir, source=source, prefix=prefix, shard_size=shard_size,
                        max_tokens=max_tokens, workers=workers, progress=progress, tokenizer=tokenizer,
                        identity=identity)


def lock_out_dir(out_dir):
    """OUT_DIR/.lock (outputs.lock) for the rest of the process: a second run on the same folder is refused,
    as train.py's on a run dir; only the holder may remove the temp files of killed runs."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        return outputs.lock(os.path.join(out_dir, LOCK), out_dir, "prepare_fineweb.py")
    except outputs.InUse as e:
        raise PrepareError(e) from None


def _prepare(documents, out_dir, *, source: dict, prefix: str, shard_size: int,
             max_tokens=None, workers: int = 1, progress: bool = True, tokenizer: str = GPT2,
             identity: TokenizerIdentity = GPT2_IDENTITY) -> dict:
    manifest = _read_manifest(out_dir)
    _check_out_dir(out_dir, manifest, prefix=prefix, source=source, shard_size=shard_size,
                   max_tokens=max_tokens, tokenizer=identity)
    if manifest and manifest["finished"] and (manifest["exhausted"] or manifest["tokens"] == max_tokens):
        return manifest  # nothing left to do
    # Keep the finished full shards (a short last shard is rewritten once there is more to add).
    kept = []
    for shard in (manifest or {}).get("shards", []):
        path = os.path.join(out_dir, shard["name"])
        try:
            intact = os.path.exists(path) and shard_num_tokens(path) == shard["tokens"]
        except ShardError:
            intact = False
        if shard["tokens"] != shard_size or not intact:
            break
        kept.append(shard)
    end_doc, end_doc_tokens = (kept[-1]["end_doc"], kept[-1]["end_doc_tokens"]) if kept else (0, 0)
    total = sum(s["tokens"] for s in kept)
    num_docs = kept[-1]["documents"] if kept else 0
    # Temp files of a run that was killed mid-write: this run holds the lock, so no live run writes them.
    outputs.remove_stale(out_dir, f"{glob.escape(prefix)}_*.bin.tmp-*")
    outputs.remove_stale(out_dir, f"{MANIFEST}.tmp-*")
    version = shard_version(identity.vocab_size)
    magic, dtype = SHARD_FORMATS[version][0], token_dtype(identity)
    manifest = {"format": f"llm.c shards: 256 x int32 header (magic {magic}, version {version}, count), {dtype.name}",
                "tokenizer": identity.to_dict(), "eot": identity.doc_open, "source": source, "prefix": prefix,
                "shard_size": shard_size, "max_tokens": max_tokens, "finished": False,
                "exhausted": False, "tokens": total, "documents": num_docs, "shards": kept}

    buffer = np.empty(shard_size, dtype=dtype)
    filled = 0

    def finish_shard(doc_index, doc_tokens_used):
        nonlocal filled
        index = len(manifest["shards"])
        name = shard_name(prefix, index)
        if not os.path.exists(os.path.join(out_dir, MANIFEST)):
            # The manifest goes first, so a run killed right after its first shard still finds a
            # directory it recognises (and not shards of unknown origin) when it is started again.
            _write_manifest(out_dir, manifest)
        write_shard(os.path.join(out_dir, name), buffer[:filled], version)
        # Where the stream stands after this shard: documents [0, end_doc) are fully written and
        # end_doc_tokens tokens of document end_doc; a resumed run starts exactly there.
        manifest["shards"].append({"name": name, "split": "val" if index == 0 else "train",
                                   "tokens": int(filled), "end_doc": doc_index,
                                   "end_doc_tokens": doc_tokens_used, "documents": manifest["documents"]})
        manifest["tokens"] += int(filled)
        _write_manifest(out_dir, manifest)
        filled = 0

    texts = itertools.islice(iter(documents), end_doc, None)
    stopped_early, doc_index, used = False, end_doc - 1, 0
    with tqdm(total=max_tokens, initial=total, unit="tok", unit_scale=True, disable=not progress,
              desc=f"tokenizing -> {out_dir}") as bar, contextlib.closing(tokenized(texts, workers, tokenizer)) as docs:
        for doc_index, tokens in enumerate(docs, start=end_doc):
            used = end_doc_tokens if doc_index == end_doc else 0  # tokens of it in kept shards
            tokens = tokens[used:]
            if len(tokens) and used == 0:
                manifest["documents"] += 1
            while len(tokens):
                room = shard_size - filled
                if max_tokens is not None:
                    room = min(room, max_tokens - manifest["tokens"] - filled)
                taken = min(room, len(tokens))
                buffer[filled:filled + taken] = tokens[:taken]
                filled, used, tokens = filled + taken, used + taken, tokens[taken:]
                bar.update(taken)
                if filled == shard_size:
                    finish_shard(*((doc_index, used) if len(tokens) else (doc_index + 1, 0)))
                if max_tokens is not None and manifest["tokens"] + filled == max_tokens:
                    stopped_early = True
                    break
            if doc_index % 64 == 0:
                bar.set_postfix(docs=manifest["documents"], refresh=False)
            if stopped_early:
                break
        bar.set_postfix(docs=manifest["documents"])
    if filled:  # the short last shard
        finish_shard(*((doc_index, used) if stopped_early and len(tokens) else (doc_index + 1, 0)))
    if manifest["tokens"] == 0:
        raise PrepareError("the corpus is empty: no document with any text")
    manifest["finished"], manifest["exhausted"] = True, not stopped_early
    _write_manifest(out_dir, manifest)
    return manifest


# ----------------------------------------------------------------------------------------------
# Command line

def parse_args(argv=None):
    parser = Parser(prog="prepare_fineweb.py", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, choices=SOURCES,
                        help="FineWeb / FineWeb-Edu from the Hub, the offline demo corpus, or --input files")
    parser.add_argument("--sample", default=None,
                        help=f"FineWeb sample: {', '.join(FINEWEB_SAMPLES)} (default {FINEWEB_SAMPLES[0]})")
    hub = parser.add_argument_group("any text dataset on the Hub (--source hub)")
    hub.add_argument("--dataset", default=None,
                     help="dataset name on the Hub, e.g. wikimedia/wikipedia (or a local folder of data files)")
    hub.add_argument("--config", default=None, help="dataset config (subset), e.g. 20231101.en")
    hub.add_argument("--split", default=None, help="split to read (default train)")
    hub.add_argument("--text_field", default=None, help="field that holds each document's text (default text)")
    parser.add_argument("--input", nargs="+", default=None, metavar="GLOB",
                        help="local files for --source local: parquet, jsonl/json ('text' field), txt")
    parser.add_argument("--out_dir", required=True, help="directory for the shards and manifest.json")
    parser.add_argument("--shard_size", type=number(int, ">= 1"), default=None,
                        help=f"tokens per shard (default {DEFAULT_SHARD_SIZE:_}; demo {DEMO_SHARD_SIZE:_}; "
                             f"retrieval {RETRIEVAL_SHARD_SIZE:_})")
    parser.add_argument("--max_tokens", type=number(int, ">= 1"), default=None, help="stop after this many tokens")
    parser.add_argument("--workers", type=number(int, ">= 1, <= 1024"), default=None, help="tokenizer processes (default: all cores)")
    parser.add_argument("--tokenizer", default=GPT2, metavar="NAME|PATH",
                        help="gpt2 (tiktoken, default), a Hugging Face Hub tokenizer (e.g. mistralai/Mistral-7B-v0.3) "
                             "or a local folder with its tokenizer.json; train with the same data.tokenizer")
    parser.add_argument("--prefix", default=None,
                        help="shard file prefix (default fineweb, demo or local by source)")
    retrieval = parser.add_argument_group("synthetic passkey documents (bam/retrieval.py)")
    retrieval.add_argument("--retrieval_fraction", type=number(float, ">= 0, <= 1"), default=0.0,
                           help="fraction of the tokens that are passkey documents (default 0)")
    retrieval.add_argument("--retrieval_length", type=number(int, ">= 1"), default=128,
                           help="longest passkey document in tokens, e.g. the training context (default 128)")
    retrieval.add_argument("--retrieval_min_length", type=number(int, ">= 1"), default=None,
                           help="shortest passkey document (default half of --retrieval_length); equal to "
                                "it: every document is exactly that long, one per training row")
    retrieval.add_argument("--retrieval_filler", default="mixed", choices=("garbage", "text", "mixed"),
                           help="filler: the passkey garbage sentences, real demo-corpus sentences, or both")
    retrieval.add_argument("--key_digits", type=number(int, f">= 1, <= {MAX_DIGITS}"), default=5, help="digits of each pass key (default 5)")
    retrieval.add_argument("--seed", type=number(int, ">= 0, < 4294967296"), default=0, help="seed of the passkey documents")
    args = parser.parse_args(argv)
    if args.source == "retrieval":
        args.retrieval_fraction = 1.0
        if args.max_tokens is None:
            parser.error("--source retrieval is an endless stream: give --max_tokens")
    if args.retrieval_min_length is None:
        args.retrieval_min_length = args.retrieval_length // 2
    if not 1 <= args.retrieval_min_length <= args.retrieval_length:
        parser.error(f"--retrieval_min_length must be in [1, --retrieval_length={args.retrieval_length}], "
                     f"got {args.retrieval_min_length}")
    if args.source in HUB_DATASETS:
        args.sample = args.sample or FINEWEB_SAMPLES[0]
        if args.sample not in FINEWEB_SAMPLES:
            parser.error(f"unknown FineWeb sample {args.sample!r}; choose one of "
                         f"{', '.join(FINEWEB_SAMPLES)}")
    elif args.sample is not None:
        parser.error("--sample applies only to --source fineweb / fineweb-edu")
    hub_options = ("dataset", "config", "split", "text_field")
    if args.source == "hub":
        if not args.dataset:
            parser.error("--source hub needs --dataset (a dataset name on the Hub, e.g. wikimedia/wikipedia)")
        args.split, args.text_field = args.split or "train", args.text_field or "text"
    elif any(getattr(args, name) is not None for name in hub_options):
        parser.error("--dataset, --config, --split and --text_field apply only to --source hub")
    if (args.source == "local") != (args.input is not None):
        parser.error("--input is required with --source local and allowed only there")
    if args.shard_size is None:
        # Passkey shards use 2**16: a multiple of every power-of-two context, so documents of exactly
        # the context length stay aligned with training rows from one shard into the next.
        args.shard_size = {"demo": DEMO_SHARD_SIZE, "retrieval": RETRIEVAL_SHARD_SIZE}.get(args.source,
                                                                                          DEFAULT_SHARD_SIZE)
    if args.source == "hub":  # wikimedia/wikipedia -> wikipedia_val_000000.bin
        default_prefix = "".join(c if c.isalnum() or c in "-_." else "_"
                                 for c in os.path.basename(os.path.normpath(args.dataset))) or "hub"
    else:
        default_prefix = "fineweb" if args.source in HUB_DATASETS else args.source
    args.prefix = args.prefix or default_prefix
    if not args.prefix.replace("-", "").replace("_", "").replace(".", "").isalnum():
        parser.error(f"--prefix {args.prefix!r}: use letters, digits, '-', '_' or '.'")
    if args.retrieval_min_length == args.retrieval_length and args.retrieval_fraction == 1 \
            and args.shard_size % args.retrieval_length:
        # Not an error (the documents are still right), but the promise of one document per row breaks.
        print(f"warning: --shard_size {args.shard_size} is not a multiple of --retrieval_length "
              f"{args.retrieval_length}, so documents will not line up with training rows", file=sys.stderr)
    if args.workers is None:
        args.workers = usable_cores()
    return args


def passkey_mixture(documents, args):
    real = text_sentences(demo_documents(args.workers)) if args.retrieval_filler != "garbage" else ()
    try:
        synthetic = RetrievalDocuments(load_tokenizer(args.tokenizer), args.retrieval_length, args.retrieval_min_length,
                                       key_digits=args.key_digits,
                                       filler=args.retrieval_filler, real_sentences=real, seed=args.seed)
    except ValueError as e:
        raise PrepareError(e)
    # ~4 characters per token (GPT-2's; about right for any English BPE): the ratio only needs to be close
    return mix(documents, synthetic, args.retrieval_fraction, lambda text: len(text) // 4)


KEPT = "the finished shards are kept; run the same command again to resume"
INTERRUPTED = f"interrupted: {KEPT}"
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, the status of a process ended by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's time limit) stops a run the way Ctrl-C does; exit status 143."""


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c():
    """While inside, SIGTERM raises Terminated in the main thread, so the same cleanup runs as for
    Ctrl-C (the workers are stopped, the finished shards kept); a second SIGTERM cannot cut it short."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def make_shards(args):
    """The command's work: (manifest, seconds). Raises PrepareError for what the user can fix."""
    if args.source in HUB_DATASETS:
        source = {"kind": args.source, "dataset": HUB_DATASETS[args.source], "sample": args.sample}
    elif args.source == "hub":
        source = {"kind": "hub", "dataset": args.dataset, "config": args.config, "split": args.split,
                  "text_field": args.text_field}
    elif args.source == "local":
        files = resolve_inputs(args.input)
        source = {"kind": "local", "files": [[f, os.path.getsize(f)] for f in files]}
    elif args.source == "demo":
        docs = demo_documents(args.workers)
        corpus = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        source = {"kind": "demo", "python": sys.version.split()[0],
                  "sha256": hashlib.sha256(corpus).hexdigest()}
    else:
        source = {"kind": "retrieval", "python": sys.version.split()[0]}
    if args.retrieval_fraction:
        source["retrieval"] = {k: getattr(args, k) for k in ("retrieval_fraction", "retrieval_length",
                                                              "retrieval_min_length", "retrieval_filler",
                                                              "key_digits", "seed")}
    # The shards and manifest.json never go in among the inputs: a later glob over that folder would read
    # them as corpus (or refuse them), and the user's folder of text would fill with the command's files.
    inputs = files if args.source == "local" else \
        [args.dataset] if args.source == "hub" and os.path.isdir(os.path.expanduser(args.dataset)) else []
    for path in inputs:
        name = "--input file" if args.source == "local" else "--dataset"
        outputs.check_apart(os.path.expanduser(path), args.out_dir, PrepareError, name, "--out_dir")
    # Refuse an incompatible or unwritable out_dir before touching the network (a Hugging Face tokenizer's
    # shards are compared once it is loaded: only then is its hash known).
    manifest = _read_manifest(args.out_dir)
    early = GPT2_IDENTITY if args.tokenizer == GPT2 else _manifest_tokenizer(manifest) if manifest else GPT2_IDENTITY
    _check_out_dir(args.out_dir, manifest, prefix=args.prefix, source=source, shard_size=args.shard_size,
                   max_tokens=args.max_tokens, tokenizer=early)
    try:
        check_writable(args.out_dir)
    except OSError as e:
        raise PrepareError(f"{describe_os_error(e, 'cannot write shards to')} (choose another --out_dir)") from None
    if os.path.isdir(args.out_dir):  # a run may be writing it: refuse now, not after the tokenizer has loaded
        lock_out_dir(args.out_dir)
    try:
        identity = load_tokenizer(args.tokenizer).identity
    except TokenizerError as e:
        raise PrepareError(e) from None
    _check_out_dir(args.out_dir, manifest, prefix=args.prefix, source=source, shard_size=args.shard_size,
                   max_tokens=args.max_tokens, tokenizer=identity)
    if args.source in HUB_DATASETS:
        documents = hub_documents(HUB_DATASETS[args.source], args.sample)
    elif args.source == "hub":
        documents = hub_documents(args.dataset, args.config, args.split, args.text_field)
    elif args.source == "local":
        documents = local_documents(files)
    elif args.source == "retrieval":
        documents = iter(())
    else:
        # Kept next to the shards, where the text is easy to read, and tokenised through the
        # same `datasets` json reader as any local corpus.
        lock_out_dir(args.out_dir)  # before demo_corpus.jsonl is written; prepare() takes the same lock again
        corpus_path = os.path.join(args.out_dir, "demo_corpus.jsonl")
        write_bytes(corpus_path, [corpus])
        documents = local_documents([corpus_path])
    if args.retrieval_fraction:
        documents = passkey_mixture(documents, args)
    t0 = time.time()
    manifest = prepare(documents, args.out_dir, source=source, prefix=args.prefix,
                       shard_size=args.shard_size, max_tokens=args.max_tokens, workers=args.workers,
                       tokenizer=args.tokenizer)
    return manifest, time.time() - t0


def main(argv=None):
    args = parse_args(argv)
    # A full disk, an unreadable file or a worker that died is one line too (cli.user_errors); Ctrl-C and
    # SIGTERM keep the finished shards.
    with sigterm_stops_like_ctrl_c(), user_errors(interrupted=INTERRUPTED):
        try:
            manifest, seconds = make_shards(args)
        except ShardError as e:  # a shard in out_dir that is not one
            raise PrepareError(e) from None
        except WorkerError as e:
            raise PrepareError(f"{e}; {KEPT}") from e
        except Terminated:
            print(f"\n{INTERRUPTED}", file=sys.stderr)
            raise SystemExit(EXIT_TERMINATED)
    shards = manifest["shards"]
    print(f"{args.out_dir}: {manifest['tokens']:,} tokens from {manifest['documents']:,} documents in "
          f"{len(shards)} shards (1 val, {len(shards) - 1} train) [{seconds:.1f}s]")
    if len(shards) == 1:
        print(f"warning: everything fit into the validation shard; use a --shard_size below "
              f"{manifest['tokens']} to get training shards", file=sys.stderr)


if __name__ == "__main__":
    main()
