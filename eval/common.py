"""What every evaluator shares: loading a model for inference, lengths, teacher-forced scoring within the
memory available, and writing results.

Memory is the constraint that shapes the evaluators. A forward pass at 256K tokens must stay O(T): the
model never builds a T x T matrix on its fused path, and asks the LM head only for the positions that are
scored (`last_k`), so a passkey sample at any length costs a few activations of T x n_embd per layer.
Before each length we estimate that cost and compare it with the memory free right now, so a length that
cannot fit stops the sweep with one clear line instead of taking the machine down, and what was measured
up to there is already on disk.
"""

import dataclasses
import functools
import json
import math
import os
import re
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import matplotlib

matplotlib.use("Agg")  # files only; no display on clusters

import numpy as np
import torch
from tqdm import tqdm

from checkpoint import CheckpointError, atomic_file, check_writable, find_checkpoint, load_checkpoint, write_text
from cli import Parser, UserError, WriteError, describe_os_error, os_reason, run_cli  # noqa: F401  (the evaluators' command lines)
from config import SHAPE_FREE_MODEL_KEYS, ConfigError, parse_model_override
from data import EOT
from model import model_from_checkpoint

SCHEMA_VERSION = 1


class EvalError(UserError):
    """A mistake the user can fix; run_cli turns it into one `error: ...` line."""


class OutOfMemory(Exception):
    """A length that does not fit in the memory available; the sweep stops and keeps its results."""


# ---------------------------------------------------------------------------------------------------
# Lengths: token counts ("4096", "16K" = 16,384, "1M") or multiples of the training context ("2x").

def parse_length(text, block_size):
    spec = text.strip().lower().replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]|x)?", spec)
    if not m:
        raise EvalError(f"cannot read the length {text!r}; use token counts (4096, 16K = 16384, 1M) or "
                        f"multiples of the training context (0.5x, 2x, 500x)")
    n = float(m[1]) * {None: 1, "k": 1024, "m": 1024 ** 2, "x": block_size}[m[2]]
    if n < 1:
        raise EvalError(f"length {text!r} is less than one token")
    return int(round(n))


def parse_lengths(spec, block_size, max_factor=None):
    """Explicit lengths plus, with max_factor, the training context times 1, 2, 4, ... up to max_factor."""
    lengths = {parse_length(t, block_size) for t in (spec or "").split(",") if t.strip()}
    if max_factor is not None:
        if max_factor < 1:
            raise EvalError(f"--max_factor must be at least 1, got {max_factor}")
        factor = 1
        while factor < max_factor:
            lengths.add(block_size * factor)
            factor *= 2
        lengths.add(int(round(block_size * max_factor)))
    if not lengths:
        raise EvalError("no lengths to evaluate: give --lengths and/or --max_factor")
    return sorted(lengths)


def format_length(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


# ---------------------------------------------------------------------------------------------------
# Models

def add_model_args(parser, out=True, window_flag=True):
    """--device, --dtype, the model overrides and --out. `window_flag`: --window may also name the
    attention window (eval.perplexity keeps --window for its own windows; --attn_window always works)."""
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto = bfloat16 on a GPU that has it, float32 on CPU")
    parser.add_argument("--attn_impl", default=None, choices=["auto", "flex", "sdpa", "eager"],
                        help="override the checkpoint's attention implementation (default: keep it; "
                             "auto uses FlexAttention, O(T) memory, for long prompts)")
    parser.add_argument("--attn_window", *(["--window"] if window_flag else []), dest="attn_window", type=int,
                        default=None, help="sliding-window attention over the last W tokens (= --model.attn_window=W)")
    parser.add_argument("--rope_scaling", default=None,
                        help="RoPE context extension, e.g. yarn (= --model.rope_scaling=...)")
    parser.add_argument("--rope_factor", default=None,
                        help="RoPE scaling factor, or auto: evaluated length / training context, per length")
    if out:
        parser.add_argument("--out", default=None,
                            help="output folder (default: RUN/eval, or eval/<name>/ next to a checkpoint file)")
    parser.epilog = (f"Any model setting that leaves the weights' shapes alone may be overridden as --model.key=value "
                     f"({', '.join(SHAPE_FREE_MODEL_KEYS)}); results then go to a file named after the overrides.")


def parse_eval_args(parser, argv):
    """parser.parse_args, plus the model overrides (--window, --rope_scaling, --rope_factor and any
    --model.key=value) gathered into args.model_overrides."""
    args, extra = parser.parse_known_args(argv)
    generic = [a for a in extra if a.startswith("--model.")]
    if len(generic) < len(extra):
        parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a not in generic)}")
    overrides = {}
    for arg in generic:
        key, _, raw = arg.removeprefix("--model.").partition("=")
        if key == "rope_factor" and raw.strip().lower() == "auto":
            overrides[key] = "auto"
            continue
        try:
            key, value = parse_model_override(arg)
        except ConfigError as e:
            raise EvalError(str(e)) from None
        overrides[key] = value
    for key, value in (("attn_window", args.attn_window), ("rope_scaling", args.rope_scaling),
                       ("rope_factor", args.rope_factor)):
        if value is not None:
            overrides[key] = value
    if args.attn_impl:  # the two spellings of one setting
        overrides["attn_impl"] = args.attn_impl
    args.attn_impl = overrides.pop("attn_impl", None)
    args.model_overrides = check_overrides(overrides)
    return args


