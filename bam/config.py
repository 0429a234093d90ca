"""
Run configuration for train.py.

The dataclasses below are the schema and hold the defaults, which are the paper's headline run
(12 layers, 768 wide, 16 heads, context 512, RAdam, 589,824 tokens per step for 20,000 steps).
A TOML file overrides them section by section ([model], [data], [train], [log]) and
`--section.key=value` on the command line overrides the file:

    python train.py configs/paper/rope_512.toml --train.max_steps=100 --log.out_dir=runs/try

Every mistake (unknown section or key, wrong type, a value outside its choices, a combination
that cannot run) raises ConfigError with one line naming what is allowed; train.py turns it into
`error: ...` and a non-zero exit before anything is written.
"""

import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass
from typing import Literal

from bam import ranges
from bam.cli import os_reason
from bam.tokenizer import TokenizerError, load_tokenizer
from model import ENCODINGS, ModelConfig


class ConfigError(ValueError):
    pass


# What may differ between a checkpoint's settings and a run that loads it: one table for train.py's resume
# check, train.init_from and the evaluators' model overrides (eval/loading.py).
#   "resume"  the resumed run is still the same experiment, only computed, logged or stopped differently,
#             so `train.py --resume` accepts the change (and lists it);
#   "weights" a model setting that shapes no parameter: the checkpoint's weights serve any value of it, so
#             train.init_from and an evaluator may change it, but a resumed run would be another experiment.
# A model key that may change on resume shapes no parameter either. Every setting not named here must stay:
# it adds or reshapes parameters (pe, ssmax, bam_per_layer, sizes, tie_embeddings) or changes what is
# optimised; of those, train.init_from alone may change the ones in PARAMETER_ADDING_MODEL_KEYS (below).
CHECKPOINT_CHANGES = {
    "model": {"block_size": "weights", "attn_impl": "resume", "flex_prior": "resume", "attn_window": "weights",
              "rope_theta": "weights", "rope_scaling": "weights", "rope_factor": "weights",
              "rope_original_context": "weights", "yarn_beta_fast": "weights", "yarn_beta_slow": "weights",
              "llama3_low_freq_factor": "weights", "llama3_high_freq_factor": "weights"},
    # The loader's state is a position in tokens, valid for any batch size and number of ranks.
    "data": {"data_dir": "resume", "batch_size": "resume"},
    "train": dict.fromkeys(("max_steps", "lr", "prior_lr", "grad_clip", "val_every", "val_tokens", "ckpt_every",
                            "keep_last", "compile", "dtype", "seed", "spike_window", "spike_threshold",
                            "spike_grad_factor", "parallel", "reshard_after_forward", "fsdp_grad_sync",
                            "activation_checkpointing"), "resume"),
    "log": dict.fromkeys(("out_dir", "log_every", "wandb", "wandb_project", "run_name", "peak_tflops"), "resume"),
}
CHANGEABLE_ON_RESUME = {section: tuple(key for key, kind in keys.items() if kind == "resume")
                        for section, keys in CHECKPOINT_CHANGES.items()}
SHAPE_FREE_MODEL_KEYS = tuple(CHECKPOINT_CHANGES["model"])
# Model settings whose change may add parameters the checkpoint lacks (SSMax's per-head scales, a prior's):
# train.init_from may change them as long as no parameter of the checkpoint is dropped or reshaped, and the new
# ones start from the config's initialisation (bam.checkpoint.load_init_weights; a change of pe away from the
# encoding the weights were trained with also needs train.init_change_pe). Never on resume, never an evaluator's
# override.
PARAMETER_ADDING_MODEL_KEYS = ("ssmax", "pe", "qk_norm")
# Model settings that say only where a parameter starts (an encoding's INIT_KEYS: BAM's bam_init and the constant
# init's values). train.init_from loads every parameter its checkpoint has, so these decide only the ones it adds
# (DroPE's recipe with RoPE replaced by BAM, its prior started flat: bam_init = "uniform") and may always change.
INITIALISATION_MODEL_KEYS = tuple(dict.fromkeys(key for encoding in ENCODINGS.values() for key in encoding.INIT_KEYS))

