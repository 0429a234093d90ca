"""A model for evaluation: read from a run directory, a checkpoint file or given as a model object, on the
chosen device and dtype, described for the results file, and run under the model overrides.

The overrides are checked once, by ModelConfig itself (`dataclasses.replace` runs its checks), and never
set on the caller's model: the evaluated model is a copy of the modules under the overridden config that
shares every weight (`with_config`). A rope_factor of "auto" depends on the length, so each length gets
its own such model (`EvalModel.at_length`).
"""

import copy
import itertools
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import torch

from bam.checkpoint import CheckpointError, checkpoint_tokenizer, is_sharded, load_checkpoint, model_from_checkpoint
from bam.cli import error_line
from bam.tokenizer import GPT2, GPT2_IDENTITY, load_run_tokenizer
from eval import EvalError
from eval.options import EvalOptions
from model import parse_layer_pattern


@dataclass
class EvalModel:
    """`model` is what runs: the overrides applied. `info` describes the model as trained (the results'
    "model" block, which eval.report reads without loading the checkpoint)."""

    model: torch.nn.Module
    info: dict
    overrides: dict  # as given: {"rope_scaling": "yarn", "rope_factor": "auto"}, {} for a plain evaluation
    device: torch.device
    dtype: torch.dtype  # autocast's

    def tokenizer(self):
        """The run's tokenizer (tokenizer.Tokenizer), as its checkpoint records it (data.tokenizer; GPT-2 for
        a model object and for checkpoints from before the setting), checked against the recorded hash."""
        config = getattr(self.model, "config", None)
        return load_run_tokenizer(self.info.get("tokenizer") or GPT2, self.info.get("tokenizer_sha256"),
                                  config.vocab_size if config else None,
                                  self.info.get("checkpoint") or self.info.get("name"))

    @property
    def block_size(self):
        """The training context (None for a model object without a config)."""
        return (self.info["config"] or {}).get("block_size")

    def at_length(self, length):
        """(the model to run at `length` tokens, the settings that depend on the length, for that length's
        results row). An "auto" rope_factor is length / the training context (rope_original_context when
        set; at least 1: shorter lengths run unscaled), the usual way context-extension methods are compared."""
        if self.overrides.get("rope_factor") != "auto":
            return self.model, {}
        config = self.model.config
        factor = max(1.0, length / (config.rope_original_context or self.block_size))
        return with_config(self.model, replace(config, rope_factor=factor)), {"rope_factor": factor}

    def autocast(self):
        return autocast(self.device, self.dtype)

    def settings(self, **extra):
        """The "settings" block of a results file: the evaluator's own settings, then how the model ran.
        `model_overrides` is what eval.report names the row by."""
        return {**extra, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "attn_impl": getattr(getattr(self.model, "config", None), "attn_impl", None),
                "model_overrides": dict(self.overrides), "torch": torch.__version__}


def load_for_eval(source, options=None):
    """The EvalModel of a run directory, a checkpoint file, or a model object (the tests pass hand-made
    models in; they stay on their device)."""
    options = options or EvalOptions()
    if isinstance(source, torch.nn.Module):
        trained, info = source.eval(), describe_model(source)
    else:
        trained, path, ckpt = read_model(source, pick_device(options.device))
        info = describe_model(trained, path, ckpt)
        check_vocab_holds_tokenizer(trained, path, ckpt)
    model = overridden(trained, options.attn_impl, options.model_overrides)
    device = model_device(trained)
    return EvalModel(model, info, dict(options.model_overrides), device, pick_dtype(options.dtype, device))


def read_model(source, device):
    """(model in eval mode, checkpoint path, checkpoint dict), every failure one EvalError line."""
    if not os.path.exists(source):
        raise EvalError(f"no checkpoint file or run directory at {source}")
    try:
        path, ckpt = load_checkpoint(source)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    try:
        model = model_from_checkpoint(ckpt, device)
    except Exception as e:  # weights that do not fit their config, a config this model.py refuses: say which
        raise EvalError(f"cannot load the checkpoint {path}: {error_line(e, limit=300)}") from None
    return model.eval(), path, ckpt


