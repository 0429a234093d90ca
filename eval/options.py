"""The options every evaluator shares (`EvalOptions`), read once from the command line, and the model
overrides among them: how they are spelled, read, and named in results files and reports.

An override's value is only *read* here (its type, and "auto" for rope_factor); whether it makes a valid
model is decided once, by ModelConfig's own rules, when the evaluated model is built (eval.loading).
"""

import re
from dataclasses import dataclass, field

from bam.config import SHAPE_FREE_MODEL_KEYS, ConfigError, parse_model_override
from bam.ranges import number
from eval import EvalError


@dataclass
class EvalOptions:
    """What every evaluation of a model shares. None for `seed` and `batch_size` means the evaluator's
    own default (the prompts' seed 0, lm-eval's 1234; 8 prompts per forward, 1 long sequence, ...)."""

    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...
    dtype: str = "auto"  # autocast dtype: auto = bfloat16 on a GPU that has it, float32 on CPU
    attn_impl: str | None = None  # None keeps the checkpoint's attention implementation
    model_overrides: dict = field(default_factory=dict)  # shape-free ModelConfig keys, e.g. {"attn_window": 512}
    out: str | None = None  # output folder; None: RUN/eval, or eval/<name>/ next to a checkpoint file
    name: str | None = None  # results file name; None: the evaluator's, with the overrides' suffix
    seed: int | None = None
    batch_size: int | None = None
    progress: bool = True  # a progress bar on stderr
    verbose: bool = True  # the table and "wrote ..." on stdout

    def __post_init__(self):
        self.model_overrides = check_override_keys(self.model_overrides)
        if self.batch_size is not None and self.batch_size < 1:
            raise EvalError(f"--batch_size must be at least 1, got {self.batch_size}")


def check_override_keys(overrides):
    """Only settings that leave the weights' shapes alone can change on a trained model."""
    overrides = dict(overrides or {})
    for key in overrides:
        if key not in SHAPE_FREE_MODEL_KEYS:
            raise EvalError(f"model.{key} cannot be overridden on a trained model (it changes or adds weights); "
                            f"allowed: {', '.join(SHAPE_FREE_MODEL_KEYS)}")
    return overrides


# ---------------------------------------------------------------------------------------------------
# The command line


def add_model_arguments(parser, window_flag=True):
    """--device, --dtype, --attn_impl and the model overrides. `window_flag`: --window may also name the
    attention window (eval.perplexity keeps --window for its own windows; --attn_window always works)."""
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto = bfloat16 on a GPU that has it, float32 on CPU")
    parser.add_argument("--attn_impl", default=None, choices=["auto", "flex", "sdpa", "eager"],
                        help="override the checkpoint's attention implementation (default: keep it; "
                             "auto uses FlexAttention, O(T) memory, for long prompts)")
    parser.add_argument("--attn_window", *(["--window"] if window_flag else []), dest="attn_window", type=number(int, ">= 0"),
                        default=None, help="sliding-window attention over the last W tokens (= --model.attn_window=W)")
    parser.add_argument("--rope_scaling", default=None,
                        help="RoPE context extension, e.g. yarn (= --model.rope_scaling=...)")
    parser.add_argument("--rope_factor", default=None,
                        help="RoPE scaling factor, or auto: evaluated length / training context, per length")
    parser.epilog = (f"Any model setting that leaves the weights' shapes alone may be overridden as --model.key=value "
                     f"({', '.join(SHAPE_FREE_MODEL_KEYS)}); results then go to a file named after the overrides.")


def add_output_arguments(parser, name_help=None):
    """--out, and --name (the results file's name) when the evaluator lets it be chosen."""
    parser.add_argument("--out", default=None,
                        help="output folder (default: RUN/eval, or eval/<name>/ next to a checkpoint file)")
    if name_help:
        parser.add_argument("--name", default=None, help=name_help)


def add_prompt_arguments(parser, batch_size, seed=0):
    """--seed (of the prompts), --batch_size and --no_progress, as an evaluator of prompts has them."""
    parser.add_argument("--seed", type=number(int, ">= 0, < 4294967296"), default=seed, help="seed of the prompts (default %(default)s)")
    parser.add_argument("--batch_size", type=number(int, ">= 1"), default=batch_size,
                        help="prompts per forward pass, shrunk to fit memory (default %(default)s)")
    parser.add_argument("--no_progress", action="store_true")