def check_overrides(overrides):
    """The evaluator's model overrides, checked: shape-free keys only, rope_factor a number or "auto"."""
    overrides = dict(overrides or {})
    for key in overrides:
        if key not in SHAPE_FREE_MODEL_KEYS:
            raise EvalError(f"model.{key} cannot be overridden on a trained model (it changes or adds weights); "
                            f"allowed: {', '.join(SHAPE_FREE_MODEL_KEYS)}")
    factor = overrides.get("rope_factor")
    if factor is not None and factor != "auto":
        try:
            overrides["rope_factor"] = float(factor)
        except (TypeError, ValueError):
            raise EvalError(f"--rope_factor {factor!r}: use a number (16) or auto") from None
        if not overrides["rope_factor"] > 0:
            raise EvalError(f"--rope_factor must be greater than 0 (or auto), got {factor}")
    if overrides.get("attn_window") is not None and overrides["attn_window"] < 0:
        raise EvalError(f"--window must be 0 (off) or a number of tokens, got {overrides['attn_window']}")
    return overrides


def overrides_suffix(overrides):
    """The part of a results file's name that tells overridden evaluations apart from the plain one:
    {"rope_scaling": "yarn", "rope_factor": 16} -> "yarn_x16", {"attn_window": 512} -> "window512",
    "auto" -> "yarn_auto"; other keys as key + value. "" without overrides."""
    rest, parts = dict(overrides or {}), []
    if "rope_scaling" in rest or "rope_factor" in rest:
        scaling, factor = rest.pop("rope_scaling", "rope"), rest.pop("rope_factor", None)
        parts.append(scaling + ("" if factor is None else "_auto" if factor == "auto" else f"_x{plain_number(factor)}"))
    if "attn_window" in rest:
        parts.append(f"window{rest.pop('attn_window')}")
    parts += [f"{key}{plain_number(value)}" for key, value in sorted(rest.items())]
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", "_".join(parts))


def plain_number(value):
    """16.0 -> 16, 1e6 -> 1000000, 2.5 -> 2.5; anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


SCALING_NAMES = {"yarn": "YaRN", "ntk": "NTK", "dynamic_ntk": "dynamic NTK", "linear": "PI", "pi": "PI"}  # as papers write them


def overrides_label(config, overrides):
    """How a report names an evaluation of a model (its `config` dict) with model overrides: "rope + YaRN x16",
    "rope + YaRN auto", "rope-local (W=512)"; other overridden keys follow in the brackets as key=value. A factor
    given alone scales by the model's own method (a run fine-tuned with YaRN), so it is named after it."""
    rest = dict(overrides or {})
    window, scaling, factor = rest.pop("attn_window", 0), rest.pop("rope_scaling", None), rest.pop("rope_factor", None)
    if factor is not None and scaling is None:
        scaling = config.get("rope_scaling")
    label = f"{config.get('pe', '?')}{'-local' if window else ''}{' + ssmax' if config.get('ssmax') else ''}"
    if scaling and scaling != "none":
        label += f" + {SCALING_NAMES.get(scaling, scaling)}"
    if factor is not None:
        label += " auto" if factor == "auto" else f" x{plain_number(factor)}"
    details = ([f"W={window}"] if window else []) + [f"{k}={plain_number(v)}" for k, v in sorted(rest.items())]
    return label + (f" ({', '.join(details)})" if details else "")