def checkpoint_differences(saved, current, allowed):
    """The settings of `current` that differ from `saved` (both as to_dict gives them: a checkpoint's "config"
    and the run's), split into (not allowed, allowed), each "section.key: old -> new". `allowed` maps a section
    to the keys that may differ (CHANGEABLE_ON_RESUME, or {"model": SHAPE_FREE_MODEL_KEYS}). A key that
    `saved` lacks is newer than the checkpoint: its default is what the checkpoint's run had."""
    forbidden, changed = [], []
    for section, table in current.items():
        for key, value in table.items():
            if key not in saved.get(section, {}):
                continue
            old = saved[section][key]
            if isinstance(value, tuple):
                old = tuple(old)
            if old != value:
                change = f"{section}.{key}: {old!r} -> {value!r}"
                (changed if key in allowed.get(section, ()) else forbidden).append(change)
    return forbidden, changed


# Keys that moved, (old section, key) -> (new section, key). Config files, command lines and the configs that
# older versions saved in run directories and checkpoints are all read through upgrade() and upgrade_key(),
# so an old run resumes, serves as train.init_from and compares with a new run as if written today.
MOVED_KEYS = {("train", "doc_mask"): ("data", "doc_mask")}


def upgrade_key(section, key):
    return MOVED_KEYS.get((section, key), (section, key))


def upgrade(values):
    """A config as nested dicts ({section: {key: value}}: a TOML file's tables, a checkpoint's "config")
    with every moved key at its new place; a copy, the input is left alone. Both names at once is a
    ConfigError unless they agree."""
    values = {section: dict(table) if isinstance(table, dict) else table for section, table in values.items()}
    for (old_section, old_key), (section, key) in MOVED_KEYS.items():
        table = values.get(old_section)
        if not isinstance(table, dict) or old_key not in table:
            continue
        value = table.pop(old_key)
        target = values.setdefault(section, {})
        if isinstance(target, dict):
            if key in target and target[key] != value:
                raise ConfigError(f"{old_section}.{old_key} is the old name of {section}.{key}, and both are set "
                                  f"({value!r}, {target[key]!r}); keep only {section}.{key}")
            target.setdefault(key, value)
    return values


@dataclass
class DataConfig:
    data_dir: str = "data/fineweb10B"  # token shards written by prepare_fineweb.py
    # The tokenizer of the shards and of everything that reads or writes text for this run (evaluators,
    # sample.py, export_hf.py): "gpt2" (tiktoken) or a Hugging Face fast tokenizer by Hub name or local folder,
    # e.g. "mistralai/Mistral-7B-v0.3", the paper's (bam/tokenizer.py). model.vocab_size follows it unless set.
    tokenizer: str = "gpt2"
    # Sequences per micro-batch on each rank. The sequence length is model.block_size: the model is
    # trained at exactly its context, so there is one knob, not two that must agree.
    batch_size: int = 48
    # Which next-token targets the loss counts: "all", or only the tokens of the synthetic passkey
    # documents that copy their key (retrieval.passkey_answer_targets): a supervised retrieval task
    # whose output layer runs at those few positions only (docs/repro.md).
    loss_on: Literal["all", "passkey_answers"] = "all"
    # A token attends only inside its own document (the EOT-separated ids the loader derives), as in the
    # paper. (Older versions called it train.doc_mask; MOVED_KEYS still reads that name.)
    doc_mask: bool = True