def check_vocab_holds_tokenizer(model, path, ckpt):
    """EvalError when the model's vocabulary cannot hold the ids of its run's tokenizer (as the checkpoint records
    it; GPT-2's without a record), which every evaluator and sample.py feed it. No tokenizer is loaded."""
    identity = checkpoint_tokenizer(ckpt)[1]
    if identity is None or model.config.vocab_size >= identity.vocab_size:
        return
    what = "GPT-2 tokens" if identity.sha256 == GPT2_IDENTITY.sha256 else f"the tokens of its tokenizer {identity.name!r}"
    raise EvalError(f"{path}: the model's vocab_size {model.config.vocab_size} cannot read {what} (ids up to "
                    f"{identity.vocab_size - 1}), which every evaluator and sample.py feed it")


def overridden(model, attn_impl, overrides):
    """`model` under its overrides (itself without any), validated by ModelConfig's rules, the same as a
    config file's values, plus the two that only "auto" has."""
    changes = {key: value for key, value in overrides.items() if value != "auto"}
    if attn_impl:
        changes["attn_impl"] = attn_impl
    auto = overrides.get("rope_factor") == "auto"
    if not changes and not auto:
        return model
    config = getattr(model, "config", None)
    if config is None:
        raise EvalError("model overrides need a model with a config (a run directory or checkpoint)")
    try:
        config = replace(config, **changes)
    except (TypeError, ValueError) as e:
        raise EvalError(str(e)) from None
    check_window_reaches_a_layer(config, changes)
    if auto and config.rope_scaling == "none":
        raise EvalError("--rope_factor auto needs a RoPE scaling method: add --rope_scaling linear, ntk or yarn")
    if auto and config.rope_scaling == "dynamic_ntk":
        raise EvalError("--rope_factor auto would scale dynamic_ntk twice (it already grows its scale with the "
                        "length); give a number, 1 for the plain dynamic rule")
    return with_config(model, config) if changes else model


def check_window_reaches_a_layer(config, changes):
    """A model-wide attn_window reaches only the layers whose layer_pattern word names no window of its own; where
    every word names one (rope@64 bam@full), --attn_window would change nothing while the results file and the
    report named the evaluation after it: refused in one line."""
    if "attn_window" not in changes or not config.layer_pattern:
        return
    if any(kind.window is None for kind in parse_layer_pattern(config.layer_pattern, config.n_layer)):
        return
    raise EvalError(f"--attn_window {changes['attn_window']} would change no layer: every word of the model's "
                    f"layer_pattern {config.layer_pattern!r} names its own window (@W or @full), which the flag "
                    f"leaves as trained; evaluate the model without it")


def with_config(model, config):
    """`model` under another config of the same shapes: a copy of its module objects that shares every
    parameter and buffer (no weight is copied) and holds `config` wherever the original holds its own.
    The original model is left as it was."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    shared[id(model.config)] = config
    return copy.deepcopy(model, shared)


def describe_model(model, checkpoint=None, ckpt=None):
    """The "model" block of every results file: enough for eval.report without loading the checkpoint."""
    cfg = getattr(model, "config", None)
    info = {"checkpoint": os.path.abspath(checkpoint) if checkpoint else None,
            "name": run_name(checkpoint) if checkpoint else type(model).__name__,
            "config": asdict(cfg) if cfg is not None else None,
            "num_params": sum(p.numel() for p in model.parameters()),
            "num_params_non_embedding": None, "step": None, "tokens_seen": None, "data_dir": None,
            "tokenizer": "gpt2", "tokenizer_sha256": None}
    if hasattr(model, "num_params"):
        info["num_params_non_embedding"] = model.num_params(non_embedding=True)
    if ckpt:
        info["step"], info["tokens_seen"] = ckpt.get("step"), ckpt.get("tokens_seen")
        info["data_dir"] = (ckpt.get("config") or {}).get("data", {}).get("data_dir")  # train.py's checkpoints
        # The run's tokenizer: data.tokenizer (GPT-2 before the setting existed) and the hash train.py recorded
        info["tokenizer"] = checkpoint_tokenizer(ckpt)[0]
        info["tokenizer_sha256"] = (ckpt.get("tokenizer") or {}).get("sha256")
    return info


def run_name(path):
    path = os.path.normpath(path)
    if os.path.isdir(path) and not is_sharded(path):  # a run directory (an FSDP checkpoint is a folder too)
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
        if os.path.isdir(source) and not is_sharded(source):
            return os.path.join(source, "eval")
        stem = os.path.splitext(os.path.basename(source))[0]
        return os.path.join(os.path.dirname(os.path.abspath(source)), "eval", stem)
    raise EvalError("an output folder (--out) is needed when the model is not a run directory or checkpoint")


def model_device(model):
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


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