def evaluated_name(results):
    """The model's name in an evaluator's table and plot title, with its overrides when there are any."""
    overrides = results["settings"].get("model_overrides")
    config = results["model"].get("config") or {}
    label = f" as {overrides_label(config, overrides)}" if overrides else ""
    return results["model"]["name"] + label


def results_name(default, overrides):
    suffix = overrides_suffix(overrides)
    return f"{default}_{suffix}" if suffix else default


def apply_overrides(model, overrides):
    """Set the overrides on model.config (the model reads it at every forward), checked by ModelConfig
    itself; an "auto" rope_factor waits for set_length. Returns the model."""
    cfg = getattr(model, "config", None)
    if overrides and cfg is None:
        raise EvalError("model overrides need a model with a config (a run directory or checkpoint)")
    fixed = {k: v for k, v in (overrides or {}).items() if v != "auto"}
    if fixed:
        try:
            dataclasses.replace(cfg, **fixed)  # the same checks as a config file's values
        except (TypeError, ValueError) as e:
            raise EvalError(str(e)) from None
        for key, value in fixed.items():
            setattr(cfg, key, value)
    if (overrides or {}).get("rope_factor") == "auto":
        # set_length writes the factor later, past ModelConfig's checks, so they are made here.
        if cfg.rope_scaling == "none":
            raise EvalError("--rope_factor auto needs a RoPE scaling method: add --rope_scaling linear, ntk or yarn")
        if cfg.rope_scaling == "dynamic_ntk":
            raise EvalError("--rope_factor auto would scale dynamic_ntk twice (it already grows its scale with the "
                            "length); give a number, 1 for the plain dynamic rule")
    return model


def set_length(model, overrides, length, context):
    """Before evaluating `length` tokens: an "auto" rope_factor becomes length / the training context
    (`context`, or model.rope_original_context when set; at least 1: shorter lengths run unscaled), the
    usual way context-extension methods are compared. Returns the settings that depend on the length,
    for that length's results row ({} when none does)."""
    if (overrides or {}).get("rope_factor") != "auto":
        return {}
    cfg = model.config
    factor = max(1.0, length / (cfg.rope_original_context or context))
    cfg.rope_factor = factor
    return {"rope_factor": factor}


def pick_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {name}: this machine has no CUDA GPU visible to torch")
    return device


def pick_dtype(name, device):
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, name)


def autocast(device, dtype):
    """The weights stay fp32 and matmuls run in `dtype`, as in training (bf16 autocast on GPU)."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def resolve_checkpoint(path):
    """A checkpoint file, or a run directory's newest step checkpoint (best.pt when it has none)."""
    try:
        return find_checkpoint(path)
    except FileNotFoundError as e:
        raise EvalError(str(e)) from None


def run_name(path):
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return os.path.basename(os.path.abspath(path))
    parent = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    if os.path.basename(parent) == "checkpoints":
        return f"{os.path.basename(os.path.dirname(parent))}/{stem}"
    return stem


def output_dir(source, out=None):
    """RUN/eval for a run directory; for a checkpoint file, eval/<file name>/ beside it (two checkpoints
    of one run then never overwrite each other's results)."""
    if out:
        return out
    if isinstance(source, str):
        if os.path.isdir(source):
            return os.path.join(source, "eval")
        stem = os.path.splitext(os.path.basename(source))[0]
        return os.path.join(os.path.dirname(os.path.abspath(source)), "eval", stem)
    raise EvalError("an output folder (--out) is needed when the model is not a run directory or checkpoint")


def writable_folder(folder, option="--out"):
    """Create `folder` if needed and prove that a file can be written in it, before anything is computed: an
    evaluation that runs for an hour must not find out at the end that its results have nowhere to go."""
    try:
        check_writable(folder)
        os.makedirs(folder, exist_ok=True)  # the evaluator writes here next (check_writable leaves nothing)
        return folder
    except OSError as e:
        raise EvalError(f"{describe_os_error(e, 'cannot write results to')} (choose another folder with {option})") from None