@dataclass
class TrainConfig:
    tokens_per_step: int = 589_824  # the paper's batch: 1152 x 512 = 576 x 1024
    max_steps: int = 20_000  # 11.8B tokens: one pass over FineWeb sample-10BT
    optimizer: Literal["radam", "adamw"] = "radam"
    lr: float = 1e-3
    prior_lr: float | None = None  # learning rate of the positional-prior and SSMax parameters; None = lr
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled, on weight matrices only (never norms, biases, priors)
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_frac: float = 0.1  # the schedule ends at min_lr_frac x lr
    grad_clip: float = 1.0  # 0 = no clipping
    val_every: int = 500  # steps between validation losses; 0 = never
    val_tokens: int = 10_485_760  # rounded down to a multiple of batch_size x block_size x world size
    ckpt_every: int = 1000  # steps between checkpoints; one is always written at the end
    keep_last: int = 3  # step checkpoints kept on disk, at least 2 (best.pt is kept apart; docs/training.md)
    compile: bool = True  # torch.compile: the whole model under DDP, each Block under FSDP
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto = bf16 on a GPU that has it (autocast; FSDP's policy)
    # How the ranks share the work (bam/parallel.py, docs/training.md "Past one GPU's memory"): "ddp" gives each
    # rank the whole model and optimizer; "fsdp" (FSDP2) shards weights, gradients and optimizer state over
    # the ranks and checkpoints through torch.distributed.checkpoint, as step folders instead of .pt files.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # FSDP: free each Block's gathered weights after its forward and gather them again for its backward
    # (less memory); false keeps them until the backward (one all-gather less per Block and step).
    reshard_after_forward: bool = True
    # FSDP with accumulation: reduce-scatter the gradients after every micro-batch ("micro_batch": they stay
    # sharded) or only after the last one ("step": less communication, but every rank holds the whole
    # model's fp32 gradients in between, as DDP does).
    fsdp_grad_sync: Literal["micro_batch", "step"] = "micro_batch"
    # "full": each Block keeps only its input for the backward and recomputes the rest (about a third more
    # compute for a fraction of the activation memory; `train.py CONFIG --dry_run` shows how much).
    activation_checkpointing: Literal["none", "full"] = "none"
    seed: int = 1337
    # The spike guard (docs/training.md, "Preemption and recovery"): a step whose loss is more than
    # spike_threshold robust standard deviations above the median of the last spike_window steps, or
    # whose gradient norm is more than spike_grad_factor times their median, or whose loss exceeds twice
    # that of uniform guessing, stops the run before it is applied or checkpointed. 0 turns a rule off.
    spike_window: int = 100
    spike_threshold: float = 6.0
    # Off by default: with grad_clip on, a raw gradient norm 10-40x its median is clipped and harmless,
    # and healthy runs have them (3 of 3 tiny 5-digit repro runs were stopped by a factor of 10).
    spike_grad_factor: float = 0.0
    # A run directory or checkpoint whose weights start this run (context-extension fine-tuning): the
    # optimizer, schedule, step and data position start fresh, and model settings may differ from the
    # checkpoint's only in SHAPE_FREE_MODEL_KEYS. A run directory that already has checkpoints resumes
    # from them instead (--resume wins). "" = train from a random initialisation. model.ssmax and model.pe may
    # also change where that only adds parameters (they start from this config's init; docs/training.md).
    init_from: str = ""
    # With init_from: let model.pe differ from the encoding the weights were trained with (RoPE, sinusoidal,
    # ALiBi), which they rely on; without it such a change is refused.
    init_change_pe: bool = False


@dataclass
class LogConfig:
    out_dir: str = ""  # the run directory (config.toml, metrics.jsonl, checkpoints/); "" = runs/<config name>
    log_every: int = 10  # steps between rows of metrics.jsonl (and wandb points)
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "bam"
    run_name: str = ""  # "" = the name of out_dir
    peak_tflops: float = 0.0  # per-GPU peak for MFU; 0 = look it up from the GPU's name


@dataclass
class Config:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    log: LogConfig


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "log": LogConfig}

# What every numeric setting of [data], [train] and [log] may be (bam/ranges.py's notation; finite as well; each
# element of a list, and an optional one only when set). [model]'s are model.model_ranges(), checked by
# ModelConfig itself. A new numeric setting needs its line: tests/test_ranges.py fails for one without.
RANGES = {
    "data": {"batch_size": ">= 1"},
    "train": {"tokens_per_step": ">= 1", "max_steps": ">= 1", "lr": "> 0", "prior_lr": "> 0", "betas": ">= 0, < 1",
              "eps": ">= 0", "weight_decay": ">= 0", "warmup_steps": ">= 0", "min_lr_frac": ">= 0, <= 1",
              "grad_clip": ">= 0", "val_every": ">= 0", "val_tokens": ">= 0", "ckpt_every": ">= 0",
              "keep_last": ">= 1", "seed": ">= 0, < 4294967296", "spike_window": ">= 1",
              "spike_threshold": ">= 0", "spike_grad_factor": ">= 0"},
    "log": {"log_every": ">= 1", "peak_tflops": ">= 0"},
}


def number_kind(typ):
    """int or float for a numeric field's type (also inside Optional and tuple/list), else None."""
    if _optional(typ):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typing.get_origin(typ) in (tuple, list):
        typ = typing.get_args(typ)[0]
    return typ if typ in (int, float) else None