def parse_arguments(parser, argv):
    """parser.parse_args, plus the EvalOptions built from it. The model overrides (--window,
    --rope_scaling, --rope_factor and any --model.key=value) are gathered into options.model_overrides."""
    args, extra = parser.parse_known_args(argv)
    generic = [a for a in extra if a.startswith("--model.")]
    if len(generic) < len(extra):
        parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a not in generic)}")
    overrides = {}
    for arg in generic:
        key, value = read_override(arg)
        overrides[key] = value
    flags = {"attn_window": getattr(args, "attn_window", None), "rope_scaling": getattr(args, "rope_scaling", None),
             "rope_factor": getattr(args, "rope_factor", None)}
    overrides.update({key: value for key, value in flags.items() if value is not None})
    if "rope_factor" in overrides:
        overrides["rope_factor"] = read_rope_factor(overrides["rope_factor"])
    attn_impl = getattr(args, "attn_impl", None) or overrides.get("attn_impl")  # two spellings of one setting
    overrides.pop("attn_impl", None)
    options = EvalOptions(
        device=getattr(args, "device", "auto"), dtype=getattr(args, "dtype", "auto"), attn_impl=attn_impl,
        model_overrides=overrides, out=getattr(args, "out", None), name=getattr(args, "name", None),
        seed=getattr(args, "seed", None), batch_size=getattr(args, "batch_size", None),
        progress=not getattr(args, "no_progress", False))
    return args, options


def read_override(arg):
    """"--model.key=value" -> (key, value), the value read as train.py reads it ("auto" for rope_factor)."""
    key, _, raw = arg.removeprefix("--model.").partition("=")
    if key == "rope_factor":
        return key, read_rope_factor(raw)
    try:
        return parse_model_override(arg)
    except ConfigError as e:
        raise EvalError(str(e)) from None


def read_rope_factor(value):
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return float(value)
    except (TypeError, ValueError):
        raise EvalError(f"--rope_factor {value!r}: use a number (16) or auto") from None


# ---------------------------------------------------------------------------------------------------
# Names: results files and report rows tell overridden evaluations apart from the plain one


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


def results_name(default, overrides):
    suffix = overrides_suffix(overrides)
    return f"{default}_{suffix}" if suffix else default


def plain_number(value):
    """16.0 -> 16, 1e6 -> 1000000, 2.5 -> 2.5; anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


SCALING_NAMES = {"yarn": "YaRN", "ntk": "NTK", "dynamic_ntk": "dynamic NTK", "linear": "PI", "pi": "PI"}  # as papers write them


def overrides_label(config, overrides):
    """How a report names an evaluation of a model (its `config` dict) with model overrides: "rope + YaRN x16",
    "rope + YaRN auto", "rope-local (W=512)"; other overridden keys follow in the brackets as key=value. A factor
    given alone scales by the model's own method (a run fine-tuned with YaRN), so it is named after it, and
    without overrides such a model is named by the method it was trained with ("rope + YaRN x4"). A model with a
    layer_pattern is named by it too, as its layers' encodings and windows are ("nope, layer pattern rope@64*2
    nope@full"); a window override then reaches only the words that name no window, so the label is not
    "-local" but "(W=4)" after the pattern."""
    rest = dict(overrides or {})
    window, scaling, factor = rest.pop("attn_window", 0), rest.pop("rope_scaling", None), rest.pop("rope_factor", None)
    if scaling is None:  # not overridden: the model's own method, at its own factor unless one is given
        scaling = config.get("rope_scaling")
        if factor is None and scaling not in (None, "none"):
            factor = config.get("rope_factor")  # as trained: "rope + YaRN x4"
    pattern = config.get("layer_pattern")
    local = "-local" if window and not pattern else ""
    label = f"{config.get('pe', '?')}{local}{' + ssmax' if config.get('ssmax') else ''}"
    if scaling and scaling != "none":
        label += f" + {SCALING_NAMES.get(scaling, scaling)}"
    if factor is not None:
        label += " auto" if factor == "auto" else f" x{plain_number(factor)}"
    if pattern:
        label += f", layer pattern {pattern}"
    details = ([f"W={window}"] if window else []) + [f"{k}={plain_number(v)}" for k, v in sorted(rest.items())]
    return label + (f" ({', '.join(details)})" if details else "")