def model_device(model):
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def describe_model(model, checkpoint=None, ckpt=None):
    """The "model" block of every results file: enough for report.py without loading the checkpoint."""
    cfg = getattr(model, "config", None)
    info = {"checkpoint": os.path.abspath(checkpoint) if checkpoint else None,
            "name": run_name(checkpoint) if checkpoint else type(model).__name__,
            "config": asdict(cfg) if cfg is not None else None,
            "num_params": sum(p.numel() for p in model.parameters()),
            "num_params_non_embedding": None, "step": None, "tokens_seen": None, "data_dir": None}
    if hasattr(model, "num_params"):
        info["num_params_non_embedding"] = model.num_params(non_embedding=True)
    if ckpt:
        info["step"], info["tokens_seen"] = ckpt.get("step"), ckpt.get("tokens_seen")
        info["data_dir"] = (ckpt.get("config") or {}).get("data", {}).get("data_dir")  # train.py's checkpoints
    return info


def load_for_eval(source, device="auto", attn_impl=None, overrides=None):
    """(model in eval mode, its description) from a run directory, a checkpoint file, or a model object
    (the tests pass hand-made models in). `overrides` (check_overrides) are set on the model's config
    after it is described, so the description stays the model as trained."""
    overrides = check_overrides(overrides)
    if isinstance(source, torch.nn.Module):
        info = describe_model(source)
        return apply_overrides(source, overrides).eval(), info
    if not os.path.exists(source):
        raise EvalError(f"no checkpoint file or run directory at {source}")
    try:
        path, ckpt = load_checkpoint(source)
        model = model_from_checkpoint(ckpt, pick_device(device), **({"attn_impl": attn_impl} if attn_impl else {}))
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    except EvalError:
        raise
    except Exception as e:  # weights that do not fit their config, a config this model.py refuses: say which
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EvalError(f"cannot load the checkpoint {path}: {reason}") from None
    if model.config.vocab_size <= EOT:
        raise EvalError(f"{path}: the model's vocab_size {model.config.vocab_size} cannot read GPT-2 tokens (ids up to "
                        f"{EOT}), which every evaluator and sample.py feed it")
    info = describe_model(model, path, ckpt)
    return apply_overrides(model, overrides).eval(), info


# ---------------------------------------------------------------------------------------------------
# Memory: estimate, compare with what is free, recognise running out.

# Peak bytes of one no-grad forward per token and per unit of n_embd (fp32 activations, FlexAttention),
# measured with bench/eval_memory.py (docs/benchmarks.md) and rounded up: a handful of (T, n_embd)-sized
# tensors live at once (residual, norm, q/k/v and their contiguous copies, the SwiGLU halves at 2 x n_embd).
ACTIVATION_BYTES = 48
SAFETY = 0.85  # of the memory free now: leave room for the allocator's slack and other processes


def available_bytes(device):
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    # In a container /proc/meminfo shows the host; the cgroup limit is what will kill us.
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit = f.read().strip()
                if limit != "max" and int(limit) < 1 << 60:
                    avail = min(avail, int(limit) - int(g.read()))
        except (OSError, ValueError):
            continue
        break
    return avail


