"""
Import a Hugging Face model of the Llama family as a run directory, the mirror of export_hf.py:

    python import_hf.py ~/models/SmolLM2-135M runs/smollm2_135m      # a local folder (hf download / snapshot_download)
    python -m eval.passkey runs/smollm2_135m                           # then every command reads it as any run
    python train.py runs/smollm2_135m/config.toml --train.init_from=runs/smollm2_135m \\
        --data.data_dir=data/smollm2 --model.ssmax=true                 # continued pretraining with SSMax

Supported: LlamaForCausalLM (Llama 2, Llama 3.x with its "llama3" RoPE scaling, SmolLM/SmolLM2),
MistralForCausalLM (its sliding window becomes model.attn_window), Qwen2ForCausalLM (biases on q, k and v; its
windows by layer, layer_types or max_window_layers, become model.layer_pattern), Qwen3ForCausalLM (Qwen2 without
the biases, with QK-norm: q_norm and k_norm, an RMSNorm over each head's head_dim channels before RoPE, are
model.qk_norm's gains) and SmolLM3ForCausalLM (Llama with NoPE in the layers no_rope_layers marks 0, and windows
by layer_types: a layer_pattern such as "rope*3 nope").
What model.py lacks for them are ordinary ModelConfig fields (tie_embeddings, qkv_bias, qk_norm, attn_head_dim,
the llama3 rope_scaling, rope_fraction for transformers' "proportional" rope type: p-RoPE, the fastest pairs
turning at RoPE's frequencies, docs/training.md "Partial RoPE"); a setting it cannot honour (another architecture,
remote code, another activation or RoPE scaling, a bias on o_proj or the MLP, a layer type other than
full or sliding attention, quantised weights, ...) is refused in one line naming it.

OUT gets what train.py writes: config.toml (the model, the tokenizer, and a fine-tuning template of the other
sections; log.out_dir names OUT_tuned beside it), checkpoints/step_00000000.pt (bam.checkpoint's layout: fp32
weights, the config, the tokenizer's identity, and `imported_from`), the tokenizer's files copied into
OUT/tokenizer (data.tokenizer, an absolute path), and imported.json (where it came from). Hugging Face's RoPE
rotates dimension i with i + head_dim / 2, as model.apply_rope does: the q and k projections are copied as
they are (docs/export.md, "Importing a Hugging Face model").

OUT is written in a temporary folder beside it and swapped in at the end (bam.outputs.swap_in), as export_hf.py
writes its folders; an existing OUT is replaced only with --overwrite, and only if it is an earlier import that
holds nothing else (imported.json, written last, lists every file; evaluation results in OUT/eval refuse it). OUT
and SRC must lie apart, symlinks resolved (bam.outputs.check_apart): an OUT that is SRC, holds it or lies inside
it is refused before anything is written.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil

import torch

from bam import outputs
from bam.checkpoint import CONFIG, checkpoint_dict, checkpoint_dir, config_path, save_atomic, step_path
from bam.cli import Parser, UserError, error_line, run_cli
from bam.config import Config, ConfigError, DataConfig, LogConfig, TrainConfig, check, to_dict, to_toml
from bam.tokenizer import TOKENIZER_FILES, TokenizerError, check_vocab, load_tokenizer
from model import ModelConfig, Transformer

# The architectures (config.json's "architectures") and the model_type transformers builds each from
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3"}
# The families whose layers take their windows from layer_types (Qwen's from max_window_layers when it is left out)
LAYER_TYPED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")
# transformers' layer_types (Qwen2, Qwen3, SmolLM3) whose mask model.py draws: full causal, or the sliding window
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' rope_type -> model.py's rope_scaling; "proportional" (Gemma 4's partial RoPE) divides its turning
# frequencies by `factor` (1 when left out), linear scaling of the turning pairs
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "proportional": "linear"}
# rope_parameters keys a rope type reads; any other key of a scaled type is a setting model.py does not have
ROPE_KEYS = {"default": set(), "linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "proportional": {"factor", "partial_rotary_factor"}}
ROPE_OPTIONAL = {"proportional": {"factor", "partial_rotary_factor"}}  # keys a type reads that may be left out
# What OUT holds beside the run's files: the source, and every file the import wrote (what --overwrite may replace)
MARKER = "imported.json"
TUNED_SUFFIX = "_tuned"  # log.out_dir of the config template: a fine-tuning run never writes into OUT

# Hugging Face's parameter names -> model.py's (model.Transformer's state dict)
TOP_LEVEL = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
PER_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
             "mlp.gate_proj.weight": "mlp.w1.weight", "mlp.up_proj.weight": "mlp.w3.weight",
             "mlp.down_proj.weight": "mlp.w2.weight", "self_attn.o_proj.weight": "attn.wo.weight",
             "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
             **{f"self_attn.{x}_proj.{kind}": f"attn.w{x}.{kind}" for x in "qkv" for kind in ("weight", "bias")}}
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
NOT_WEIGHTS = re.compile(r"(.+\.)?rotary_emb\.inv_freq")  # a buffer older checkpoints saved: RoPE's frequencies


class ImportHFError(UserError):
    """A mistake the user can fix; main() prints it as one `error: ...` line."""


# ---------------------------------------------------------------------------------------------------
# The model's settings


def read_hf_config(src):
    """(architecture, transformers' config object, config.json as a dict) of the folder, every refusal one line.
    The architecture and remote code are judged from config.json itself, before transformers reads it."""
    path = os.path.join(src, "config.json")
    if not os.path.isdir(src):
        raise ImportHFError(f"{src} is not a folder; give a local Hugging Face model folder (download one with "
                            f"`hf download NAME --local-dir DIR`)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ImportHFError(f"{src} has no config.json: not a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise ImportHFError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ImportHFError(f"{path} is not a JSON object")
    if raw.get("auto_map"):  # trust_remote_code: code of its own, which model.py does not run
        raise ImportHFError(f"{path}: auto_map = {raw['auto_map']!r}: a model with its own code "
                            f"(trust_remote_code) cannot be imported")
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in FAMILIES:
        raise ImportHFError(f"{path}: architectures = {architectures!r}: import_hf.py takes one of "
                            f"{', '.join(FAMILIES)}")
    arch = architectures[0]
    if raw.get("model_type") != FAMILIES[arch]:
        raise ImportHFError(f"{path}: model_type = {raw.get('model_type')!r}, but {arch} is model_type "
                            f"{FAMILIES[arch]!r}")
    if raw.get("quantization_config"):
        raise ImportHFError(f"{path}: quantization_config is set: quantised weights cannot be imported; use the "
                            f"model's full-precision release")
    check_layer_lists(raw, path)  # before transformers, which refuses some in its own words (and names no fix)
    try:  # only now: transformers takes seconds to import
        from transformers import AutoConfig
    except ImportError:
        raise ImportHFError("import_hf.py needs transformers: pip install -r requirements.txt") from None
    try:  # transformers' own reading: its defaults, and older config.json layouts (rope_scaling) made current
        hf = AutoConfig.from_pretrained(src, trust_remote_code=False)
    except Exception as e:  # its reason is on the lines after the first (which validator, which field)
        raise ImportHFError(f"transformers cannot read {path}: {error_line(e, limit=500)}") from None
    return arch, hf, raw


def check_layer_lists(raw, path):
    """config.json's layer_types checked as layer_windows checks the list transformers gives, but before
    transformers reads it (it refuses a list of the wrong length or an unknown type in its own words, then stops):
    one line in the words of every other refusal. What is not a list of the layers' count is left to transformers."""
    n, types = raw.get("num_hidden_layers"), raw.get("layer_types")
    if isinstance(n, int) and not isinstance(n, bool) and isinstance(types, list):
        check_layer_types(types, n, path)


def check_layer_types(types, n, path):
    if len(types) != n:
        refuse(path, "layer_types", types, f"it names {len(types)} layers of {n} (num_hidden_layers); it needs one "
                                           f"per layer")
    other = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if other:
        refuse(path, "layer_types", other[0], f"model.py imports {', '.join(LAYER_TYPES)}")


def refuse(path, field, value, why):
    raise ImportHFError(f"{path}: {field} = {value!r}: {why}")


def model_config(arch, hf, path):
    """The ModelConfig that computes what transformers computes for this config, or one line naming the first
    setting model.py cannot honour. The training context (block_size, the evaluators' 1x) is
    max_position_embeddings, or original_max_position_embeddings under the llama3 scaling."""
    if hf.hidden_act != "silu":
        refuse(path, "hidden_act", hf.hidden_act, "model.py's MLP is SwiGLU (silu)")
    if getattr(hf, "attention_bias", False):
        refuse(path, "attention_bias", True, "a bias on o_proj as well as q, k, v; model.py has qkv_bias only")
    if getattr(hf, "mlp_bias", False):
        refuse(path, "mlp_bias", True, "model.py's MLP has no biases")
    if getattr(hf, "attention_dropout", 0.0):
        refuse(path, "attention_dropout", hf.attention_dropout, "model.py has no dropout")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        refuse(path, "rope_parameters.rope_type", rope_type, f"model.py imports {', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor")
    partial = 1.0 if partial is None else partial  # transformers' default
    if rope_type != "proportional" and partial != 1.0:
        refuse(path, "partial_rotary_factor", rope["partial_rotary_factor"],
               f"transformers' {FAMILIES[arch]} does not rotate part of a head under rope_type {rope_type!r}; "
               f"partial RoPE imports as rope_type 'proportional'")
    unknown = sorted(set(rope) - ROPE_KEYS[rope_type] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if rope_type != "default" and unknown:
        refuse(path, f"rope_parameters.{unknown[0]}", rope[unknown[0]], f"not a setting of model.py's {rope_type}")
    for key in sorted(ROPE_KEYS[rope_type] - set(rope) - ROPE_OPTIONAL.get(rope_type, set())):
        refuse(path, f"rope_parameters.{key}", None, f"the {rope_type} scaling needs it")
    n_head, width = hf.num_attention_heads, hf.hidden_size
    head_dim = getattr(hf, "head_dim", None) or width // n_head
    kv_heads = hf.num_key_value_heads or n_head
    context = hf.max_position_embeddings
    scaling = dict(rope_scaling=ROPE_TYPES[rope_type], rope_factor=float(rope.get("factor", 1.0)))
    if rope_type == "llama3":
        context = rope["original_max_position_embeddings"]
        scaling.update(rope_original_context=context, llama3_low_freq_factor=float(rope["low_freq_factor"]),
                       llama3_high_freq_factor=float(rope["high_freq_factor"]))
    if rope_type == "proportional":
        # transformers turns the first int(p x head_dim // 2) pairs, at theta^(-2i / head_dim): p-RoPE exactly
        turning = int(float(partial) * head_dim // 2)
        scaling["rope_fraction"] = turning / (head_dim // 2)
    if rope_type == "default" or (rope_type == "proportional" and scaling["rope_factor"] == 1.0):
        scaling = {k: v for k, v in scaling.items() if k == "rope_fraction"}
    layers = layer_settings(arch, hf, path)
    init_std = getattr(hf, "initializer_range", 0.0)
    try:
        return ModelConfig(
            vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers, n_head=n_head,
            n_kv_head=0 if kv_heads == n_head else kv_heads, n_embd=width,
            attn_head_dim=0 if head_dim * n_head == width else head_dim,
            qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
            tie_embeddings=bool(hf.tie_word_embeddings), mlp_hidden=hf.intermediate_size, block_size=context,
            norm_eps=float(hf.rms_norm_eps),
            pe="rope", rope_theta=float(rope.get("rope_theta", 10_000.0)), **layers,
            **({"init_std": float(init_std)} if init_std and init_std <= 10 else {}), **scaling)
    except (TypeError, ValueError) as e:
        raise ImportHFError(f"{path}: {str(e).removeprefix('model config: ')}") from None


def layer_settings(arch, hf, path):
    """attn_window and layer_pattern of ModelConfig for transformers' per-layer attention: Mistral's one window,
    Qwen2's, Qwen3's and SmolLM3's layer_types (a "sliding_attention" layer sees sliding_window keys: transformers'
    mask is j > i - sliding_window, attn_window's 0 <= i - j < W) and SmolLM3's no_rope_layers (0: NoPE)."""
    n = hf.num_hidden_layers
    if arch == "MistralForCausalLM":
        return dict(attn_window=getattr(hf, "sliding_window", None) or 0)
    rope = [True] * n
    if arch == "SmolLM3ForCausalLM":
        rope = list(hf.no_rope_layers or ())
        if len(rope) < n:
            refuse(path, "no_rope_layers", hf.no_rope_layers, f"it names {len(rope)} layers of {n}")
        rope = [bool(flag) for flag in rope[:n]]
    windows = [0] * n
    if arch in LAYER_TYPED:
        windows = layer_windows(arch, hf, path)
    return pattern_fields(rope, windows)


def layer_windows(arch, hf, path):
    """Each layer's window (0: full attention) from layer_types, one line refusing what transformers' paths would
    not compute alike."""
    types = list(hf.layer_types or ())
    n = hf.num_hidden_layers
    check_layer_types(types, n, path)
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return [0] * n
    window = hf.sliding_window
    if not isinstance(window, int) or window < 1:  # Qwen2 and Qwen3 set it to None without use_sliding_window
        refuse(path, "sliding_window", window, "layer_types has sliding_attention layers, which need a window "
                                               "of at least 1 token (and use_sliding_window = true)")
    if not getattr(hf, "use_sliding_window", True):  # SmolLM3: the mask windows them, flash attention does not
        refuse(path, "use_sliding_window", False, "layer_types has sliding_attention layers, which transformers' "
                                                  "mask windows and its flash attention does not")
    return [window if s else 0 for s in sliding]


def pattern_fields(rope, windows):
    """attn_window and layer_pattern for layers with RoPE or not and these windows (0: full): no pattern where
    every layer is RoPE with one window, the window model-wide where every layer has it, the pattern's shortest
    cycle written with counts ("rope*3 nope", "rope@full*2 rope@8*2")."""
    one_window = len(set(windows)) == 1
    words = [("rope" if r else "nope") + ("" if one_window else f"@{w or 'full'}") for r, w in zip(rope, windows)]
    fields = dict(attn_window=windows[0] if one_window else 0)
    if set(words) == {"rope"}:
        return fields
    n = len(words)
    period = next(p for p in range(1, n + 1) if n % p == 0 and words == words[:p] * (n // p))
    runs = []
    for word in words[:period]:
        if runs and runs[-1][0] == word:
            runs[-1][1] += 1
        else:
            runs.append([word, 1])
    return dict(fields, layer_pattern=" ".join(w + (f"*{c}" if c > 1 else "") for w, c in runs))


# ---------------------------------------------------------------------------------------------------
# The weights


def weight_files(src):
    """The folder's weight files: safetensors (one file or the shards its index names), else PyTorch's .bin."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if os.path.isfile(os.path.join(src, index)):
            try:
                with open(os.path.join(src, index), encoding="utf-8") as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise ImportHFError(f"cannot read {os.path.join(src, index)}: {e}") from None
            return [os.path.join(src, name) for name in shards]
        if os.path.isfile(os.path.join(src, single)):
            return [os.path.join(src, single)]
    raise ImportHFError(f"{src} has no weights (model.safetensors, its shards, or pytorch_model.bin)")


def read_tensors(path):
    """{name: tensor} of one weight file."""
    if not os.path.isfile(path):
        raise ImportHFError(f"{path} is missing (its index names it)")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file  # comes with transformers, which read_hf_config has checked
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a torn download, a file that is no checkpoint
        raise ImportHFError(f"cannot read {path}: {error_line(e, limit=300)}") from None


def our_name(name):
    """model.py's name of a Hugging Face parameter, None for one that is not a weight, or one line refusing it."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    if NOT_WEIGHTS.fullmatch(name):
        return None
    layer = LAYER_KEY.fullmatch(name)
    if layer and layer[2] in PER_LAYER:
        return f"blocks.{layer[1]}.{PER_LAYER[layer[2]]}"
    raise ImportHFError(f"the weight {name} has no place in model.py (a bias on o_proj or the MLP, or another "
                        f"architecture's layer)")


def load_weights(src, cfg):
    """(model.py's state dict in fp32, cfg): every weight renamed, none missing, none left over. With tied
    embeddings but an lm_head.weight of its own that differs, transformers keeps the two apart, and so does the
    import (tie_embeddings off)."""
    state = {}
    for path in weight_files(src):
        for name, tensor in read_tensors(path).items():
            ours = our_name(name)
            if ours is not None:
                state[ours] = tensor.to(torch.float32)  # bf16 and fp16 are exact in fp32, as train.py keeps them
    if cfg.tie_embeddings and "lm_head.weight" in state:
        if not torch.equal(state["lm_head.weight"], state.get("tok_emb.weight", torch.empty(0))):
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state.get("tok_emb.weight")
    with torch.device("meta"):
        wanted = {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
    missing = [name for name in wanted if state.get(name) is None]
    if missing:
        raise ImportHFError(f"{src}: the weights lack {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                            f"of model.py (names as model.py's state dict)")
    extra = sorted(set(state) - set(wanted))
    if extra:
        raise ImportHFError(f"{src}: the weights have {', '.join(extra[:3])}, which this config does not (more "
                            f"layers than num_hidden_layers?)")
    for name, shape in wanted.items():
        if tuple(state[name].shape) != shape:
            raise ImportHFError(f"{src}: {name} is {tuple(state[name].shape)}, its config makes it {shape}")
    return state, cfg


def build_model(state, cfg):
    """model.Transformer holding the tensors of `state` themselves (no second copy of a large model's weights;
    tied embeddings stay one parameter)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    return model


# ---------------------------------------------------------------------------------------------------
# The run directory


def template(cfg, out_dir, tokenizer):
    """The run's config.toml: the model, its tokenizer, and the other sections as a fine-tuning starting point
    (one sequence of the training context per step; lr for a trained model; new SSMax or prior parameters at
    their own rate; RAdam needs no warmup), every one changeable on train.py's command line."""
    name = os.path.basename(os.path.normpath(out_dir))
    config = Config(model=cfg,
                    data=DataConfig(data_dir=os.path.join("data", name), tokenizer=tokenizer, batch_size=1),
                    train=TrainConfig(tokens_per_step=cfg.block_size, max_steps=1000, lr=3e-5, prior_lr=1e-3,
                                      warmup_steps=0, val_every=100, val_tokens=32 * cfg.block_size,
                                      ckpt_every=100),
                    log=LogConfig(out_dir=out_dir + TUNED_SUFFIX))
    try:
        check(config)
    except ConfigError as e:
        raise ImportHFError(f"the run's config: {e}") from None
    return config


def copy_tokenizer(src, folder):
    """The tokenizer files of `src` (TOKENIZER_FILES, links followed) into `folder`; the copy hashes as the
    original does (bam.tokenizer.files_sha256)."""
    found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    if not found:
        raise ImportHFError(f"{src} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); every evaluator "
                            f"needs the model's own tokenizer")
    os.makedirs(folder)
    for name in found:
        shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))


def check_target(out_dir, overwrite):
    """An existing OUT is replaced only with --overwrite, and only if it is an earlier import holding nothing but
    what that import wrote (MARKER lists every file: outputs.check_replaceable; an evaluation's results in
    OUT/eval are the user's), or empty."""
    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise ImportHFError(f"{out_dir} already exists; pass --overwrite to replace it (an earlier import only)")
    outputs.check_replaceable(out_dir, MARKER, "import_hf.py", ImportHFError, "OUT", older=older_import)


def older_import(folder):
    """Whether `folder` is an import of import_hf.py before MARKER listed the files: a MARKER without the list."""
    return os.path.isfile(os.path.join(folder, MARKER))


def import_model(src, out_dir, overwrite=False):
    """Write the run directory; returns (its ModelConfig, the checkpoint's path)."""
    src, out_dir = os.path.abspath(os.path.expanduser(src)), os.path.abspath(out_dir)
    outputs.check_apart(src, out_dir, ImportHFError)  # the swap would take SRC with it, or the run would go into SRC
    check_target(out_dir, overwrite)
    arch, hf, raw = read_hf_config(src)
    cfg = model_config(arch, hf, os.path.join(src, "config.json"))
    try:
        identity = load_tokenizer(src).identity  # the folder's tokenizer, before any weight is read
    except TokenizerError as e:
        raise ImportHFError(str(e)) from None
    state, cfg = load_weights(src, cfg)
    if check_vocab(cfg.vocab_size, identity):
        raise ImportHFError(f"{src}: its tokenizer has {identity.vocab_size:,} ids, more than the model's "
                            f"vocab_size = {cfg.vocab_size:,} (config.json) can read")
    tokenizer = os.path.join(out_dir, "tokenizer")
    identity = dataclasses.replace(identity, name=tokenizer)  # the name data.tokenizer gives it, as train.py records
    config = template(cfg, out_dir, tokenizer)
    model = build_model(state, cfg)
    del state

    outputs.claim_folder(out_dir, "import_hf.py", "import", refused=ImportHFError)
    check_target(out_dir, overwrite)  # again: the recovery may have put an earlier import back
    tmp = outputs.new_folder(out_dir)
    try:
        copy_tokenizer(src, os.path.join(tmp, "tokenizer"))
        outputs.write_text(os.path.join(tmp, CONFIG), to_toml(config))
        os.makedirs(checkpoint_dir(tmp))
        # step 0: the weights as published; what train.py writes from them is a run of its own (step_*.pt from 1)
        ckpt = checkpoint_dict(model, step=0, tokens_seen=0, config=to_dict(config), tokenizer=identity.to_dict(),
                               imported_from={"source": src, "architecture": arch})
        save_atomic(ckpt, step_path(tmp, 0))
        outputs.write_manifest(tmp, MARKER, {"written_by": "import_hf.py", "source": src, "architecture": arch,
                                             "hf_config": raw})
        outputs.follow_umask(tmp)
        outputs.swap_in(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    outputs.unlock(outputs.sibling(out_dir, "lock"))
    return cfg, step_path(out_dir, 0)


def main(argv=None):
    ap = Parser(prog="import_hf.py", description=__doc__.split("\n\n")[0].strip(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", metavar="SRC", help="a local Hugging Face model folder (config.json, weights, tokenizer)")
    ap.add_argument("out_dir", metavar="OUT", help="the run directory to write (created)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT if it is an earlier import holding nothing else (imported.json lists it)")
    args = ap.parse_args(argv)
    cfg, path = import_model(args.source, args.out_dir, args.overwrite)
    print(f"imported {args.source} to {path}: {cfg.n_layer} layers x {cfg.n_embd} wide, context {cfg.block_size}"
          + (f", rope_scaling {cfg.rope_scaling} x{cfg.rope_factor:g}" if cfg.rope_scaling != "none" else "")
          + (f", rope_fraction {cfg.rope_fraction:g}" if cfg.rope_fraction != 1.0 else "")
          + (f", window {cfg.attn_window}" if cfg.attn_window else "")
          + (f", layer_pattern {cfg.layer_pattern!r}" if cfg.layer_pattern else ""))
    print(f"fine-tune: python train.py {config_path(args.out_dir)} --train.init_from={args.out_dir} "
          f"--data.data_dir=DATA (shards of its tokenizer: prepare_fineweb.py --source ... --tokenizer "
          f"{os.path.join(args.out_dir, 'tokenizer')} --out_dir DATA)")


if __name__ == "__main__":
    run_cli(main)