def check_ranges(section, values, table):
    """ConfigError `section.key = value: allowed: ...` for the first setting outside its range."""
    hints = typing.get_type_hints(type(values))
    for key, spec in table.items():
        value = getattr(values, key)
        for element in value if isinstance(value, (tuple, list)) else () if value is None else (value,):
            try:
                ranges.check(f"{section}.{key}", element, spec, number_kind(hints[key]))
            except ValueError as e:
                raise ConfigError(f"{e}" + (f" (each of {list(value)})" if isinstance(value, tuple) else "")) from None


def _read_file(path, values, chain):
    """Apply the TOML file at `path` to `values`. A top-level `base = "other.toml"` (relative to the
    file) is applied first, so a family of configs can share one file and each say what differs."""
    try:
        with open(path, "rb") as f:
            file_values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give a .toml file (e.g. configs/tiny.toml)") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {os_reason(e)}") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself: a binary or non-UTF-8 file
        raise ConfigError(f"{path} is not a UTF-8 text file (byte {e.start}: {e.reason}); "
                          f"a config is a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    base = file_values.pop("base", None)
    try:
        file_values = upgrade(file_values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"base in {path} must be the path of another config file, got {base!r}")
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
        if os.path.abspath(base_path) in chain:
            raise ConfigError(f"{path}: base files include each other ({base_path})")
        _read_file(base_path, values, chain + (os.path.abspath(path),))
    for section, table in file_values.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"unknown section [{section}] in {path}; allowed sections: "
                              + ", ".join(f"[{s}]" for s in SECTIONS) + " (and a top-level base = \"file\")")
        for key, value in table.items():
            values[section][key] = _coerce(section, key, value, path)


def load_config(path=None, overrides=()):
    """Defaults, then the TOML file at `path` (if any), then `--section.key=value` overrides."""
    values = {name: {} for name in SECTIONS}
    if path is not None:
        _read_file(path, values, chain=())
    for arg in overrides:
        section, key, value = _parse_override(arg)
        values[section][key] = value

    if not values["log"].get("out_dir"):
        # One directory per config file by default, so two paper runs never share a run dir.
        stem = os.path.splitext(os.path.basename(path))[0] if path else "default"
        values["log"]["out_dir"] = os.path.join("runs", stem)

    # model.vocab_size follows the tokenizer unless given (GPT-2's 50,257 is also ModelConfig's default).
    tokenizer = values["data"].get("tokenizer", DataConfig.tokenizer)
    if "vocab_size" not in values["model"] and isinstance(tokenizer, str) and tokenizer != DataConfig.tokenizer:
        try:
            values["model"]["vocab_size"] = load_tokenizer(tokenizer).n_vocab
        except TokenizerError as e:
            raise ConfigError(f"data.tokenizer = {tokenizer!r}: {e}") from None

    # A preset (one of the paper's model sizes) fills n_embd/n_layer/n_head; keys set explicitly,
    # in the file or on the command line, still win over it.
    preset = values["model"].pop("preset", None)
    built = {}
    for section, cls in SECTIONS.items():
        try:
            built[section] = ModelConfig.preset(preset, **values[section]) if preset and cls is ModelConfig else cls(**values[section])
        except (ValueError, TypeError, AssertionError) as e:
            raise ConfigError(f"[{section}] {str(e).removeprefix('model config: ')}") from None
    config = Config(**built)
    check(config)
    return config


def check(config, world_size=1):
    """Combinations that cannot run; with world_size, also those that cannot run on that many ranks."""
    m, d, t = config.model, config.data, config.train
    for section, table in RANGES.items():
        check_ranges(section, getattr(config, section), table)
    if t.parallel == "fsdp" and m.tie_embeddings:
        raise ConfigError("train.parallel = 'fsdp' shards the embedding and the LM head apart, which "
                          "model.tie_embeddings makes one matrix; use train.parallel = 'ddp'")
    if t.warmup_steps > t.max_steps:
        raise ConfigError(f"train.warmup_steps = {t.warmup_steps} is more than train.max_steps = {t.max_steps}")

    micro_tokens = d.batch_size * m.block_size * world_size
    if t.tokens_per_step % micro_tokens:
        fitting = [b for b in range(1, d.batch_size + 1) if t.tokens_per_step % (b * m.block_size * world_size) == 0]
        hint = (f"data.batch_size values that fit: {', '.join(map(str, fitting))}" if fitting
                else f"train.tokens_per_step must be a multiple of model.block_size x world size = {m.block_size * world_size}")
        raise ConfigError(
            f"train.tokens_per_step = {t.tokens_per_step} is not a multiple of data.batch_size x model.block_size"
            f" x world size = {d.batch_size} x {m.block_size} x {world_size} = {micro_tokens}; {hint}")
    if t.val_every and t.val_tokens < micro_tokens:
        raise ConfigError(f"train.val_tokens = {t.val_tokens} is less than one micro-batch on every rank "
                          f"(data.batch_size x model.block_size x world size = {micro_tokens}); raise it or set train.val_every = 0")