def forward_bytes(model, batch, length, scored):
    """Bytes a teacher-forced forward of (batch, length) tokens needs beyond the weights, scoring the last
    `scored` positions: linear in length on the fused path, plus the T x T bias where the model's `auto`
    choice (or an explicit sdpa/eager) materialises one."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 16 * batch * length  # hand-made test models: the token ids and little else
    tokens = batch * length
    need = ACTIVATION_BYTES * tokens * max(cfg.n_embd, getattr(cfg, "hidden_dim", 0) // 2)
    need += 8 * batch * scored * cfg.vocab_size  # fp32 logits and their argmax/softmax temporaries
    need += 16 * tokens  # token ids, positions, SSMax's log n
    resolve = getattr(model, "attention_impl", None)  # the model's own policy, so the two cannot disagree
    with torch.no_grad():
        impl = resolve(length, length, False) if resolve else "flex"
    if impl == "flex":
        need += 8 * (length // 128 + 1) ** 2  # the causal BlockMask's block indices
    dense = impl == "eager" or (impl == "sdpa" and (len(getattr(model, "priors", ())) > 0 or cfg.ssmax))
    if dense:
        need += 3 * 4 * batch * cfg.n_head * length * length  # bias, masked bias, probabilities (fp32)
    return need


def plan_batch(model, want, length, scored, device):
    """The largest batch <= want whose forward fits now; OutOfMemory if not even one sequence does."""
    avail = available_bytes(device)
    batch = max(1, want)
    while batch > 1 and forward_bytes(model, batch, length, scored) > SAFETY * avail:
        batch //= 2
    need = forward_bytes(model, batch, length, scored)
    if need > SAFETY * avail:
        raise OutOfMemory(f"length {length:,} needs about {need / 2**30:.1f} GiB for one sequence but "
                          f"{avail / 2**30:.1f} GiB is free on {device}")
    return batch


def is_out_of_memory(exc):
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


# ---------------------------------------------------------------------------------------------------
# Teacher-forced scoring

@dataclass
class Sample:
    """One sequence to score: `tokens` is the model input plus the final answer token (so the input is
    tokens[:-1]); `spans` are [start, end) ranges of `tokens` that must all be predicted exactly."""

    tokens: np.ndarray
    spans: list
    meta: dict = field(default_factory=dict)


def predict_spans(model, samples, amp):
    """Teacher forcing: one forward over each full sequence, argmax at the positions that predict each
    span's tokens. Returns, per sample, a list of (correct, predicted token ids) per span. Only the last
    positions from the earliest span on get logits, never T x vocab."""
    length = len(samples[0].tokens) - 1
    first = min(start for s in samples for start, _ in s.spans)
    scored = length + 1 - first  # positions first-1 .. length-1 predict tokens first .. length
    device = model_device(model)
    x = torch.from_numpy(np.stack([s.tokens[:-1] for s in samples]).astype(np.int64)).to(device)
    with torch.no_grad(), amp:
        logits, _ = model(x, last_k=scored)
    preds = logits.argmax(dim=-1).cpu().numpy()
    out = []
    for sample, pred in zip(samples, preds):
        spans = []
        for start, end in sample.spans:
            guess = pred[start - first:end - first]
            spans.append((bool(np.array_equal(guess, sample.tokens[start:end])), guess.tolist()))
        out.append(spans)
    return out


def score_length(model, samples, batch_size, amp, bar=None):
    """predict_spans over all samples of one length in batches that fit. Raises OutOfMemory."""
    length = len(samples[0].tokens) - 1
    scored = length + 1 - min(start for s in samples for start, _ in s.spans)
    device = model_device(model)
    batch = plan_batch(model, min(batch_size, len(samples)), length, scored, device)
    results = []
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        try:
            results += predict_spans(model, chunk, amp)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            raise OutOfMemory(f"out of memory at length {length:,} with batch {len(chunk)} on {device} "
                              f"({str(e).splitlines()[0][:120]})") from None
        if bar is not None:
            bar.update(len(chunk))
    return results


def progress_bar(total, desc):
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True, leave=False,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


# ---------------------------------------------------------------------------------------------------
# Prompt pieces and results files

@functools.lru_cache(maxsize=None)
def tokenizer():
    from data import get_tokenizer

    try:
        return get_tokenizer()
    except RuntimeError as e:
        raise EvalError(str(e)) from None


def encode_template(enc, template, values):
    """Tokens of a template with {slots}, each slot's value tokenised on its own together with the space
    before it, so a value's tokens inside the haystack are exactly the tokens the answer must reproduce.
    Returns (tokens, {slot: [(start, end), ...]})."""
    parts = re.split(r"(\{\w+\})", template)  # text, slot, text, slot, ..., text
    tokens, spans = [], {}
    for i, part in enumerate(parts):
        if i % 2 == 0:
            text = part[:-1] if i + 1 < len(parts) and part.endswith(" ") else part
            tokens += enc.encode_ordinary(text) if text else []
        else:
            prefix = " " if parts[i - 1].endswith(" ") else ""
            piece = enc.encode_ordinary(prefix + str(values[part[1:-1]]))
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
    sentences = [enc.encode_ordinary(" " + s.strip() + ".") for s in text.split(".") if s.strip()]
    unit = np.array([t for s in sentences for t in s], dtype=np.int64)
    reps = n // len(unit) + 1
    ends = np.cumsum([len(s) for s in sentences])
    boundaries = np.concatenate([[0], (np.arange(reps)[:, None] * len(unit) + ends[None, :]).ravel()])
    return Haystack(np.tile(unit, reps), boundaries)


def validation_tokens(data_dir, max_tokens=None):
    """The validation split (the first shard(s), `*_val_*.bin`) as int64, at most max_tokens of it."""
    from data import ShardError, read_shard, shard_paths

    paths = shard_paths(data_dir, "val") if data_dir and os.path.isdir(data_dir) else []
    if not paths:
        raise EvalError(f"no validation shards (*_val_*.bin) in {data_dir!r}; pass --data_dir with the folder "
                        f"prepare_fineweb.py wrote")
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


DEFAULT_FACTORS = "0.5x,1x,2x,4x,8x,16x,32x,64x"  # 256 ... 32,768 for a 512 context: the paper's table


def sweep_lengths(lengths, max_factor, block_size):
    """A sweep's lengths in tokens: a list as given, else a --lengths string (with --max_factor's powers
    of two), else DEFAULT_FACTORS when neither is given."""
    if lengths is not None and not isinstance(lengths, str):
        return lengths
    spec = DEFAULT_FACTORS if lengths is None and not max_factor else lengths
    return parse_lengths(spec, block_size or 1, max_factor)


def add_sweep_args(parser, name_default, name_help):
    """The command-line options of a length sweep (eval.passkey, eval.niah); `sweep_options` reads them."""
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated lengths in tokens (4096, 16K, 1M) or x training context (2x); "
                             f"default {DEFAULT_FACTORS} unless --max_factor is given")
    parser.add_argument("--max_factor", type=float, default=None,
                        help="add the training context x 1, 2, 4, ... up to this factor (the paper: 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per forward pass (shrunk to fit memory)")
    parser.add_argument("--stop_after_zero", type=int, default=2,
                        help="stop after this many lengths in a row at 0%% (0 = never)")
    parser.add_argument("--name", default=name_default, help=name_help)
    parser.add_argument("--no_progress", action="store_true")
    add_model_args(parser)


def sweep_options(args):
    """The keyword arguments of evaluate_passkey / evaluate_niah that `add_sweep_args` parsed."""
    return dict(lengths=args.lengths, max_factor=args.max_factor, seed=args.seed, batch_size=args.batch_size,
                stop_after_zero=args.stop_after_zero, out=args.out, name=args.name, device=args.device,
                dtype=args.dtype, attn_impl=args.attn_impl, model_overrides=args.model_overrides,
                progress=not args.no_progress)


def sweep(schema, lengths, measure, *, info, settings, work_per_length, stop_after_zero, folder, name, plot, table,
          progress=True, verbose=True):
    """The length loop eval.passkey and eval.niah share, in the order of `lengths`. `measure(length, bar)`
    evaluates one length (advancing the progress bar by `work_per_length`) and returns its rows for
    results["results"] and the best score among them (None when nothing could be scored). After every
    length <folder>/<name>.json is rewritten, so what was measured survives an interruption; a length that
    does not fit in memory (OutOfMemory) stops the sweep and keeps the earlier lengths, as do
    `stop_after_zero` lengths in a row whose best score is 0. Ends with `finish`: the final JSON, the plot
    and the table. Returns the results: `schema`, the model's `info`, `settings`, the rows, and why the
    sweep stopped early (`stopped`) or that it finished (`complete`)."""
    results = {"schema": schema, "schema_version": SCHEMA_VERSION, "model": info, "settings": settings,
               "results": [], "stopped": None, "complete": False}
    json_path = os.path.join(writable_folder(folder), f"{name}.json") if folder else None
    bar = progress_bar(len(lengths) * work_per_length, schema) if progress else None
    zero_streak, saving = 0, json_path
    try:
        for length in lengths:
            if bar is not None:
                bar.set_postfix(length=format_length(length))
            try:
                rows, best = measure(length, bar)
            except OutOfMemory as e:  # rows of a half-measured length are dropped with it
                results["stopped"] = {"length": length, "reason": str(e)}
                print(f"{schema}: stopped: {e}; results so far are kept" + (f" in {json_path}" if json_path else ""),
                      file=sys.stderr)
                break
            results["results"] += rows
            saving = save_progress(saving, results, schema)
            zero_streak = zero_streak + 1 if best == 0 else 0
            stopped = zero_stop(zero_streak, stop_after_zero, lengths, length)
            if stopped:
                results["stopped"] = stopped
                break
        else:
            results["complete"] = True
    finally:
        if bar is not None:
            bar.close()
    return finish(results, json_path, folder, name, plot, table, verbose)


def zero_stop(zero_streak, stop_after_zero, lengths, length):
    """The `stopped` entry once `stop_after_zero` lengths in a row scored 0% (None to go on)."""
    if stop_after_zero and zero_streak >= stop_after_zero and length != lengths[-1]:
        return {"length": lengths[lengths.index(length) + 1],
                "reason": f"{zero_streak} lengths in a row at 0% (--stop_after_zero)"}
    return None


def save_progress(json_path, results, schema):
    """Rewrite the results file after a length (or sequence); a write that fails (a full disk) is said once on
    stderr and the evaluation goes on: what it measures is kept in memory, and `finish` tries again and, if
    that fails too, still prints the table. Returns the path to keep writing to (None after a failure)."""
    if json_path:
        try:
            write_json(json_path, results)
        except OSError as e:
            print(f"{schema}: {e}; going on, the results are printed at the end", file=sys.stderr)
            return None
    return json_path


def finish(results, json_path, folder, name, plot, table, verbose):
    """An evaluator's last step: the final JSON and its PNG (when writing), and the table on stdout. When the
    files cannot be written the table is printed all the same, then the error names the file (nothing that
    was computed is lost)."""
    failed = None
    if json_path:
        try:
            write_json(json_path, results)
            plot(results, os.path.join(folder, f"{name}.png"))
        except OSError as e:
            failed = e
    if verbose or failed:
        print(table(results))
    if failed:
        message = str(failed) if isinstance(failed, WriteError) else describe_os_error(failed, "cannot write")
        raise EvalError(f"{message} (the results are in the table above)")
    if verbose and json_path:
        print(f"wrote {json_path} and {name}.png")
    return results


def binomial_interval(successes, trials, z=1.959963984540054):
    """Wilson's 95% score interval (low, high) for a success rate seen as successes / trials: unlike the
    normal approximation it stays inside [0, 1] and is not empty at 0% or 100%, where short passkey
    sweeps often sit. (None, None) without trials."""
    if not trials:
        return None, None
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def save_figure(fig, path, **kwargs):
    """fig.savefig through the atomic writer: a full disk leaves the previous plot, never half a PNG."""
    import matplotlib.pyplot as plt

    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", **kwargs)
    finally:
        plt.close(fig)


def write_json(path, obj):
    """Atomically (checkpoint.write_text): an interrupted run leaves the previous complete file."""
    write_text(path, json.dumps(obj, indent=1, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_metrics(path):
    """The rows of a metrics.jsonl; a line cut short (a run killed mid-write) or unreadable is skipped."""
    rows = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except OSError as e:
        print(f"skipping {path}: {os_reason(e)}", file=sys.stderr)
    return rows


def settings_block(device, dtype, attn_impl, model_overrides=None, **extra):
    """The "settings" block of a results file. `model_overrides` (e.g. {"attn_window": 512} or
    {"rope_scaling": "yarn", "rope_factor": "auto"}) is what eval.report names the row by."""
    return {**extra, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "attn_impl": attn_impl, "model_overrides": dict(model_overrides or {}), "torch": torch.__version__}


def draw_heatmap(ax, matrix, row_labels, col_labels, xlabel, ylabel, title):
    """Accuracy in [0, 1] per cell, red to green; NaN (not measured) is grey. Rows run upward, so longer
    lengths sit higher, as on the paper's plots."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#d9d9d9")
    data = np.ma.masked_invalid(np.asarray(matrix, dtype=float))
    image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", origin="lower",
                      interpolation="nearest")
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=45 if len(col_labels) > 6 else 0, ha="right"
                  if len(col_labels) > 6 else "center", fontsize=8)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if data.shape[0] * data.shape[1] <= 400:  # small enough to print every value legibly
        for (r, c), value in np.ndenumerate(np.asarray(matrix, dtype=float)):
            if not math.isnan(value):
                ax.text(c, r, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if 0.25 < value < 0.85 else "white")
    return image