def to_dict(config):
    return {section: dataclasses.asdict(getattr(config, section)) for section in SECTIONS}


def to_toml(config):
    """The resolved config as TOML that load_config reads back to the same Config.
    Only flat sections of scalars and lists are needed, so a few lines do instead of a dependency.
    TOML has no null: a None is written as a comment and, being absent, reads back as its default
    (every None field in the schema defaults to None)."""
    lines = []
    for section, table in to_dict(config).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def describe():
    """Every key with its default, for `train.py --help`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        if cls is ModelConfig:
            lines.append("  preset = (unset)  # a paper size (e.g. \"275m\"): sets n_embd, n_layer, n_head")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name} = {'(unset)' if default is None else _toml_value(default)}")
    return "\n".join(lines)


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr's 1e-05, inf and nan are TOML too
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _field_types(section):
    return typing.get_type_hints(SECTIONS[section])


def _check_key(section, key, where):
    if (section, key) == ("model", "preset"):
        return str
    types_ = _field_types(section)
    if key not in types_:
        allowed = ["preset", *types_] if section == "model" else types_
        raise ConfigError(f"unknown key {key!r} in [{section}] ({where}); [{section}] allows: {', '.join(allowed)}")
    return types_[key]


def _parse_override(arg):
    """`--section.key=value`: the value is read as a TOML value (so 3e-4, true and [0.9, 0.95]
    mean what they say), except for text fields, which take it verbatim."""
    name, eq, raw = arg.removeprefix("--").partition("=")
    section, dot, key = name.partition(".")
    if not arg.startswith("--") or not eq or not dot:
        raise ConfigError(f"cannot read the argument {arg!r}; overrides look like --section.key=value, "
                          f"sections: {', '.join(SECTIONS)}")
    if section not in SECTIONS:
        raise ConfigError(f"unknown section in {arg!r}; allowed sections: {', '.join(SECTIONS)}")
    section, key = upgrade_key(section, key)
    typ = _check_key(section, key, "command line")
    if _takes_text(typ):
        value = raw
    elif raw.strip().lower() in ("none", "null") and _optional(typ):
        value = None
    else:
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # not a number, bool or list; _coerce names the type that was expected
    return section, key, _coerce(section, key, value, "command line")


def parse_model_override(arg):
    """An evaluator's `--model.key=value`: (key, value) read and checked as train.py reads it."""
    section, key, value = _parse_override(arg)
    if section != "model":
        raise ConfigError(f"{arg!r}: an evaluator takes only model settings (--model.key=value)")
    return key, value


def _optional(typ):
    return typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typ)


def _takes_text(typ):
    if _optional(typ):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return typ is str or (typing.get_origin(typ) is Literal and all(isinstance(a, str) for a in typing.get_args(typ)))


def _coerce(section, key, value, where):
    typ = _check_key(section, key, where)
    try:
        return _as_type(value, typ)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{section}] {key} = {value!r} ({where}): {e}") from None


def _as_type(value, typ):
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if _optional(typ):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _as_type(value, inner[0] if len(inner) == 1 else typing.Union[tuple(inner)])
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _as_type(value, option)
            except (TypeError, ValueError):
                pass
        raise TypeError(f"expected one of: {', '.join(getattr(a, '__name__', str(a)) for a in args)}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"choose one of: {', '.join(map(str, args))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, like [{', '.join('1' for _ in args[:2])}]")
        if origin is tuple and ... not in args and len(value) != len(args):
            raise ValueError(f"expected a list of {len(args)} values")
        element = args[0] if args else typing.Any
        return origin(_as_type(v, element) for v in value)
    if typ is bool:
        if not isinstance(value, bool):
            raise TypeError("expected true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("expected an integer (underscores are fine: 589_824)")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
            raise TypeError("expected a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise TypeError("expected a string in quotes")
        return value
    if typ is typing.Any:
        return value
    raise TypeError(f"unsupported field type {typ}")
