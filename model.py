"""
A Llama-style decoder with pluggable positional encodings, read top to bottom:

    the config (ModelConfig, its layer pattern and what it refuses) -> the model, top-down:
    Transformer (forward, generation, optimizer groups) -> Block -> Attention -> SwiGLU ->
    KVCache -> the positional encodings (NoPE, RoPE, sinusoidal; the priors ALiBi, BAM, KERPLE,
    T5, FIRE, FoX), each owning its options, and their registry ENCODINGS -> attention: the
    context of a forward, what positions do to it, the eager and sdpa paths -> FlexAttention, one
    region at the bottom (prior tables, the path, sinks, BlockMasks, compiled kernels), which a
    reader who never runs a GPU can skip

Every additive positional encoding is a *log-prior over position* (docs/paper.md §1): a bias added
to the attention logit of head h, query position i and key position j; for most, g_h(i - j), a
function of the distance alone (ALiBi, BAM, KERPLE, T5), for some also of the query's position
(FIRE) or of per-token values each layer computes from its input (FoX's forget gates;
docs/INTERFACES.md "Additive priors"). That bias is written once, as a plain torch expression on
broadcastable tensors (`positional_scores`), and so is the mask, causal, within the window and
within the document (`visible`); the same two expressions serve FlexAttention (score_mod, mask_mod
and BlockMask), the dense bias of the `sdpa` path and the materialised `eager` reference, so the
three cannot drift apart. On flex a prior that depends on the head and i - j only is by default
evaluated from that expression once per distance into a per-head table, from which the kernel
gathers (`distance_table`, ModelConfig.flex_prior).
"""

import functools
import math
import re
from collections import namedtuple
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (AuxRequest, BlockMask, create_block_mask,
                                               flex_attention as torch_flex_attention)

ATTN_IMPLS = ("auto", "flex", "sdpa", "eager")
FLEX_PRIORS = ("table", "formula")

# The two registries every part reads, each filled where its entries are defined:
# ENCODINGS, the name a config uses -> the positional encoding (at the end of "Positional
# encodings"), and ATTENTION, ModelConfig.attn_impl after `auto` -> the attention path
# (eager and sdpa in "Attention", flex in "FlexAttention").
ENCODINGS = {}
ATTENTION = {}
# The largest position, window or context a setting may name: past it a position no longer fits
# the int32 indices of the attention kernels
MAX_POSITION = 2**31 - 1


# The paper's model sizes (docs/paper.md §4), named by their parameter count with the paper's
# 32,768-token vocabulary; with GPT-2's 50,257 tokens the counts are higher
# (`Transformer.num_params` says by how much).
PRESETS = {
    "49m": dict(n_embd=512, n_layer=6, n_head=16),
    "98m": dict(n_embd=768, n_layer=8, n_head=16),
    "121m": dict(n_embd=768, n_layer=12, n_head=16),
    "275m": dict(n_embd=1152, n_layer=15, n_head=24),
    "525m": dict(n_embd=1536, n_layer=18, n_head=32),
    "1.1b": dict(n_embd=2048, n_layer=24, n_head=64),
    # Beyond the paper, Llama's shapes (configs/paper/sizes;
    # docs/training.md "Past one GPU's memory")
    "3b": dict(n_embd=3072, n_layer=28, n_head=24, n_kv_head=8, mlp_hidden=8192),  # Llama 3.2 3B
    "7b": dict(n_embd=4096, n_layer=32, n_head=32, mlp_hidden=11008),  # Llama 2 7B
}


@dataclass
class ModelConfig:
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 16
    n_kv_head: int = 0  # grouped-query attention; 0 means n_head (plain multi-head attention)
    n_embd: int = 768
    # The width of each attention head; 0 means n_embd / n_head. Some imported models (import_hf.py)
    # have n_head x head width != n_embd; q, k, v and the output projection then map
    # n_embd <-> n_head x it.
    attn_head_dim: int = 0
    qkv_bias: bool = False  # a bias on the q, k and v projections (Qwen2), none on the output one
    # the LM head is the token embedding matrix (SmolLM, Llama 3.2 1B/3B, Qwen2)
    tie_embeddings: bool = False
    mlp_hidden: int = 0  # SwiGLU hidden width; 0 means 2 * n_embd as in the paper
    block_size: int = 512  # training context; nothing at inference depends on it
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # a name in ENCODINGS, the registry at the end of "Positional encodings" (PE_CHOICES)
    pe: str = "bam"
    rope_theta: float = 500_000.0  # the paper's RoPE baseline
    # RoPE context extension, applied at evaluation (docs/evaluation.md): none | linear (position
    # interpolation) | ntk | dynamic_ntk | yarn | llama3 (Llama 3.1's, part of the imported models
    # that have it), with the scale s = rope_factor
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_context: int = 0  # the context the RoPE model was trained at; 0 means block_size
    # Partial RoPE (p-RoPE, Barbero et al. 2024; docs/training.md): the share of each head's
    # head_dim / 2 rotation pairs that turn, the fastest ones at RoPE's own frequencies; the slowest
    # are left untouched. A whole number of pairs; 1.0 is RoPE, 0.0 NoPE.
    rope_fraction: float = 1.0
    # YaRN's ramp bounds, in rotations per original context (Peng et al. 2023)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Llama 3.1's ramp bounds, in rotations per original context: pairs turning fewer than low times
    # are divided by s, those turning more than high times kept, linear in the turn count in
    # between (Meta's 1 and 4)
    llama3_low_freq_factor: float = 1.0
    llama3_high_freq_factor: float = 4.0
    sinusoidal_base: float = 10_000.0  # the sinusoidal encoding's theta (Vaswani et al. 2017)
    # Sliding-window attention: query i sees key j only if 0 <= i - j < attn_window (and the same
    # document); 0 is off. RoPE-local (docs/paper.md §4) is pe = "rope", attn_window = block_size.
    attn_window: int = 0
    ssmax: bool = False  # Scalable-Softmax (Nakanishi 2025), docs/paper.md §3
    # Per-layer attention (docs/training.md "Per-layer patterns"): one word per layer, the list
    # repeated over n_layer, each word ENCODING[+ssmax|-ssmax][@WINDOW|@full][*COUNT], e.g.
    # "rope@256*3 nope@full" (RoPE with a 256-token window in three layers of four, NoPE with full
    # attention in the fourth). A part a word leaves out is the model-wide pe, ssmax or
    # attn_window above; "" gives every layer those (LayerKind, parse_layer_pattern).
    layer_pattern: str = ""
    # A learned sink logit per head and layer: one more term in each softmax's denominator, with no
    # value (gpt-oss), so a head may attend to nothing (docs/paper.md, "Sinks and gates")
    attn_sink: bool = False
    # A sigmoid gate from the layer's input on each head's output, elementwise, before the output
    # projection (Qiu et al. 2025, arXiv 2505.06708; Qwen3-Next)
    attn_gate: bool = False
    # QK-norm: an RMSNorm over each head's query and key, with a learned gain per channel shared by
    # the heads, before the rotation (Qwen3's; OLMo 2 normalises the whole projection instead), so
    # every logit is bounded by |q||k| / sqrt(d) times the gains (docs/training.md "QK-norm")
    qk_norm: bool = False
    attn_impl: str = "auto"  # auto | flex | sdpa | eager
    # How the flex kernel reads a distance-only prior: "table" gathers it from a per-head table
    # built once per forward in plain torch (distance_table), "formula" evaluates it per score
    # inside the kernel; the same numbers either way (docs/benchmarks.md, "Prior tables on flex").
    # SSMax's factor is read from its table by query (ssmax_table) in both.
    flex_prior: str = "table"
    # BAM's Generalized-Gaussian prior (docs/paper.md §2). The official code and the paper's runs
    # start from `alibi` (shape 1, scale = ALiBi slopes), so BAM begins training exactly as ALiBi.
    bam_per_layer: bool = True  # one prior per layer (the paper's 2 x heads x layers parameters)
    bam_init: str = "alibi"  # alibi | uniform | constant | sampled | linear
    bam_init_shape: float = 1.0  # used by bam_init = "constant"
    bam_init_log_scale: float = 0.0  # used by bam_init = "constant"
    bam_train_shape: bool = True
    bam_train_scale: bool = True
    bam_train_loc: bool = False  # the paper keeps the location at 0
    # T5's relative bias (Raffel et al. 2020): causal buckets, exact below half of them, log-spaced
    # up to the max distance, one bucket past it
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    # FIRE (Li et al. 2024): an MLP 1 -> fire_mlp_width -> heads on psi(i - j) / psi(max(L, i)),
    # psi(x) = log(c x + 1), c and L learned from these initial values
    fire_mlp_width: int = 32
    fire_init_c: float = 0.1
    fire_init_threshold: float = 512.0
    # FoX (Lin et al. 2025): the forget gates' initial bias b, so f = sigmoid(b + w . x) starts
    # near sigmoid(b); 0 (f ~ 1/2, a strong recency bias) is the reference code's, a large b
    # starts the gates open (f ~ 1)
    fox_gate_init_bias: float = 0.0

    def __post_init__(self):
        check_model_config(self)  # below, after the layer pattern

    @property
    def head_dim(self):
        return self.attn_head_dim or self.n_embd // self.n_head

    @property
    def layer_kinds(self):
        """Every layer's LayerKind (encoding, window, SSMax): the pattern's, or the model-wide."""
        return tuple(LayerKind(pe or self.pe, self.attn_window if window is None else window,
                               self.ssmax if ssmax is None else ssmax)
                     for pe, window, ssmax in parse_layer_pattern(self.layer_pattern, self.n_layer))

    @property
    def layer_windows(self):
        """Every layer's attention window (0: none), read now: an evaluator may change attn_window
        on a built model, and the layers that take the model-wide one follow it."""
        return tuple(kind.window for kind in self.layer_kinds)

    @property
    def encoding_label(self):
        """How logs name the encoding: "pe=bam + ssmax", or the layer pattern."""
        if self.layer_pattern:
            return f"layer_pattern={self.layer_pattern!r}"
        return f"pe={self.pe}{' + ssmax' if self.ssmax else ''}"

    @property
    def rope_context(self):
        """The context RoPE was trained at, which the scalings stretch from."""
        return self.rope_original_context or self.block_size

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def hidden_dim(self):
        return self.mlp_hidden or 2 * self.n_embd

    @classmethod
    def from_dict(cls, values, strict=False, **overrides):
        """The config a saved dict describes (a checkpoint's model_config, an export's bam_model),
        validated. A key this model.py does not know is dropped (lenient: the fields a newer
        model.py added) or, with `strict`, refused: a KeyError naming the keys, where dropping them
        would change the model silently. `overrides` replace saved fields that do not touch the
        weights (e.g. attn_impl)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values or {}) - known)
        if strict and unknown:
            raise KeyError(f"model settings this model.py does not know: {', '.join(unknown)}")
        return cls(**{**{k: v for k, v in (values or {}).items() if k in known}, **overrides})

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})



# One layer's attention: its encoding (a name in ENCODINGS), its sliding window (0: none) and
# whether it has SSMax. ModelConfig.layer_kinds gives every layer's.
LayerKind = namedtuple("LayerKind", "pe window ssmax")
LAYER_WORD = re.compile(r"(?P<pe>\w*?)(?P<ssmax>[+-]ssmax)?(?:@(?P<window>\d+|full))?"
                        r"(?:\*(?P<count>\d+))?")
LAYER_WORD_FORM = "ENCODING[+ssmax|-ssmax][@WINDOW|@full][*COUNT]"


def parse_layer_pattern(pattern, n_layer):
    """ModelConfig.layer_pattern as n_layer LayerKinds, None where a word leaves a part to the
    model-wide field; its words repeat until every layer has one. ValueError naming the first word
    that is not LAYER_WORD_FORM, or a pattern that does not divide n_layer. The layers a pattern
    describes are counted before any is listed, so a repeat count of a billion is refused in
    constant memory."""
    words = pattern.replace(",", " ").split()
    if not words:
        return (LayerKind(None, None, None),) * n_layer
    cycle = []  # (LayerKind, count) per word
    for word in words:
        match = LAYER_WORD.fullmatch(word)
        try:  # int() refuses a number of more than 4,300 digits
            count = int(match["count"] or 1) if match else 0
            window = None if match is None or match["window"] is None else (
                0 if match["window"] == "full" else int(match["window"]))
        except ValueError:
            match = None
        if match is None or word.startswith("*") or count < 1:
            shown = word if len(word) <= 40 else word[:40] + "..."
            raise ValueError(f"layer_pattern word {shown!r} is not {LAYER_WORD_FORM} (e.g. "
                             f"'rope@256*3', 'bam+ssmax@full', 'nope'), COUNT >= 1")
        ssmax = None if match["ssmax"] is None else match["ssmax"] == "+ssmax"
        cycle.append((LayerKind(match["pe"] or None, window, ssmax), count))
    length = sum(count for _, count in cycle)
    if n_layer % length:
        raise ValueError(f"layer_pattern {pattern!r} describes {length} layers, which does not "
                         f"divide n_layer={n_layer}: it must repeat a whole number of times")
    return tuple(kind for kind, count in cycle for _ in range(count)) * (n_layer // length)


# What ModelConfig refuses. The ranges of the model's own numeric fields are CORE_RANGES; an
# encoding's options have theirs, and its other checks, in its class (Encoding.RANGES and
# Encoding.check), and model_ranges() is the union of all of them. A range is
# bam/ranges.py's notation, always finite as well; it refuses nonsense (a width below 1, a negative
# count), never a value the method admits. A new numeric field needs its range: tests/test_ranges.py
# fails for one without. Windows and the training context stop at MAX_POSITION: past it a position
# (in the header) no longer fits the int32 indices of the attention kernels, and every longer window
# is the same as full attention at any length a model can be run at.
CORE_RANGES = {
    "vocab_size": ">= 1", "n_layer": ">= 1", "n_head": ">= 1", "n_kv_head": ">= 0",
    "n_embd": ">= 1", "mlp_hidden": ">= 0", "attn_head_dim": ">= 0",
    "block_size": f">= 1, <= {MAX_POSITION}", "norm_eps": "> 0, < 1", "init_std": "> 0, <= 10",
    "attn_window": f">= 0, <= {MAX_POSITION}",
}


def check_model_config(cfg):
    """ValueError("model config: ...") naming the first setting of `cfg` that is not allowed: the
    numbers out of range first, then the choices, the shapes and the layer pattern, then each
    encoding's own checks (of its options, whether a layer uses it or not)."""

    def bad(msg):
        raise ValueError(f"model config: {msg}")

    check_ranges(cfg, model_ranges(), bad)
    if cfg.pe not in ENCODINGS:
        bad(f"unknown pe {cfg.pe!r}; allowed: {', '.join(ENCODINGS)}")
    if cfg.attn_impl not in ATTN_IMPLS:
        bad(f"unknown attn_impl {cfg.attn_impl!r}; allowed: {', '.join(ATTN_IMPLS)}")
    if cfg.flex_prior not in FLEX_PRIORS:
        bad(f"unknown flex_prior {cfg.flex_prior!r}; allowed: {', '.join(FLEX_PRIORS)}")
    if cfg.n_embd % cfg.n_head and not cfg.attn_head_dim:
        bad(f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd} (or set attn_head_dim)")
    if cfg.n_kv_head and cfg.n_head % cfg.n_kv_head:
        bad(f"n_kv_head={cfg.n_kv_head} must divide n_head={cfg.n_head} (or be 0 for n_head)")
    kinds = check_layer_pattern(cfg, bad)
    for pe in dict.fromkeys(kind.pe for kind in kinds):
        even = ENCODINGS[pe].even_width
        if even and getattr(cfg, even) % 2:
            bad(f"{pe} needs an even {even}, got {even}={getattr(cfg, even)}")
    for encoding in dict.fromkeys(ENCODINGS.values()):
        encoding.check(cfg, kinds, bad)


def model_ranges():
    """What every numeric ModelConfig field may be: the model's own (CORE_RANGES), then every
    registered encoding's (Encoding.RANGES)."""
    return {**CORE_RANGES, **{name: spec for encoding in ENCODINGS.values()
                              for name, spec in encoding.RANGES.items()}}


def check_layer_pattern(cfg, bad):
    """Every layer's LayerKind; bad(msg) for a layer_pattern that does not parse, fit n_layer, name
    known encodings or give windows within attn_window's range, or one that mixes an embedding
    (sinusoidal) with other encodings: it is added to the tokens once, before every layer, so it is
    the whole model's or none."""
    if not isinstance(cfg.layer_pattern, str):
        bad(f"layer_pattern must be a string of words {LAYER_WORD_FORM}, got "
            f"{cfg.layer_pattern!r}")
    try:
        kinds = cfg.layer_kinds
    except ValueError as e:
        bad(str(e))
    for pe in dict.fromkeys(kind.pe for kind in kinds):
        if pe not in ENCODINGS:
            bad(f"unknown encoding {pe!r} in layer_pattern {cfg.layer_pattern!r}; allowed: "
                f"{', '.join(ENCODINGS)}")
    for window in dict.fromkeys(kind.window for kind in kinds):  # >= 0 by LAYER_WORD
        if window > MAX_POSITION:
            bad(f"layer_pattern {cfg.layer_pattern!r}: window {window}: allowed: an integer "
                f"{CORE_RANGES['attn_window']}, as attn_window")
    embeddings = {kind.pe for kind in kinds if ENCODINGS[kind.pe].embedding is not None}
    if embeddings and len({kind.pe for kind in kinds}) > 1:
        bad(f"layer_pattern {cfg.layer_pattern!r} mixes {', '.join(sorted(embeddings))} with "
            f"other encodings: it is added to the token embeddings once for every layer, so it "
            f"can only be the whole model's pe")
    return kinds


_LIMIT = {">=": float.__ge__, ">": float.__gt__, "<=": float.__le__, "<": float.__lt__}


def check_ranges(obj, table, bad):
    """bad("NAME = VALUE: allowed: ...") for a field of `obj` that is not a finite number
    within its range in `table` ("> 0", ">= 0, <= 1"). ranges.check does the same for the other
    configs and the command lines; this copy keeps model.py free of the repository's other
    modules (it is exported alone)."""
    for name, spec in table.items():
        value, kind = getattr(obj, name), type(getattr(type(obj), name, 0.0))
        integer = kind is int
        ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
        ok = ok and math.isfinite(value)
        for part in spec.split(",") if spec else ():  # "": any finite number
            op, _, limit = part.strip().partition(" ")
            ok = ok and _LIMIT[op](float(value), float(limit))
        if not ok:
            what = "an integer" if integer else "a finite number"
            bad(f"{name} = {value!r}: allowed: {what} {spec}".rstrip())


# --------------------------------------------------------------------------------------------------
# The model, top-down: Transformer -> Block -> Attention (and SwiGLU), then the KV cache of
# generation. What an encoding and an attention path are comes after, in their own parts.


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        kinds = cfg.layer_kinds
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg, kind) for kind in kinds])
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied, as in the paper
        # The encodings' roles over the layers: a pattern mixes them (layer_pattern), but an
        # embedding (sinusoidal) is the whole model's or none (check_layer_pattern)
        encodings = [ENCODINGS[kind.pe] for kind in kinds]
        self.position_embedding = encodings[0].embedding
        self.rotation = next((e.rotation for e in encodings if e.rotation is not None), None)
        # the prior modules (empty without a prior), and for each layer the index of its own or None
        self.priors, self.prior_index = make_priors(cfg, kinds)
        self.has_ssmax = any(kind.ssmax for kind in kinds)  # in some layer: log n is computed
        self.apply(self._init_weights)
        # one matrix, the embedding's (its init); the state dict names it under both keys
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # GPT-2 / nanoGPT: shrink the residual-stream writes with depth so activations stay O(1)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        build_flex_kernels(self)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        # qkv_bias starts at 0; a prior's own biases (FoX's gates) keep their init
        if isinstance(module, Attention):
            for projection in (module.wq, module.wk, module.wv):
                if projection.bias is not None:
                    nn.init.zeros_(projection.bias)

    def forward(self, idx, targets=None, doc_ids=None, last_k=None, kv_cache=None, start_pos=0,
                sparse_targets=False):
        """idx (B, T) tokens -> (logits, loss). With `last_k`, logits (and loss) only for
        the last k positions: long-context evaluation never builds a T x vocab tensor.
        `doc_ids` (B, T) restricts attention to earlier tokens of the same document. Targets
        of -1 are ignored by the loss; with `sparse_targets` (most of them -1) the output
        layer runs only at the N other positions and the logits are (N, vocab): the same
        loss for a fraction of the output layer's cost."""
        pos_in_doc = token_positions(idx, doc_ids, start_pos)
        x = self.tok_emb(idx)
        if self.position_embedding is not None:
            x = x + self.position_embedding(pos_in_doc, self.config).to(x.dtype)
        # each layer's AttnContext (one per distinct window, shared) and prior table (flex)
        contexts, tables = attention_contexts(self, idx.shape[1], pos_in_doc, doc_ids, kv_cache,
                                              start_pos)
        for layer, block in enumerate(self.blocks):
            # the Block gets no layer index: a compiled Block would guard on it, once per layer
            cache = None if kv_cache is None else LayerCache(kv_cache, layer)
            x = block(x, contexts[layer], self.prior_of_layer(layer), tables[layer], cache)
        return self._logits_and_loss(x, targets, last_k, sparse_targets)

    def prior_of_layer(self, layer):
        """The layer's prior module, or None where it has no prior."""
        index = self.prior_index[layer]
        return None if index is None else self.priors[index]

    def _logits_and_loss(self, x, targets, last_k, sparse_targets):
        if last_k is not None:
            x = x[:, -last_k:]
        if sparse_targets:
            if targets is None:
                raise ValueError("sparse_targets needs targets: it computes logits only where they "
                                 "are not -1")
            if last_k is not None and targets.shape[1] != x.shape[1]:
                targets = targets[:, -last_k:]
            keep = targets != -1
            x, targets = x[keep], targets[keep]  # (N, C), (N,)
            logits = self.lm_head(self.norm(x))
            # No target in the batch: a zero loss that still reaches every parameter (not a NaN).
            loss = (F.cross_entropy(logits.float(), targets) if len(targets)
                    else logits.sum() * 0 + x.sum() * 0)
            return logits, loss
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            if last_k is not None and targets.shape[1] != logits.shape[1]:
                targets = targets[:, -last_k:]
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample continuations of idx (B, T) with a KV cache; temperature 0 is greedy decoding."""
        B, T = idx.shape
        dtype = self.lm_head.weight.dtype
        cache = KVCache(self.config, B, T + max_new_tokens, idx.device, dtype)
        logits, _ = self(idx, last_k=1, kv_cache=cache)
        out = [idx]
        for step in range(max_new_tokens):
            logits = logits[:, -1].float()
            if temperature == 0:
                next_tok = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_tok = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            out.append(next_tok)
            if step + 1 < max_new_tokens:
                logits, _ = self(next_tok, kv_cache=cache, start_pos=T + step)
        return torch.cat(out, dim=1)

    # -- conveniences ------------------------------------------------------------------------------

    def prior_parameters(self):
        """BAM's prior, SSMax's scales and the sinks' logits: an optimizer group of their own
        (docs/paper.md §4), kept in fp32 and logged per head. The sinks join SSMax's scales as the
        other per-head number that shapes how softmax spends its mass; the gate's projection is a
        matrix like q's (a part of q's in the paper's code) and is decayed with it."""
        params = [p for prior in self.priors for p in prior.parameters()]
        params += [b.attn.ssmax_scale for b in self.blocks if b.attn.ssmax_scale is not None]
        params += [b.attn.sink_logit for b in self.blocks if b.attn.sink_logit is not None]
        return params

    def optim_groups(self, weight_decay, decay_embeddings=True):
        """Weight decay on matrices only (docs/paper.md §4): none on norms, prior, SSMax, sinks."""
        prior_ids = {id(p) for p in self.prior_parameters()}
        embeddings = {id(self.tok_emb.weight)}
        decay, no_decay, prior = [], [], []
        for p in self.parameters():
            if not p.requires_grad:
                continue
            if id(p) in prior_ids:
                prior.append(p)
            elif p.dim() >= 2 and (decay_embeddings or id(p) not in embeddings):
                decay.append(p)
            else:
                no_decay.append(p)
        groups = [dict(name="decay", params=decay, weight_decay=weight_decay),
                  dict(name="no_decay", params=no_decay, weight_decay=0.0),
                  dict(name="prior", params=prior, weight_decay=0.0)]
        return [g for g in groups if g["params"]]

    def prior_summary(self):
        """Every head's positional parameters, per layer: {name: [[head values] per layer]}."""
        summary = {}
        for prior in self.priors:
            for name, values in prior.head_parameters().items():
                summary.setdefault(f"{prior.METRICS_PREFIX}_{name}", []).append(values)
        for name in ("ssmax_scale", "sink_logit"):
            values = [getattr(b.attn, name).tolist() for b in self.blocks
                      if getattr(b.attn, name) is not None]
            if values:
                summary[name] = values
        return summary

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N for the matmuls (the
        embedding lookup is not one) plus 12 L H hd T for attention scores and values."""
        cfg = self.config
        # a matmul, though its matrix is the embedding
        head = self.lm_head.weight.numel() if cfg.tie_embeddings else 0
        return (6 * (self.num_params(non_embedding=True) + head)
                + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len)


def make_priors(cfg, kinds):
    """An encoding that is a prior gets a module per layer that uses it, or, where it is shared
    (copies 1: ALiBi, T5, BAM with bam_per_layer false), one for all of them; the modules in the
    order of their first layer, and for each layer the index of its own or None. Without a
    pattern: n_layer modules, or one."""
    modules, index, shared = nn.ModuleList(), [], {}
    for kind in kinds:
        encoding = ENCODINGS[kind.pe]
        if encoding.copies(cfg) == 0:
            index.append(None)
            continue
        if encoding.copies(cfg) > 1 or kind.pe not in shared:
            shared[kind.pe] = len(modules)
            modules.append(encoding(cfg))
        index.append(shared[kind.pe])
    return modules, tuple(index)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: LayerKind = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg, kind)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, ctx, prior_module, tabled_prior=None, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), ctx, prior_module, tabled_prior, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class Attention(nn.Module):
    """One layer's attention, of its LayerKind (the model-wide one if none is given): the kind's
    encoding rotates q and k or not, and SSMax has its scales here or not; the window comes with
    the context (AttnContext.window) and the prior with the call."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind = None):
        super().__init__()
        kind = LayerKind(cfg.pe, cfg.attn_window, cfg.ssmax) if kind is None else kind
        self.cfg = cfg
        self.rotary = ENCODINGS[kind.pe].rotation is not None
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.n_embd, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.n_embd, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        # SSMax's s_h, per head and per layer, init 1 (docs/paper.md §3)
        self.ssmax_scale = nn.Parameter(torch.ones(cfg.n_head)) if kind.ssmax else None
        # The sink logit, per head and per layer, shape (n_head,) (FSDP2 shards no 0-d tensor). It
        # starts at 0, where transformers starts gpt-oss's, N(0, 0.02), up to a few hundredths: one
        # more key scoring 0, which takes 1 / (n + 1) of a row of n equal scores. Zeros draw
        # nothing from the random generator: every other weight starts as without sinks.
        self.sink_logit = nn.Parameter(torch.zeros(cfg.n_head)) if cfg.attn_sink else None
        # The gate's projection, as the paper's code makes it (more output columns of q's
        # projection, so initialised as q's: N(0, init_std)); every gate starts near 1/2
        self.wg = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=False) if cfg.attn_gate else None
        # QK-norm's gains, (head_dim,) each, start at 1: the unit-RMS query and key
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else None

    def project(self, x, ctx):
        """q, k, v of x, (B, heads, T, head_dim), as every attention implementation receives
        them (q and k normalised with QK-norm, then rotated for a rotary encoding); eval.attention
        scores its sampled queries with the same ones."""
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # before the rotation, which keeps the norm of each pair
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary and ctx.rope is not None:
            q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
        return q, k, v

    def forward(self, x, ctx, prior_module, tabled_prior=None, kv_cache=None):
        """`tabled_prior`: this layer's prior read from a table built for this forward
        (flex_prior_tables), or None; `kv_cache`: this layer's LayerCache, or None."""
        B, T, _ = x.shape
        q, k, v = self.project(x, ctx)
        if kv_cache is not None:
            k, v = kv_cache.update(int(ctx.q_pos[0]), k, v)
        if tabled_prior is not None:
            prior, features = tabled_prior, None
        else:
            prior, features = layer_prior(prior_module, x, ctx, kv_cache)
        y = ATTENTION[ctx.impl](q, k, v, ctx, prior, self.ssmax_scale, features, self.sink_logit)
        if self.wg is not None:
            y = y * self.output_gate(x)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def output_gate(self, x):
        """Gated attention's sigmoid(x W_g), (B, heads, T, head_dim): one gate per head and output
        element, from the layer's normalised input at the query (Qiu et al. 2025's best variant,
        G1 elementwise, which Qwen3-Next ships; a head-wide scalar gate trails it there)."""
        B, T, _ = x.shape
        gate = self.wg(x).view(B, T, self.cfg.n_head, self.cfg.head_dim).transpose(1, 2)
        return torch.sigmoid(gate)


def layer_prior(prior_module, x, ctx, kv_cache=None):
    """What one layer's attention takes from its prior module: (prior, features), `prior` =
    (bias_fn, tensors) or None, `features` = (at the queries, at the keys), each the tuple of the
    prior's token features (AdditivePrior.token_features) of x, or None for a prior of the distance
    alone. With the layer's KV cache (LayerCache), the keys' features are the cached ones followed
    by the new ones."""
    if prior_module is None:
        return None, None
    if ctx.impl == "flex":  # the form FlexAttention's score_mod reads, over the kernel's length
        prior = (prior_module.kernel_bias_fn or prior_module.bias_fn,
                 prior_module.kernel_tensors(ctx.mask.seq_lengths[0], x.device))
    else:
        prior = (prior_module.bias_fn, prior_module.tensors())
    if prior_module.DISTANCE_ONLY:
        return prior, None
    if kv_cache is None:  # training and full forwards: no position read back from the device
        new = prior_module.token_features(x, ctx.pos_in_doc, None)
        return prior, (new, new)
    start = int(ctx.q_pos[0])
    new = prior_module.token_features(x, ctx.pos_in_doc, kv_cache.past_features(start))
    return prior, (new, kv_cache.update_features(start, new))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.n_embd, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class KVCache:
    """Keys and values (after RoPE) of every layer, for generation: preallocated for the whole
    sequence, or, in a layer with a sliding window, only the last window - 1 positions, which are
    all a later query can see. Each layer has its own window (ModelConfig.layer_kinds)."""

    def __init__(self, cfg, batch_size, max_len, device, dtype):
        self.windows = cfg.layer_windows
        self.k = [torch.zeros((batch_size, cfg.kv_heads, 0 if window else max_len, cfg.head_dim),
                              device=device, dtype=dtype) for window in self.windows]
        self.v = [torch.zeros_like(k) for k in self.k]
        # a prior's token features of the cached keys (FoX, FIRE)
        self.features = [() for _ in range(cfg.n_layer)]
        self.max_len = max_len
        # a windowed layer holds no earlier positions to go back to: the first and the last of them
        # check and advance where the next call must start
        windowed = [layer for layer, window in enumerate(self.windows) if window]
        self.windowed_span = (windowed[0], windowed[-1]) if windowed else None
        self.next_position = 0

    @staticmethod
    def first_key(start, window):
        """Position of the first key that queries from position `start` on attend over, in a layer
        with this window (0: none)."""
        return max(0, start - (window - 1)) if window else 0

    def update(self, layer, start, k, v):
        """Store the keys and values of positions start, start + 1, ...; return those of positions
        first_key(start) ... the last one stored, which the current queries attend over."""
        end, window = start + k.shape[2], self.windows[layer]
        if not window:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        first, last = self.windowed_span
        if start != self.next_position and layer == first:
            raise ValueError(f"a windowed KV cache continues where it stopped: position {start} "
                             f"was not next ({self.next_position} was)")
        if layer == last:
            self.next_position = end
        k, v = torch.cat((self.k[layer], k), dim=2), torch.cat((self.v[layer], v), dim=2)
        keep = end - self.first_key(end, window)
        self.k[layer], self.v[layer] = k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:]
        return k, v

    def past_features(self, layer, start):
        """The prior's token features (layer_prior) of the cached positions before `start`; or
        None where there are none."""
        stored = self.features[layer]
        if not stored:
            return None
        return stored if self.windows[layer] else tuple(t[..., :start] for t in stored)

    def update_features(self, layer, start, features):
        """As `update`, for the prior's token features, (B or 1, H or 1, T) each: those of the keys
        the current queries attend over."""
        past = self.past_features(layer, start) or tuple(t[..., :0] for t in features)
        joined = tuple(torch.cat(broadcast_leading(p, t), dim=-1) for p, t in zip(past, features))
        window, end = self.windows[layer], start + features[0].shape[-1]
        keep = end - self.first_key(end, window)
        self.features[layer] = (tuple(t[..., t.shape[-1] - keep:] for t in joined) if window
                                else joined)
        return joined


class LayerCache:
    """One layer's view of a KV cache (KVCache, or modeling_bam's over the library's), which its
    Attention reads and writes without knowing its index: the cache's methods with the layer
    given."""

    def __init__(self, cache, layer):
        self.cache, self.layer = cache, layer

    def update(self, start, k, v):
        return self.cache.update(self.layer, start, k, v)

    def past_features(self, start):
        return self.cache.past_features(self.layer, start)

    def update_features(self, start, features):
        return self.cache.update_features(self.layer, start, features)


def broadcast_leading(a, b):
    """a and b expanded to the same leading dimensions, their last ones kept (to join along it)."""
    lead = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    return a.expand(*lead, a.shape[-1]), b.expand(*lead, b.shape[-1])


def token_positions(idx, doc_ids=None, start_pos=0):
    """(B or 1, T): the position of each token of idx (B, T), from start_pos, inside its document.
    RoPE and the priors only see differences, which are the same either way; the sinusoidal
    encoding and SSMax's key count need the in-document position."""
    B, T = idx.shape
    if doc_ids is None:
        return torch.arange(start_pos, start_pos + T, device=idx.device)[None]
    if start_pos:
        raise ValueError("doc_ids cannot be combined with a KV cache")
    if doc_ids.shape != (B, T):
        raise ValueError(f"doc_ids must have the shape of idx, {(B, T)}, "
                         f"got {tuple(doc_ids.shape)}")
    # The order check reads the tensor back (a device sync, and a graph break under
    # torch.compile), so it runs only where that is free: eager calls on CPU tensors. ShardLoader's
    # ids are ordered by construction (a cumulative count of EOTs); a GPU caller is trusted as the
    # compiled one is.
    if doc_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        check_doc_ids(doc_ids)
    return positions_in_documents(doc_ids)


def check_doc_ids(doc_ids):
    """Documents are contiguous runs of a row: ids must never decrease along it."""
    if doc_ids.shape[-1] > 1 and bool((doc_ids[..., 1:] < doc_ids[..., :-1]).any()):
        raise ValueError("doc_ids must be non-decreasing along each row (documents are contiguous)")


def positions_in_documents(doc_ids):
    """(B, T) position of each token inside its document: 0 where its document starts."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.arange(doc_ids.shape[1], device=doc_ids.device) - last_document_start(starts)


def last_document_start(starts):
    """For (..., T) bools marking where documents start, the index of the last start at or before
    each token (0 where none is): where its document begins."""
    index = torch.arange(starts.shape[-1], device=starts.device)
    return torch.where(starts, index, 0).cummax(dim=-1).values


# --------------------------------------------------------------------------------------------------
# Positional encodings. Each one is a small class registered once in ENCODINGS (at the end of this
# part) that owns its options: their ranges (RANGES) and checks (check) sit in it, beside its code;
# everything else (the config's choices, the attention paths, the evaluators, benchmarks and tests)
# reads the registry. An encoding plays at most these roles (docs/INTERFACES.md): rotate q
# and k (`rotation`: RoPE), add to the token embeddings (`embedding`: sinusoidal), or add a prior to
# every attention logit (an AdditivePrior: ALiBi, BAM, KERPLE, T5, FIRE, FoX). A prior's contract is
# three hooks:
#
#   bias_fn            a plain torch expression of the distance i - j, the head, the prior's tensors
#   tensors()          what bias_fn takes after the distance and the head (constrained values)
#   head_parameters()  every head's values, {name: [value per head]}: metrics.jsonl, eval.priors
#
# and, where needed, `copies` (how many modules), `DISTANCE_ONLY = False` with `token_features` (a
# bias that reads more than the distance). The hooks that only serve eval/ stay apart in each class,
# under the comment "For eval/ only".


class Encoding:
    """What an encoding may set; a role it does not play stays None; with none at all, NoPE."""

    even_width = None  # a ModelConfig field this encoding needs even (rotation and sin/cos pairs)
    # rotation(positions, cfg, length=None) -> (cos, sin) that rotate q and k at these
    # positions; `length` is how many positions the forward reaches (for a rotation that depends
    # on it, as dynamic NTK does)
    rotation = None
    # embedding(positions, cfg) -> (..., T, n_embd) added to the token embeddings at these
    # in-document positions
    embedding = None
    # Settings that take another code path inside this encoding, each {ModelConfig field: value}:
    # the correctness grids (tests/model/test_attention_paths.py, bench/gpu_check) check each of
    # them beside the defaults, through CHECKED_SETTINGS
    checked_settings = ()
    # The encoding's options are ModelConfig fields named after it (as bam_init); RANGES gives each
    # numeric one its range (CORE_RANGES' notation; model_ranges() is the union), and check refuses
    # what a range cannot say. ModelConfig checks every registered encoding's options, whether a
    # layer uses it or not, so a typo in one is refused even where it would do nothing.
    RANGES = {}
    # The options that say only where a parameter starts (BAM's bam_init): train.init_from loads the
    # checkpoint's parameters over them, so they may always change there (bam.config)
    INIT_KEYS = ()

    @classmethod
    def check(cls, cfg, kinds, bad):
        """bad(msg) for the first of this encoding's settings in `cfg` that is not allowed (its
        ranges are already checked); `kinds` are the layers' LayerKinds."""

    @classmethod
    def copies(cls, cfg):
        """How many prior modules the model holds (AdditivePrior: one per layer, or one shared)."""
        return 0

    # For eval/ only: the group eval.report's small-multiples plot draws it with: baselines | RoPE |
    # fixed and kernel priors | BAM | learnable-bias rivals
    family = "baselines"


class NoPE(Encoding):
    """Nothing but the causal mask: a uniform prior over positions (docs/paper.md §1)."""


class RoPE(Encoding):
    """Rotary embedding (Su et al. 2021), theta 500K as the paper's baseline; computed from
    positions on the fly, so no table runs out past the training length."""

    even_width = "head_dim"
    checked_settings = ({"rope_fraction": 0.5},)  # partial RoPE: half the pairs turn
    family = "RoPE"  # for eval/ only
    SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")  # rope_frequencies
    # Bases below 2 would make the frequencies grow with the pair index (or all equal 1) instead of
    # spreading them out
    RANGES = {"rope_theta": ">= 2", "rope_factor": ">= 1",
              "rope_original_context": f">= 0, <= {MAX_POSITION}", "rope_fraction": ">= 0, <= 1",
              "yarn_beta_fast": "> 0", "yarn_beta_slow": "> 0",
              "llama3_low_freq_factor": "> 0", "llama3_high_freq_factor": "> 0"}

    @classmethod
    def check(cls, cfg, kinds, bad):
        """The scalings' settings and partial RoPE's share of pairs (rope_fraction): a whole
        number of pairs, on a rotary encoding, and with something left to scale."""
        rotary = any(ENCODINGS[k.pe].rotation is not None for k in kinds)
        where = f", got pe={cfg.pe!r}" + (f", layer_pattern={cfg.layer_pattern!r}"
                                           if cfg.layer_pattern else "")
        if cfg.rope_scaling not in cls.SCALINGS:
            bad(f"unknown rope_scaling {cfg.rope_scaling!r}; allowed: {', '.join(cls.SCALINGS)}")
        if not 0 < cfg.yarn_beta_slow < cfg.yarn_beta_fast:
            bad(f"YaRN needs 0 < yarn_beta_slow < yarn_beta_fast, got {cfg.yarn_beta_slow} and "
                f"{cfg.yarn_beta_fast}")
        if cfg.rope_scaling == "none" and cfg.rope_factor != 1.0:
            bad(f"rope_factor={cfg.rope_factor} has no effect with rope_scaling='none'; choose "
                f"one of {', '.join(cls.SCALINGS[1:])}")
        if cfg.rope_scaling != "none" and not rotary:
            bad(f"rope_scaling needs a rotary encoding (pe = 'rope' in some layer){where}")
        if not cfg.llama3_low_freq_factor < cfg.llama3_high_freq_factor:
            bad(f"llama3 scaling needs llama3_low_freq_factor < llama3_high_freq_factor, got "
                f"{cfg.llama3_low_freq_factor} and {cfg.llama3_high_freq_factor}")
        pairs = cfg.head_dim // 2
        if abs(cfg.rope_fraction * pairs - round(cfg.rope_fraction * pairs)) > 1e-9:
            bad(f"rope_fraction={cfg.rope_fraction} turns {cfg.rope_fraction * pairs:g} of the "
                f"{pairs} pairs of head_dim={cfg.head_dim}; allowed: a multiple of 1/{pairs}")
        if cfg.rope_fraction != 1.0 and not rotary:
            bad(f"rope_fraction needs a rotary encoding (pe = 'rope' in some layer){where}")
        if cfg.rope_scaling != "none" and rotated_pairs(cfg) == 0:
            bad(f"rope_scaling={cfg.rope_scaling!r} has no effect with rope_fraction=0 (no pair "
                f"turns)")
        if cfg.rope_scaling in ("ntk", "dynamic_ntk") and rotated_pairs(cfg) <= 1:
            bad(f"rope_scaling={cfg.rope_scaling!r} needs more than one turning pair (its exponent "
                f"is d / (r - 2), r = 2 x pairs), got head_dim={cfg.head_dim} at "
                f"rope_fraction={cfg.rope_fraction}")

    @staticmethod
    def rotation(positions, cfg, length=None):
        length = int(positions[-1]) + 1 if length is None else length
        inv_freq, factor = rope_frequencies(cfg, length, positions.device)
        # float64: at 500K positions fp32 angles would be off by ~0.03 rad before the cosine.
        angles = positions.to(torch.float64)[..., None] * inv_freq
        cos, sin = (factor * angles.cos()).float(), (factor * angles.sin()).float()
        # Partial RoPE: the pairs that do not turn get cos 1 and sin 0 (YaRN's factor stays on the
        # turning ones), which apply_rope passes through exactly (x * 1 - y * 0 == x).
        still = cfg.head_dim // 2 - inv_freq.shape[-1]
        if still:
            cos, sin = F.pad(cos, (0, still), value=1.0), F.pad(sin, (0, still), value=0.0)
        return cos, sin


def apply_rope(x, cos, sin):
    """Rotate (B, H, T, hd) by position; the pairs are (x[:hd/2], x[hd/2:]), a fixed permutation of
    Llama's interleaved pairs that leaves the attention scores the same."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def rotated_pairs(cfg):
    """How many of the head_dim / 2 rotation pairs turn: all but the slowest under rope_fraction
    (p-RoPE, docs/training.md "Partial RoPE"). RoPE.check holds it to a whole number."""
    return round(cfg.rope_fraction * (cfg.head_dim // 2))


def rope_frequencies(cfg, length, device=None):
    """RoPE's inverse frequencies (float64, one per turning pair, rotated_pairs(cfg), on `device`)
    under cfg.rope_scaling, with s = rope_factor and L0 = cfg.rope_context, and the factor YaRN
    puts on cos and sin (1 otherwise). Partial RoPE keeps the fastest pairs at their frequencies
    theta^(-2i/d) and the scalings act on them alone: NTK stretches the slowest turning pair by s,
    YaRN's ramp ends at the turning width. `length` is how many positions the current forward
    reaches (its last query + 1); only dynamic NTK reads it. Built where the positions are: a table
    built on the host and copied would cost a CPU kernel and a blocking host-to-device copy in
    every forward (tests/model/test_attention_paths.py holds the forward to one device).

      linear       position interpolation (Chen et al. 2023): every frequency / s
      ntk          NTK-aware (bloc97 2023): base theta * s^(d / (r - 2)), d = head_dim, r = 2 x
                   the turning pairs (d for full RoPE), which stretches the lowest turning frequency
                   by exactly s and leaves the highest alone
      dynamic_ntk  NTK-aware with the scale growing with the length, as transformers and Code Llama:
                   base theta * (s L / L0 - (s - 1))^(d / (r - 2)) once L > L0, theta up to L0
      yarn         YaRN (Peng et al. 2023): frequencies blended by yarn_ramp, temperature below
      llama3       Llama 3.1's frequencies blended by llama3_ramp (imported Llama 3.x models)"""
    d, theta, s, L0 = cfg.head_dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_context
    kind, pairs = cfg.rope_scaling, rotated_pairs(cfg)
    if kind == "ntk":
        theta = theta * s ** (d / (2 * pairs - 2))
    elif kind == "dynamic_ntk" and length > L0:
        theta = theta * (s * length / L0 - (s - 1)) ** (d / (2 * pairs - 2))
    inv_freq = inverse_frequencies(d, theta, device)[:pairs]
    if kind == "linear":
        return inv_freq / s, 1.0
    if kind == "yarn":
        ramp = yarn_ramp(cfg, device)
        # The paper's attention temperature: softmax(q.k / (t sqrt(d))) with
        # sqrt(1/t) = 0.1 ln s + 1. As the paper's code (and transformers) do, sqrt(1/t)
        # multiplies cos and sin, so q and k each carry one factor and the logit gets
        # 1/t = (0.1 ln s + 1)^2 on every path, cached keys included.
        return inv_freq * (1 - ramp) + inv_freq / s * ramp, 0.1 * math.log(s) + 1.0
    if kind == "llama3":
        ramp = llama3_ramp(cfg, inv_freq)
        return inv_freq * (1 - ramp) + inv_freq / s * ramp, 1.0
    return inv_freq, 1.0


def yarn_ramp(cfg, device=None):
    """YaRN's blend per rotation pair (Peng et al. 2023, "NTK-by-parts"): 0 keeps the pair's
    frequency (it turns more than beta_fast times over the original context L0, so it has seen every
    angle), 1 divides it by s as position interpolation does (fewer than beta_slow turns), linear in
    between. As in the reference code (jquesnelle/yarn) and transformers, the ramp is linear in the
    pair index between the two crossing points rounded outward, not linear in the turn count r as
    the paper's equation writes it; this keeps our YaRN numbers comparable with published YaRN
    models. Pair i turns r = L0 / (2 pi theta^(2i/d)) times, so the crossing of r is at
    i = d ln(L0 / (2 pi r)) / (2 ln theta). Under partial RoPE the ramp spans the turning pairs
    only, as transformers' does over its rotary width."""
    d, theta, L0, pairs = cfg.head_dim, cfg.rope_theta, cfg.rope_context, rotated_pairs(cfg)

    def pair_index(turns):
        return d * math.log(L0 / (2 * math.pi * turns)) / (2 * math.log(theta))

    low = max(math.floor(pair_index(cfg.yarn_beta_fast)), 0)
    # 2 x pairs - 1 (not pairs - 1) as the reference's dim - 1
    high = min(math.ceil(pair_index(cfg.yarn_beta_slow)), 2 * pairs - 1)
    span = max(high - low, 1e-3)  # the reference's guard against a zero-width ramp
    return ((torch.arange(pairs, dtype=torch.float64, device=device) - low) / span).clamp(0.0, 1.0)


def llama3_ramp(cfg, inv_freq):
    """Llama 3.1's blend per rotation pair (Meta's Llama 3.1 release; transformers' "llama3" rope
    type): like YaRN's, 0 keeps the pair's frequency and 1 divides it by s, but the ramp is linear
    in the pair's turns over the original context, r = L0 f / (2 pi): 1 below r =
    llama3_low_freq_factor, 0 above llama3_high_freq_factor. No temperature."""
    low, high = cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
    turns = cfg.rope_context * inv_freq / (2 * math.pi)
    return ((high - turns) / (high - low)).clamp(0.0, 1.0)


def inverse_frequencies(dim, base, device=None):
    """theta^(-2i/d) for the d/2 rotation pairs, in float64."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


class Sinusoidal(Encoding):
    """Absolute sin/cos added to the token embeddings, at the position inside the document."""

    even_width = "n_embd"
    RANGES = {"sinusoidal_base": ">= 2"}  # as RoPE's theta

    @staticmethod
    def embedding(positions, cfg):
        # At the token embeddings' scale: the official code adds the unit-amplitude table to N(0, 1)
        # embeddings; ours start at N(0, init_std), so the table is scaled alike. Unscaled it would
        # outweigh the tokens 35 to 1 and the model hardly learns (docs/repro.md).
        return cfg.init_std * sinusoidal_embedding(positions, cfg.n_embd, cfg.sinusoidal_base)


def sinusoidal_embedding(positions, dim, base):
    """Vaswani et al.'s absolute encoding, (..., T) positions -> (..., T, dim): sin on even,
    cos on odd."""
    inv_freq = inverse_frequencies(dim, base, positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).float()


class AdditivePrior(Encoding, nn.Module):
    """A bias added to the attention logit of head h, query i and key j (docs/paper.md §1), written
    as a plain broadcastable torch expression `bias_fn` (on scalars inside FlexAttention's
    score_mod, on whole grids on eager and sdpa). Two forms (docs/INTERFACES.md "Additive priors"):

      DISTANCE_ONLY = True   bias_fn(dist, head, *tensors()): g_h(i - j), a function of the distance
                             alone (ALiBi, BAM, KERPLE, T5); sdpa evaluates it once per distance
                             (dense_prior)
      DISTANCE_ONLY = False  bias_fn(dist, head, query, key, *tensors()): `query` and `key` are the
                             prior's per-token values (`token_features`) at token i and at token j,
                             of head h

    `token_features(x, pos_in_doc, past)` computes those values in each layer from the layer's input
    x (B, T, n_embd) and the in-document positions (B or 1, T): a tuple of (B or 1, H or 1, T) fp32
    tensors (FIRE: the query's position; FoX: the cumulative log forget gate). `past` is what the KV
    cache holds for the earlier positions (None without one), so a prior whose values accumulate
    along the sequence can continue from them. Values must be functions of the token's own document
    only (documents stay isolated).

    `head_parameters()` gives every head's parameters, {name: [value per head]}: eval.priors' table
    under these names, metrics.jsonl under "METRICS_PREFIX_name". A prior whose heads fall into
    named groups (BAM's shapes) sets GROUPS, GROUP_SPANS and `head_group`."""

    # bias_fn = staticmethod(my_bias): set by every prior (the first of its three hooks)

    def tensors(self):
        raise NotImplementedError

    def head_parameters(self):
        raise NotImplementedError

    METRICS_PREFIX = None  # e.g. "bam": metrics.jsonl logs bam_shape, bam_log_scale, ...
    # True: the bias depends on the head and i - j only, so the flex path may read it from a
    # per-head table of distances (distance_table, ModelConfig.flex_prior); a prior that also reads
    # positions, tokens or documents sets False and is always evaluated by its formula.
    DISTANCE_ONLY = True

    @classmethod
    def copies(cls, cfg):
        return cfg.n_layer  # one prior per layer unless the encoding says otherwise

    def token_features(self, x, pos_in_doc, past=None):
        raise NotImplementedError(f"{type(self).__name__} is a function of the distance only")

    # FlexAttention's score_mod reads the prior as kernel_bias_fn(..., *kernel_tensors(length,
    # device)) for a kernel over `length` tokens: by default bias_fn and tensors(). A prior whose
    # formula reads a scalar or a per-head value that needs a gradient tabulates it here instead
    # (FIRE's c and L): read per score, such a tensor takes every score's gradient into one
    # address, an atomic add per score in inductor's flex backward.
    kernel_bias_fn = None

    def kernel_tensors(self, length, device):
        return self.tensors()

    # For eval/ only: the report's plot group, named head groups (eval.priors, eval.attention), the
    # curve eval.priors draws
    family = "fixed and kernel priors"
    GROUPS = {}  # group name -> rule, in the order they are reported

    def head_group(self, head):
        return None

    def distance_curve(self, dist, head):
        """The bias against the distance (eval.priors), dist (1, D), head (H, 1) -> (H, D); None
        where the prior is not a function of the distance (FoX)."""
        return self.bias_fn(dist, head, *self.tensors())


# Every bias function takes the distance i - j (float), the head index and the prior's tensors.


GGD_EPS = 1e-5  # docs/paper.md §2: keeps distance 0 finite when the shape is negative
# exp(50) ~ 5e21: far past anything softmax can tell from -inf, far below fp32's overflow even after
# the SSMax factor, so an extreme negative shape at distance 0 (the only key of a document's first
# token) gives a finite logit instead of -inf - -inf = NaN. The shape itself is never clamped.
MAX_LOG_BIAS = 50.0


def alibi_slopes(n_head):
    """ALiBi's per-head slopes (Press et al. 2022): a geometric sequence from 2^(-8/n) for a power
    of two; otherwise the power of two below, then every other slope of the power of two above."""

    def power_of_two_slopes(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return power_of_two_slopes(n_head)
    below = 2 ** math.floor(math.log2(n_head))
    return power_of_two_slopes(below) + power_of_two_slopes(2 * below)[0::2][: n_head - below]


def alibi_bias(dist, head, slopes):
    """Laplace log-prior: -m_h |i - j| (docs/paper.md §1)."""
    return -slopes[head] * dist.abs()


def ggd_bias(dist, head, shape, log_scale, loc):
    """BAM's Generalized-Gaussian log-prior (docs/paper.md §2):

        -exp(a_h) * (|i - j - mu_h| + eps) ** b_h,    mu_h = exp(l_h) - exp(-l_h)

    evaluated as -exp(a + b * log(|d - mu| + eps)), the same number, so that the magnitude can be
    capped (MAX_LOG_BIAS) before it overflows for very negative shapes."""
    mu = 2.0 * torch.sinh(loc[head])
    log_magnitude = log_scale[head] + shape[head] * torch.log((dist - mu).abs() + GGD_EPS)
    return -torch.exp(torch.clamp(log_magnitude, max=MAX_LOG_BIAS))


def kerple_log_bias(dist, head, r1, r2):
    """KERPLE's logarithmic kernel (Chi et al., NeurIPS 2022): -r1 log(1 + r2 |i - j|),
    r1, r2 > 0."""
    return -r1[head] * torch.log1p(r2[head] * dist.abs())


def kerple_power_bias(dist, head, r1, r2):
    """KERPLE's power kernel: -r1 |i - j| ** r2 with r1 > 0, 0 < r2 <= 2 (conditionally
    positive definite only up to 2). Written as exp(r2 log |d|) on a distance kept away from
    0, and 0 at distance 0: d ** r2 there is 0 but its derivative in r2 (d ** r2 log d)
    would be 0 x -inf = NaN."""
    d = dist.abs()
    far = d > 0
    power = torch.exp(r2[head] * torch.log(torch.where(far, d, torch.ones_like(d))))
    return torch.where(far, -r1[head] * power, torch.zeros_like(power))


class ALiBiPrior(AdditivePrior):
    """Fixed slopes, the same in every layer."""

    bias_fn = staticmethod(alibi_bias)
    METRICS_PREFIX = "alibi"

    def __init__(self, cfg):
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_slopes(cfg.n_head)), persistent=False)

    @classmethod
    def copies(cls, cfg):
        return 1

    def tensors(self):
        return (self.slopes,)

    def head_parameters(self):
        return {"slope": self.slopes.tolist()}


class BAMPrior(AdditivePrior):
    """Per-head shape b, log-scale a and location parameter l of one GGD prior."""

    bias_fn = staticmethod(ggd_bias)
    METRICS_PREFIX = "bam"
    INITS = ("alibi", "uniform", "constant", "sampled", "linear")  # ModelConfig.bam_init
    INIT_KEYS = ("bam_init", "bam_init_shape", "bam_init_log_scale")  # where the prior starts, nothing more
    # The shape is any finite number: b <= 0 is the paper's retrieval head and b = 0 NoPE
    # (docs/paper.md §2), and the paper puts no clamp on b
    RANGES = {"bam_init_shape": "", "bam_init_log_scale": ">= -30, <= 30"}

    @classmethod
    def check(cls, cfg, kinds, bad):
        if cfg.bam_init not in cls.INITS:
            bad(f"unknown bam_init {cfg.bam_init!r}; allowed: {', '.join(cls.INITS)}")

    def __init__(self, cfg, generator=None):
        super().__init__()
        H = cfg.n_head
        log_slopes = torch.tensor(alibi_slopes(H)).log()
        if cfg.bam_init == "alibi":  # exactly ALiBi: b = 1, a = log m_h
            shape, log_scale = torch.ones(H), log_slopes
        elif cfg.bam_init == "uniform":  # exactly NoPE: b = 0 makes the bias a constant
            shape, log_scale = torch.zeros(H), torch.zeros(H)
        elif cfg.bam_init == "constant":
            shape = torch.full((H,), cfg.bam_init_shape)
            log_scale = torch.full((H,), cfg.bam_init_log_scale)
        elif cfg.bam_init == "sampled":  # as the official code: b ~ N(0, 1), a ~ N(0, 1)
            shape = torch.randn(H, generator=generator)
            log_scale = torch.randn(H, generator=generator)
        else:  # "linear": shapes from flat (0) to Laplace (1) across heads, ALiBi scales
            shape, log_scale = torch.linspace(0.0, 1.0, H), log_slopes
        self.shape = nn.Parameter(shape, requires_grad=cfg.bam_train_shape)
        self.log_scale = nn.Parameter(log_scale, requires_grad=cfg.bam_train_scale)
        self.loc = nn.Parameter(torch.zeros(H), requires_grad=cfg.bam_train_loc)

    @classmethod
    def copies(cls, cfg):
        return cfg.n_layer if cfg.bam_per_layer else 1

    def tensors(self):
        return (self.shape, self.log_scale, self.loc)

    def head_parameters(self):
        return {"shape": self.shape.tolist(), "log_scale": self.log_scale.tolist(),
                "scale": self.log_scale.exp().tolist(),
                "loc": (2.0 * torch.sinh(self.loc)).tolist()}

    # For eval/ only. After training, heads cluster by shape (docs/paper.md §2): retrieval heads
    # have LOW <= b <= HIGH, local heads a larger shape, aggressive-retrieval heads a smaller one.
    # Every rule below reads these two.
    family = "BAM"
    LOW, HIGH = -0.6, 0.0
    GROUPS = {"local": f"b > {HIGH:g}", "retrieval": f"{LOW:g} <= b <= {HIGH:g}",
              "aggressive": f"b < {LOW:g}"}
    GROUP_SPANS = {"local": (HIGH, math.inf), "retrieval": (LOW, HIGH),
                   "aggressive": (-math.inf, LOW)}
    # what eval.priors plots the groups against
    GROUP_PARAMETER, SECOND_PARAMETER = "shape", "log_scale"

    def head_group(self, head):
        b = float(self.shape[head].detach())
        return "local" if b > self.HIGH else ("retrieval" if b >= self.LOW else "aggressive")


KERPLE_FLOOR = 1e-2  # Chi et al.'s reference code keeps r1, r2 >= 0.01 (clamped after each step)


def _inverse_softplus(y):
    return y + torch.log(-torch.expm1(-y))


class KerplePrior(AdditivePrior):
    """KERPLE's two per-head parameters r1, r2 > 0, per layer. The reference code clamps the raw
    values after every update; here they are smooth functions of unconstrained parameters instead,
    so nothing edits weights behind the optimizer's back and the same tensors serve score_mod and
    the dense paths: r = 0.01 + softplus(raw), linear in raw away from the floor (the reference's
    dynamics there), and, for an exponent bounded above (the power kernel's r2 <= 2), r = 0.01 +
    (max - 0.01) sigmoid(raw). Init as the reference: r1 ~ U(0, R1_INIT) and r2 ~ U(0, R2_INIT),
    kept strictly inside the bounds."""

    METRICS_PREFIX = "kerple"
    R1_INIT, R2_INIT, R2_MAX = 2.0, 1.0, None

    def __init__(self, cfg):
        super().__init__()
        H = cfg.n_head
        r1 = (torch.rand(H) * self.R1_INIT).clamp(min=KERPLE_FLOOR + 1e-3)
        r2 = (torch.rand(H) * self.R2_INIT).clamp(min=KERPLE_FLOOR + 1e-3)
        self.raw_r1 = nn.Parameter(_inverse_softplus(r1 - KERPLE_FLOOR))
        if self.R2_MAX is None:
            self.raw_r2 = nn.Parameter(_inverse_softplus(r2 - KERPLE_FLOOR))
        else:
            unit = (r2 - KERPLE_FLOOR) / (self.R2_MAX - KERPLE_FLOOR)
            self.raw_r2 = nn.Parameter(torch.logit(unit, eps=1e-3))

    def tensors(self):
        r1 = KERPLE_FLOOR + F.softplus(self.raw_r1)
        if self.R2_MAX is None:
            return r1, KERPLE_FLOOR + F.softplus(self.raw_r2)
        return r1, KERPLE_FLOOR + (self.R2_MAX - KERPLE_FLOOR) * torch.sigmoid(self.raw_r2)

    def head_parameters(self):
        r1, r2 = self.tensors()
        return {"r1": r1.tolist(), "r2": r2.tolist()}


class KerpleLogPrior(KerplePrior):
    bias_fn = staticmethod(kerple_log_bias)


class KerplePowerPrior(KerplePrior):
    bias_fn = staticmethod(kerple_power_bias)
    R1_INIT, R2_INIT, R2_MAX = 1.0, 2.0, 2.0


# The learnable-bias rivals of BAM on length extrapolation (docs/paper.md "Beyond the paper"): T5's
# bucketed bias, FIRE's MLP of the interpolated distance, and FoX's data-dependent forget gates.


def t5_bucket(dist, num_buckets, max_distance):
    """T5's causal relative-position bucket (Raffel et al. 2020; the unidirectional case of
    transformers' T5Attention._relative_position_bucket): each distance below num_buckets / 2 has
    its own bucket, longer ones share buckets log-spaced up to max_distance, every distance past it
    falls in the last one. Negative distances (masked anyway) fall in bucket 0. `max_distance` is a
    0-dim tensor.

    As transformers, the log-spaced part is truncated to an integer before the exact buckets' offset
    is added: adding first and flooring the sum in fp32 can round up to the next bucket (num_buckets
    42, max_distance 8192, distance 4641: 21 + 18.999998 is 40.0 in fp32, bucket 39 in
    transformers). The part is >= 0 (n is clamped to >= exact), so floor is the truncation."""
    exact = num_buckets // 2
    n = dist.clamp(min=0)
    log_part = (torch.log(n.clamp(min=exact) / exact) / torch.log(max_distance / exact)
                * (num_buckets - exact))
    return torch.where(n < exact, n, (exact + log_part.floor()).clamp(max=num_buckets - 1)).long()


def t5_bias(dist, head, table, max_distance):
    """A learned scalar per head and bucket: table[h, bucket(i - j)]."""
    return table[head, t5_bucket(dist, table.shape[1], max_distance)]


class T5Prior(AdditivePrior):
    """T5's relative attention bias, one table shared by every layer as in T5 (only its first layer
    holds one), initialised as transformers initialises it: N(0, n_embd^-1/2)."""

    bias_fn = staticmethod(t5_bias)
    METRICS_PREFIX = "t5"
    RANGES = {"t5_num_buckets": ">= 2", "t5_max_distance": f">= 2, <= {MAX_POSITION}"}

    @classmethod
    def check(cls, cfg, kinds, bad):
        if cfg.t5_num_buckets % 2 or cfg.t5_max_distance <= cfg.t5_num_buckets // 2:
            bad(f"T5 needs an even t5_num_buckets and t5_max_distance > t5_num_buckets / 2, got "
                f"{cfg.t5_num_buckets} and {cfg.t5_max_distance}")

    def __init__(self, cfg):
        super().__init__()
        self.table = nn.Parameter(torch.randn(cfg.n_head, cfg.t5_num_buckets) * cfg.n_embd ** -0.5)
        self.register_buffer("max_distance", torch.tensor(float(cfg.t5_max_distance)),
                             persistent=False)

    @classmethod
    def copies(cls, cfg):
        return 1

    def tensors(self):
        return self.table, self.max_distance

    def head_parameters(self):
        return {"bias_d0": self.table[:, 0].tolist(), "bias_d1": self.table[:, 1].tolist(),
                "bias_far": self.table[:, -1].tolist()}

    family = "learnable-bias rivals"  # for eval/ only


def fire_bias(dist, head, query, key, log_c, log_threshold, w1, b1, w2, *segments):
    """FIRE (Li et al., ICLR 2024): f_theta(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1),
    with i the query's position in its document (query[0]) and f_theta an MLP 1 -> W -> heads with a
    ReLU. The distance is clamped at 0: masked pairs (j > i) then stay finite, so their zero
    gradient through the mask is not 0 x NaN. log c and log L are shape (1,): FSDP2 shards no 0-d
    tensor, nor does flex's backward take one.

    On a grid (the dense paths) the bias is a function of the pair (i - j, i) alone, and the rows of
    a batch repeat the same pairs: the MLP runs once per distinct pair and is spread back over the
    grid by indexing (its backward a scatter-add). The values are the whole grid's, at a fraction of
    its cost: on the CPU training path FIRE's MLP took most of a step (docs/benchmarks.md).

    FlexAttention's score_mod reads FIRE in another form, fire_kernel_bias; `segments` serve it."""
    c, threshold = torch.exp(log_c[0]), torch.exp(log_threshold[0])
    d, i = torch.broadcast_tensors(dist.clamp(min=0), query[0])
    # One number per pair, exact in float64 for whole positions below 2^21 and distances below 2^31
    shift = 2.0 ** 31
    pairs, where = torch.unique(i.double() * shift + d.double(), return_inverse=True)
    i_pair = torch.div(pairs, shift, rounding_mode="floor")
    x = fire_input((pairs - i_pair * shift).to(d.dtype), i_pair.to(i.dtype), c, threshold)
    every_head = fire_mlp(x, None, w1, b1, w2)  # (pairs, H)
    return every_head[where, head]


def fire_kernel_bias(dist, head, query, key, psi, w1, b1, w2, *segments):
    """fire_bias as FlexAttention's score_mod reads it, one score at a time (FIREPrior.kernel_tensors):
    psi(i - j) from `psi`, the table of log(c d + 1) by distance, times 1 / psi(max(L, i)), the
    query's token feature (query[1]), so that no score reads c or L themselves. Read per score, a
    one-element tensor with a gradient takes every score's gradient in one address (an atomic add per
    score in inductor's backward); the tables take it per distance and per query, and autograd carries
    it on to c and L. `segments` (fire_segments, given under autograd) have the kernel read the MLP
    as the piecewise-linear function it is: inductor's flex backward refuses a score_mod that indexes
    a tensor with a gradient more than once, as the sum over hidden units does. Equal to fire_bias up
    to fp32 rounding (a product with 1 / psi for a quotient: tests/model/test_t5_fire_fox.py)."""
    x = psi[dist.clamp(min=0).long()] * query[1]
    return fire_piecewise(x, head, *segments) if segments else fire_mlp(x, head, w1, b1, w2)


def fire_input(dist, i, c, threshold):
    """FIRE's progressive interpolation psi(i - j) / psi(max(L, i)), the MLP's one input."""
    return torch.log1p(c * dist) / torch.log1p(c * torch.maximum(i, threshold))


def fire_mlp(x, head, w1, b1, w2):
    """FIRE's MLP, output `head`: sum_u w2_hu relu(w1_u x + b1_u). On FlexAttention's scalars it is
    a sum over the W hidden units, so that score_mod stays elementwise; on a vector of inputs (head
    None) the same sum is a matmul of the (head-independent) hidden layer with w2, every head at
    once (x's shape + (H,)); tests/model/test_attention_paths.py's flex == eager holds the two to
    each other."""
    if x.dim() == 0:
        bias = torch.zeros_like(x)
        for unit in range(w1.shape[0]):
            bias = bias + w2[head, unit] * torch.relu(w1[unit] * x + b1[unit])
        return bias
    # a prior is computed in fp32, also under bf16 autocast
    with torch.autocast(x.device.type, enabled=False):
        hidden = torch.relu(x[..., None] * w1 + b1)
        return hidden @ w2.to(hidden.dtype).T


def fire_segments(w1, b1, w2):
    """FIRE's MLP of its one input x, sum_u w2_hu relu(w1_u x + b1_u), is linear between the units'
    breakpoints x = -b1_u / w1_u. Returns the W breakpoints sorted, and per head the slope and the
    intercept on each of the W + 1 segments, (H, W + 1) each; on segment k (k breakpoints below x)
    unit u is active iff it rises (w1_u > 0) and its breakpoint is among the first k, or falls and
    is not, or is flat (w1_u = 0) with b1_u > 0. Slope and intercept are sums over the active units
    of w2_hu w1_u and w2_hu b1_u, so autograd gives the MLP's own gradients; the breakpoints carry
    none (the function is continuous across them)."""
    with torch.no_grad():
        flat = w1 == 0
        # a flat unit never switches
        breaks = torch.where(flat, torch.inf, -b1 / torch.where(flat, 1.0, w1))
        order = breaks.argsort()
        rank = order.argsort()
        segment = torch.arange(len(w1) + 1, device=w1.device)[:, None]
        # (W + 1, W): which units are active on each segment
        active = torch.where(flat, b1 > 0, torch.where(w1 > 0, rank < segment, rank >= segment))
    # fp32 also under bf16 autocast, as every prior; (H, W + 1) each, not views (flex_captured)
    with torch.autocast(w2.device.type, enabled=False):
        slope, intercept = w2 @ (active * w1).T, w2 @ (active * b1).T
    return breaks[order], slope, intercept


def fire_piecewise(x, head, breaks, slope, intercept):
    """fire_mlp of one scalar x from fire_segments' tables, each indexed once: equal to the MLP up
    to fp32 rounding (tests/model/test_t5_fire_fox.py)."""
    segment = torch.zeros_like(x, dtype=torch.int64)
    for unit in range(breaks.shape[0]):  # the breakpoints carry no gradient: indexing them is free
        segment = segment + (x > breaks[unit])
    return slope[head, segment] * x + intercept[head, segment]


def _fire_scalars_as_vectors(module, state_dict, prefix, *args):
    """Checkpoints and exports written before log c and log L were shape (1,) hold them 0-d."""
    for name in ("log_c", "log_threshold"):
        value = state_dict.get(prefix + name)
        if value is not None and value.dim() == 0:
            state_dict[prefix + name] = value.reshape(1)


class FIREPrior(AdditivePrior):
    """FIRE's learned c and threshold L (positive through their logarithms) and its MLP, per layer
    as in the paper. The MLP starts as torch's nn.Linear default (the paper's code and its
    reimplementations use it), c = 0.1 and L = 512 as theirs (ModelConfig.fire_init_*). Its output
    layer has no bias: a per-head constant on every logit of a row, which softmax ignores (its
    gradient is zero, so it would never train)."""

    bias_fn = staticmethod(fire_bias)
    kernel_bias_fn = staticmethod(fire_kernel_bias)
    METRICS_PREFIX = "fire"
    DISTANCE_ONLY = False
    RANGES = {"fire_mlp_width": ">= 1", "fire_init_c": "> 0", "fire_init_threshold": "> 0"}

    def __init__(self, cfg):
        super().__init__()
        W, H = cfg.fire_mlp_width, cfg.n_head
        self.log_c = nn.Parameter(torch.tensor([math.log(cfg.fire_init_c)]))
        self.log_threshold = nn.Parameter(torch.tensor([math.log(cfg.fire_init_threshold)]))
        self.w1 = nn.Parameter(torch.empty(W).uniform_(-1.0, 1.0))  # nn.Linear(1, W): U(+-1/1)
        self.b1 = nn.Parameter(torch.empty(W).uniform_(-1.0, 1.0))
        self.w2 = nn.Parameter(torch.empty(H, W).uniform_(-W ** -0.5, W ** -0.5))  # nn.Linear(W, H)

        self.register_load_state_dict_pre_hook(_fire_scalars_as_vectors)

    def tensors(self):
        mlp = (self.log_c, self.log_threshold, self.w1, self.b1, self.w2)
        # training: the form flex's backward takes (fire_bias)
        if torch.is_grad_enabled() and self.w2.requires_grad:
            return mlp + fire_segments(self.w1, self.b1, self.w2)
        return mlp

    def kernel_tensors(self, length, device):
        """fire_kernel_bias's tensors over `length` distances: psi(d) = log(c d + 1), (length,) fp32,
        then the MLP's."""
        with torch.autocast(device.type, enabled=False):
            distances = torch.arange(length, device=device, dtype=torch.float32)
            psi = torch.log1p(torch.exp(self.log_c) * distances)
        return (psi,) + self.tensors()[2:]

    def token_features(self, x, pos_in_doc, past=None):
        """(the position of each token in its document, 1 / psi(max(L, i)) at it), (B or 1, 1, T)
        each: fire_bias reads the first, fire_kernel_bias the second."""
        position = pos_in_doc.float()[:, None, :]
        with torch.autocast(position.device.type, enabled=False):
            c, threshold = torch.exp(self.log_c), torch.exp(self.log_threshold)
            return position, 1.0 / torch.log1p(c * torch.maximum(position, threshold))

    def head_parameters(self):
        H = self.w2.shape[0]
        return {"c": [self.log_c.exp().item()] * H,
                "threshold": [self.log_threshold.exp().item()] * H}

    # For eval/ only
    family = "learnable-bias rivals"

    def distance_curve(self, dist, head):
        """The bias of a document's first token seen from the query at position d (i = d, j = 0)."""
        return self.bias_fn(dist, head, (dist,), (torch.zeros_like(dist),), *self.tensors())


def fox_bias(dist, head, query, key):
    """FoX (Lin et al., ICLR 2025): sum over l = j+1..i of log f_l,h = c_i,h - c_j,h, with c the
    cumulative log forget gate of the document (FoXPrior.token_features); <= 0 for every visible
    key. c_i is read from the first feature and c_j from the second, its copy: FlexAttention's
    score_mod then indexes each tensor once, which inductor's flex backward requires of a tensor
    with a gradient (its validate_joint_graph)."""
    return query[0] - key[1]


class FoXPrior(AdditivePrior):
    """The Forgetting Transformer's forget gate f_t,h = sigmoid(w_h . x_t + b_h), one projection per
    layer from the layer's (normalised) input, as the reference code: weights N(0, init_std), biases
    0, so every gate starts near 1/2 (a strong recency bias that training opens up).
    `fox_gate_init_bias` b starts the biases at b instead, and the gates near sigmoid(b) (b = 5:
    ~0.993, nearly open). FoX is used without RoPE in its paper, and so here (pe = "fox" is
    the gate alone)."""

    bias_fn = staticmethod(fox_bias)
    METRICS_PREFIX = "fox"
    DISTANCE_ONLY = False
    RANGES = {"fox_gate_init_bias": ">= -30, <= 30"}  # past +-30 a gate is shut, or open to 1e-13

    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_head, bias=True)  # weight: Transformer's init
        nn.init.constant_(self.gate.bias, cfg.fox_gate_init_bias)  # 0 by default, as the reference

    def tensors(self):
        return ()

    def log_gates(self, x):
        """log f, (B, H, T) fp32."""
        # a model loaded in bf16 keeps its priors in fp32 (modeling_bam.py)
        gate = self.gate(x.to(self.gate.weight.dtype))
        return F.logsigmoid(gate.float()).transpose(1, 2)

    def token_features(self, x, pos_in_doc, past=None):
        """(c, a copy of c), c_t = the sum of log f over the token's document up to t (continuing
        `past` from a KV cache). The running sum is taken in float64 and restarted at every document
        start, so a document's values are those it has alone up to fp32 rounding, whatever came
        before it in the row."""
        log_f = self.log_gates(x).double()
        total = log_f.cumsum(dim=-1)
        last_start = last_document_start(pos_in_doc == 0)  # 0 (nothing to remove) if none
        before = (total - log_f).gather(-1, last_start[:, None, :].expand_as(log_f))
        c = total - before
        # a KV cache holds the same row: no document start in between
        if past is not None and past[0].shape[-1]:
            c = c + past[0][..., -1:].double()
        c = c.float()
        return c, c.clone()  # the copy is the keys' (fox_bias); autograd sums both gradients into c

    def head_parameters(self):
        return {"gate_bias": self.gate.bias.tolist(),
                "gate_weight_norm": self.gate.weight.norm(dim=1).tolist()}

    # For eval/ only
    family = "learnable-bias rivals"

    def distance_curve(self, dist, head):
        return None  # a function of the content: eval.priors shows the gates instead


# The registry (declared at the top): the name a config uses -> the encoding. PE_CHOICES, PRIORS,
# CHECKED_SETTINGS and model_ranges() are views of it.
ENCODINGS.update({
    "nope": NoPE,
    "rope": RoPE,
    "sinusoidal": Sinusoidal,
    "alibi": ALiBiPrior,
    "bam": BAMPrior,
    "kerple_log": KerpleLogPrior,
    "kerple_power": KerplePowerPrior,
    "t5": T5Prior,
    "fire": FIREPrior,
    "fox": FoXPrior,
})
PE_CHOICES = tuple(ENCODINGS)
# Every encoding at its defaults, then each of its checked_settings: (name, {field: value})
CHECKED_SETTINGS = tuple([(pe, {}) for pe in ENCODINGS] + [
    (pe, dict(settings)) for pe, enc in ENCODINGS.items() for settings in enc.checked_settings])
PRIORS = {name: enc for name, enc in ENCODINGS.items() if issubclass(enc, AdditivePrior)}


# --------------------------------------------------------------------------------------------------
# Attention. First what every layer needs to know about one forward's positions (AttnContext,
# built once per distinct window and shared by the layers that have it) and which path computes
# it; then what positions do to it, written once, as two plain torch expressions on broadcastable
# tensors: `positional_scores` (the logits) and `visible` (the mask). FlexAttention evaluates them
# on scalars (score_mod, mask_mod), the dense paths on whole grids, so the paths cannot drift
# apart; `eager` is the reference the tests hold the others to.


@dataclass
class AttnContext:
    """What every layer's attention needs to know about the positions of one forward pass."""

    impl: str  # flex | sdpa | eager (after `auto` was resolved)
    q_pos: torch.Tensor  # (Tq,) absolute positions of the queries
    k_pos: torch.Tensor  # (Tk,) absolute positions of the keys
    # Which keys each query sees, in the form its implementation takes: a BlockMask (flex), a dense
    # (B or 1, 1, Tq, Tk) bool (eager, sdpa), or None where causality over the same positions is all
    # there is (sdpa's flash kernel masks by itself: no T x T tensor)
    mask: torch.Tensor | BlockMask | None
    log_n: torch.Tensor | None  # (B or 1, Tq) log of how many keys each query sees (SSMax)
    rope: tuple | None  # (cos, sin) of the queries' positions
    pos_in_doc: torch.Tensor | None = None  # (B or 1, Tq) the queries' positions in their documents
    # flex with flex_prior = "table": each layer's distance-only prior is read from its
    # distance_table (the tabled_prior of Block and Attention, chosen per layer outside them) and
    # SSMax's factor from a table too. A flag, not the tables: a per-layer lookup inside a compiled
    # Block would guard on the layer's index.
    uses_prior_tables: bool = False
    window: int = 0  # the sliding window of the layers this context serves (0: none)


def attention_contexts(model, T, pos_in_doc, doc_ids=None, kv_cache=None, start_pos=0):
    """For a forward of `model` over T tokens from start_pos: every layer's AttnContext (one per
    distinct window, shared by the layers that have it, so one mask each) and every layer's prior
    read from a table (flex_prior_tables) or None."""
    windows = model.config.layer_windows
    contexts = {window: attention_context(model, start_pos, T, pos_in_doc, doc_ids, kv_cache,
                                          window) for window in dict.fromkeys(windows)}
    tabled = next((ctx for ctx in contexts.values() if ctx.uses_prior_tables), None)
    tables = ((None,) * len(windows) if tabled is None
              else flex_prior_tables(model, tabled.mask.seq_lengths[0], pos_in_doc.device))
    return tuple(contexts[window] for window in windows), tables


def attention_context(model, start_pos, T, pos_in_doc, doc_ids=None, kv_cache=None, window=None):
    """What the attention of every layer of `model` with this window (None: attn_window) needs
    about a forward's positions; eval.attention scores its sampled queries with it too."""
    cfg, device = model.config, pos_in_doc.device
    window = cfg.attn_window if window is None else window
    q_pos = torch.arange(start_pos, start_pos + T, device=device)
    first_key = kv_cache.first_key(start_pos, window) if kv_cache is not None else 0
    k_pos = torch.arange(first_key, start_pos + T, device=device)
    impl = attention_path(model, T, len(k_pos), doc_ids is not None)
    log_n = ssmax_log_n(pos_in_doc, window) if model.has_ssmax else None
    rotation = model.rotation
    rope = rotation(q_pos, cfg, length=start_pos + T) if rotation is not None else None
    if impl == "flex":
        mask = make_block_mask(doc_ids, T, device, window)
    elif impl == "sdpa" and plain_causal(model, T, len(k_pos), doc_ids is not None):
        mask = None
    else:
        mask = dense_mask(q_pos, k_pos, window, doc_ids)
    tables = impl == "flex" and cfg.flex_prior == "table"
    return AttnContext(impl, q_pos, k_pos, mask, log_n, rope, pos_in_doc, tables, window)


def attention_path(model, T_q, T_k, has_docs):
    """Which attention path (a name in ATTENTION) a forward of `model` over T_q queries and T_k
    keys takes: the model's policy, which eval/ and bench/ read too."""
    impl = model.config.attn_impl
    if T_q != T_k:  # decoding with a KV cache: a few queries, all keys; flex needs Tq == Tk
        return "eager" if impl == "eager" else "sdpa"
    training = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    on_cuda = model.lm_head.weight.is_cuda
    if impl == "flex" and training and not on_cuda:
        raise ValueError("attn_impl='flex' has no backward pass on CPU (torch 2.11 to 2.15): train "
                         "on CPU with 'sdpa', 'eager' or 'auto', or run inference under "
                         "torch.no_grad()")
    if impl != "auto":
        return impl
    if plain_causal(model, T_q, T_k, has_docs):
        return "sdpa"  # flash attention with is_causal
    if on_cuda:
        return "flex"
    # FlexAttention has no backward on CPU (torch 2.11 to 2.15), and below a few thousand tokens the
    # dense bias costs less than flex's compile; past that the dense bias grows as T^2 and flex wins.
    return "sdpa" if training or T_q <= 2048 else "flex"


def plain_causal(model, T_q, T_k, has_docs):
    """Nothing positional in the attention of `model` but causality (and no sink), which sdpa's
    flash kernel does alone."""
    positional = (len(model.priors) > 0 or model.has_ssmax or has_docs
                  or any(model.config.layer_windows))
    return T_q == T_k and not positional and not model.config.attn_sink


def ssmax_log_n(pos_in_doc, window=0):
    """log n_i for SSMax, n_i = the keys query i can see (docs/paper.md §3): the count of `visible`
    keys, its in-document position + 1, capped by the window."""
    n_keys = pos_in_doc + 1
    return torch.log(n_keys.clamp(max=window).float() if window else n_keys.float())


# Attention. What positions do to it is written once, as two plain torch expressions on
# broadcastable tensors: `positional_scores` (the logits) and `visible` (the mask). FlexAttention
# evaluates them on scalars (score_mod, mask_mod), the dense paths on whole grids, so the paths
# cannot drift apart; `eager` is the reference the tests hold the others to.


def positional_scores(scores, head, q_pos, k_pos, log_n, prior, ssmax_scale, query=None, key=None):
    """The one place where positions change attention logits (before masking and softmax):

        ((q.k / sqrt(d) + g_h(i, j)) * s_h * log(n_i))

    docs/paper.md §3: for every additive prior the SSMax factor multiplies the content score *and*
    the prior (the official ALiBi+SSMax baseline scales only q.k; we are consistent across encodings
    instead). `prior` is (bias_fn, tensors) or None; `ssmax_scale` is the per-head s_h or None;
    `query`, `key` the prior's token features at i and j (prior_bias)."""
    if prior is not None:
        scores = scores + prior_bias(prior, head, q_pos - k_pos, query, key)
    if ssmax_scale is not None:
        scores = scores * ssmax_factor(ssmax_scale, head, log_n)
    return scores


def prior_bias(prior, head, dist, query=None, key=None):
    """The prior's bias: `prior` is (bias_fn, tensors), `dist` the distance i - j; `query`
    and `key` are the prior's token features at i and at j, None for a prior of the distance
    alone (AdditivePrior)."""
    bias_fn, tensors = prior
    if query is None:
        return bias_fn(dist.to(torch.float32), head, *tensors)
    return bias_fn(dist.to(torch.float32), head, query, key, *tensors)


def ssmax_factor(ssmax_scale, head, log_n):
    """SSMax's s_h log(n_i), `log_n` = log(how many keys query i sees) (docs/paper.md §3)."""
    return ssmax_scale[head] * log_n


def sink_scores(sink, ssmax_scale, log_n):
    """The learned sink's logit in query i's softmax, (B or 1, H, Tq or 1) fp32, for `sink` (H,)
    and `log_n` (B or 1, Tq): one more score in the denominator, with no value. It is a score like
    the others, so SSMax's s_h log n_i multiplies it as it multiplies q.k and the prior: the sink
    then keeps its meaning at every length (a key outweighs it iff its score exceeds it, whatever
    n_i); unscaled, the threshold it sets would drift towards 0 as n_i grows, and past a few
    thousand keys the sink could no longer take a head's mass. The price: where a query sees one
    key (a document's first token), log n_i = 0 makes every score 0, the sink's too, which then
    takes half the mass whatever its logit. A positional prior adds nothing to the sink: the
    prior is a function of a key's position, and the sink has none."""
    logit = sink.float()[None, :, None]
    if ssmax_scale is None:
        return logit
    head = torch.arange(len(sink), device=sink.device)[:, None]
    return logit * ssmax_factor(ssmax_scale, head, log_n[:, None, :])


def visible(q_pos, k_pos, window=0, q_doc=None, k_doc=None):
    """The one place where positions decide which keys a query sees: key j is visible to query i iff
    j <= i, i - j < window (0: no window) and, given documents, both are in the same one."""
    dist = q_pos - k_pos
    seen = dist >= 0
    if window:
        seen = seen & (dist < window)
    if q_doc is not None:
        seen = seen & (q_doc == k_doc)
    return seen


def dense_mask(q_pos, k_pos, window=0, doc_ids=None):
    """`visible` on the (Tq, Tk) grid, (B or 1, 1, Tq, Tk) bool; doc_ids (B, T) needs
    Tq = Tk = T."""
    if doc_ids is None:
        return visible(q_pos[:, None], k_pos[None, :], window)[None, None]
    return visible(q_pos[:, None], k_pos[None, :], window, doc_ids[:, :, None],
                   doc_ids[:, None, :])[:, None]


def grid_features(features):
    """Token features on the (B, H, Tq, Tk) score grid: (at the queries, at the keys), or
    (None, None)."""
    if features is None:
        return None, None
    return tuple(t[..., :, None] for t in features[0]), tuple(t[..., None, :] for t in features[1])


def _head_index(n_head, device):
    return torch.arange(n_head, device=device).view(n_head, 1, 1)


def eager_attention(q, k, v, ctx, prior, ssmax_scale, features=None, sink=None):
    """Materialised fp32 scores: the reference implementation, O(Tq x Tk) memory.
    `features`: see layer_prior. `sink` (H,) or None: the sink's logit (sink_scores) is one more
    column of the softmax, dropped after it, so a row's weights sum to less than 1. fp32 also under
    bf16 autocast, which would round q.k (and the weights' product with v) to 8 bits."""
    H, hd = q.shape[1], q.shape[-1]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(hd)
        log_n = None if ctx.log_n is None else ctx.log_n[:, None, :, None]
        head = _head_index(H, q.device)
        scores = positional_scores(scores, head, ctx.q_pos[:, None], ctx.k_pos[None, :], log_n,
                                   prior, ssmax_scale, *grid_features(features))
        scores = scores.masked_fill(~ctx.mask, float("-inf"))
        if sink is None:
            return (scores.softmax(dim=-1) @ v.float()).type_as(q)
        log_p = sink_log_softmax(scores, sink, ssmax_scale, ctx.log_n)[0]
        return (log_p.exp() @ v.float()).type_as(q)


def sink_log_softmax(scores, sink, ssmax_scale, log_n):
    """(log weights of the keys, of the sink (B, H, Tq)) for masked scores (B, H, Tq, Tk): the
    log-softmax with the sink's logit (sink_scores) as one more column, so that the keys' weights
    sum to less than 1; without a sink (None) the plain one, and -inf (eval.attention reads it)."""
    if sink is None:
        return scores.log_softmax(dim=-1), torch.full((), -math.inf, device=scores.device)
    column = sink_scores(sink, ssmax_scale, log_n)[..., None]
    log_p = torch.cat((scores, column.expand(*scores.shape[:-1], 1)), dim=-1).log_softmax(dim=-1)
    return log_p[..., :-1], log_p[..., -1]


def sdpa_attention(q, k, v, ctx, prior, ssmax_scale, features=None, sink=None):
    """torch's scaled_dot_product_attention. With nothing positional in the logits it is the flash
    kernel (O(T) memory). Otherwise the prior and the mask become one dense fp32 bias, and SSMax's
    factor, which multiplies the whole logit, is folded into q:

        (q.k/sqrt(d) + g) c = (c q).k/sqrt(d) + g c.

    This is the CPU training path (flex has no CPU backward), so a prior of the distance
    alone is built cheaply (dense_prior); one with token features (FIRE, FoX) is
    evaluated on the whole grid. A sink is one more key whose k and v are 0 and whose bias is the
    sink's logit: its score is that logit, its value adds nothing."""
    gqa = k.shape[1] != q.shape[1]
    if ctx.mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    head = _head_index(q.shape[1], q.device)
    bias = torch.zeros((), device=q.device)
    if prior is not None and features is None:
        bias = dense_prior(prior, head[:, 0], ctx.q_pos, ctx.k_pos)
    elif prior is not None:
        dist = ctx.q_pos[:, None] - ctx.k_pos[None, :]
        bias = prior_bias(prior, head, dist, *grid_features(features))
    if ssmax_scale is not None:
        factor = ssmax_factor(ssmax_scale, head, ctx.log_n[:, None, :, None])  # (B or 1, H, Tq, 1)
        bias, q = bias * factor, q.float() * factor
    bias = torch.where(ctx.mask, bias, float("-inf"))
    if sink is not None:
        column = sink_scores(sink, ssmax_scale, ctx.log_n)[..., None]
        lead = torch.broadcast_shapes(bias.shape[:-1], column.shape[:-1])
        bias = torch.cat((bias.expand(*lead, bias.shape[-1]), column.expand(*lead, 1)), dim=-1)
        k, v = (torch.cat((x, torch.zeros_like(x[:, :, :1])), dim=2) for x in (k, v))
    # fp32 also under bf16 autocast, which would otherwise round the bias (and FIRE's or SSMax's
    # gradient through it) to 8 bits: eager, the reference, keeps its scores in fp32 too
    with torch.autocast(q.device.type, enabled=False):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias,
                                           enable_gqa=gqa)
    return y.type_as(v)


def dense_prior(prior, head, q_pos, k_pos):
    """g_h(i - j) on the (Tq, Tk) grid, (H, Tq, Tk) for head (H, 1). The prior depends on i - j
    only, so it is evaluated once per distance (H x (Tq + Tk - 1) values, not H x Tq x Tk) and
    spread over the grid by indexing, whose backward is a scatter-add."""
    smallest = q_pos[0] - k_pos[-1]  # a tensor, so no device sync
    distances = smallest + torch.arange(len(q_pos) + len(k_pos) - 1, device=q_pos.device)
    table = prior_bias(prior, head, distances[None, :])  # (H, D)
    return table[:, q_pos[:, None] - k_pos[None, :] - smallest]




# The attention paths by name (ModelConfig.attn_impl after `auto`), which Attention.forward looks
# up; flex registers itself at the end of its region.
ATTENTION.update(eager=eager_attention, sdpa=sdpa_attention)


# --------------------------------------------------------------------------------------------------
# FlexAttention: what the `flex` path needs around the expressions above, in the order a forward
# meets it: the per-layer prior tables, the path itself (flex_attention), its two forms of a sink,
# the BlockMasks (written down directly, the causal ones kept in a small cache), and the compiled
# kernels, one per variant (built outside any trace by build_flex_kernels, where dynamo's recompile
# budget is raised). The CPU workarounds of torch 2.11 to 2.15 live here too (static shapes for the
# kernels that read a tensor, sequences padded to whole blocks).


# Prior tables for flex (ModelConfig.flex_prior = "table"). A prior that depends on the head and i -
# j only (AdditivePrior.DISTANCE_ONLY) takes at most T values per head on a causal grid of T tokens;
# evaluating it per score repeats its formula T times over, and in the backward pass every score
# adds its gradient into the same few scalars per head (atomics on a GPU, pytorch/pytorch#137452).
# Instead the table is built outside the kernel in plain torch, once per forward and prior module
# (flex_prior_tables), the kernel only gathers from it, and autograd takes the table's gradient back
# to the parameters. SSMax's factor s_h log n_i is tabulated alike by query.
# tests/model/test_prior_tables.py holds the tables to the formulas.


def flex_prior_tables(model, length, device):
    """Per layer of `model`, its prior read from its distance_table over the kernel's `length`
    tokens, (table_bias, (table,)), built once per prior module (once for all layers where the
    prior is shared), or None where the layer's prior is not distance-only or there is none."""
    n_head = model.config.n_head
    built = [(table_bias, (distance_table((p.bias_fn, p.tensors()), n_head, length, device),))
             if p.DISTANCE_ONLY else None for p in model.priors]
    return tuple(None if index is None else built[index] for index in model.prior_index)


def distance_table(prior, n_head, length, device):
    """g_h(d) for d = 0 .. length - 1: (H, length) fp32, every value a causal kernel over `length`
    tokens asks of a distance-only prior; `prior` is (bias_fn, tensors) as for prior_bias."""
    distances = torch.arange(length, device=device, dtype=torch.float32)
    return prior_bias(prior, torch.arange(n_head, device=device)[:, None], distances[None, :])


def table_bias(dist, head, table):
    """The bias function of a prior read from its distance_table: entry d is distance d. A negative
    distance (a key after its query, masked anyway) reads entry 0, so no index leaves the table."""
    return table[head, dist.clamp(min=0).long()]


def ssmax_table(ssmax_scale, log_n, batch):
    """SSMax's s_h log n_i as a (batch, H, T) fp32 table by query, for `log_n` (1 or batch, T). A
    tensor of its own, never a view (flex_captured)."""
    head = torch.arange(len(ssmax_scale), device=log_n.device)[:, None]
    return flex_captured(ssmax_factor(ssmax_scale, head, log_n[:, None, :]).expand(batch, -1, -1))


def flex_captured(t):
    """`t` as a tensor of its own in contiguous memory, for a score_mod to capture. Not
    `contiguous()`, which returns a view where `t` already is: torch 2.11's and 2.13's AOT autograd
    drop the gradient of a view captured by flex's score_mod (tests/model/test_flex_backward.py:
    SSMax's scales and FoX's gates went untrained on flex; 2.15's keeps it)."""
    return t.clone(memory_format=torch.contiguous_format)


def kernel_scores(scores, b, head, q_pos, k_pos, prior, factor_table, query=None, key=None):
    """positional_scores as FlexAttention's score_mod computes it, (scores + g_h(i, j)) * s_h log n_i:
    the prior in the form the kernel reads (`prior` (table_bias, (distance_table,)), or a prior's
    kernel form, or None) and SSMax's factor from its ssmax_table (or None)."""
    if prior is not None:
        scores = scores + prior_bias(prior, head, q_pos - k_pos, query, key)
    if factor_table is not None:
        scores = scores * factor_table[b, head, q_pos]
    return scores


def flex_attention(q, k, v, ctx, prior, ssmax_scale, features=None, sink=None):
    """The flex path: the prior as score_mod, the mask as a sparse BlockMask; never
    materialises Tq x Tk. Queries and keys are the same positions 0..T-1 (no KV cache), so
    the token features at the queries are those at the keys (layer_prior). `prior` is what the
    score_mod reads: a distance-only prior from its table, (table_bias, (table,)), with prior
    tables (ctx.uses_prior_tables), else its kernel form (AdditivePrior.kernel_bias_fn). SSMax's
    factor s_h log n_i always comes from a (B, H, T) table (ssmax_table): read per score, the scale
    s_h would take every score's gradient of its head in one address. A sink needs no score_mod on a
    GPU (with_sink); the CPU's kernel has no log-sum-exp, so there the sink is one more key
    (sink_block_mask)."""
    bias_fn, tensors = (None, ()) if prior is None else prior
    cpu = q.device.type == "cpu"
    form = None if sink is None else sink_form(cpu)
    kernel = flex_kernel(flex_kernel_key(bias_fn, ssmax_scale is not None, features is not None,
                                         cpu, form))
    B, H, T = q.shape[:3]
    padded, mask = ctx.mask.seq_lengths[0], ctx.mask
    if bias_fn is table_bias and tensors[0].shape[-1] < padded:  # a shape, no device sync
        raise ValueError(f"a prior table covers distances 0..{tensors[0].shape[-1] - 1}, the "
                         f"kernel runs {padded} tokens: build it at ctx.mask.seq_lengths[0]")
    if features is not None:  # score_mod indexes [b, h, token]: broadcast dimensions made whole
        features = tuple(flex_captured(t.expand(B, H, T)) for t in features[0])
    log_n = ctx.log_n
    # see flex_mask_length: padded keys follow every real query, so the causal mask hides them
    if padded > T:
        q, k, v = (F.pad(x, (0, 0, 0, padded - T)) for x in (q, k, v))
        log_n = None if log_n is None else F.pad(log_n, (0, padded - T))
        features = None if features is None else tuple(F.pad(t, (0, padded - T)) for t in features)
    factor_table = None if ssmax_scale is None else ssmax_table(ssmax_scale, log_n, B)
    sink_table = None
    if form == "key":  # the sink as the first key of one more key block
        logits = sink_scores(sink, ssmax_scale, ctx.log_n).expand(B, H, T)
        sink_table = flex_captured(F.pad(logits, (0, padded - T)))
        k, v = (F.pad(x, (0, 0, 0, mask.BLOCK_SIZE[1])) for x in (k, v))
        mask = sink_block_mask(mask)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # one memory layout, one kernel
    out = kernel(q, k, v, mask, tensors, features, factor_table, sink_table)
    if form != "lse":
        return out[:, :, :T]
    return with_sink(out[0][:, :, :T], out[1][:, :, :T], sink_scores(sink, ssmax_scale, ctx.log_n))


def sink_form(cpu):
    """How flex adds a sink: "lse" (with_sink) where the kernel returns its log-sum-exp, a GPU's;
    "key" (sink_block_mask) on a CPU, whose compiled kernel returns none (torch 2.11 to 2.15; nor has
    it a backward, which only the "lse" form needs). Tests trace the GPU's form on the CPU."""
    return "key" if cpu else "lse"


def sink_block_mask(block_mask):
    """`block_mask` over T keys extended by one key block whose first key, position T, is the sink:
    every query visits that block, and sees its first key only. The CPU's flex form of a sink
    (its kernel returns no log-sum-exp): k and v are 0 there, and score_mod gives that key the
    sink's logit (sink_score_mod), which the softmax then counts as with_sink's e^s."""
    T, block = block_mask.seq_lengths[1], block_mask.BLOCK_SIZE[1]
    count, index = block_mask.kv_num_blocks, block_mask.kv_indices
    index = torch.cat((index, torch.zeros_like(index[..., :1])), dim=-1)  # the sink block after
    sink_block = torch.full_like(index[..., :1], -(-T // block))
    index = index.scatter(-1, count[..., None].long(), sink_block)
    full_index = block_mask.full_kv_indices
    if full_index is not None:
        full_index = torch.cat((full_index, torch.zeros_like(full_index[..., :1])), dim=-1)
    seen = block_mask.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return torch.where(kv_idx >= T, kv_idx == T, seen(b, h, q_idx, kv_idx.clamp(max=T - 1)))

    return BlockMask.from_kv_blocks(count + 1, index, block_mask.full_kv_num_blocks, full_index,
                                    BLOCK_SIZE=block_mask.BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=(block_mask.seq_lengths[0], T + block))


def sink_score_mod(score_mod, sink_table):
    """`score_mod` with key T (sink_block_mask) scoring the sink's logit, sink_table[b, h, q], and
    every other key as before (read at a key index kept inside the tensors it gathers from)."""
    def with_sink_key(score, b, h, q_idx, kv_idx):
        T = sink_table.shape[-1]
        inner = score_mod(score, b, h, q_idx, kv_idx.clamp(max=T - 1))
        return torch.where(kv_idx == T, sink_table[b, h, q_idx], inner)

    return with_sink_key


def with_sink(out, lse, sink_logit):
    """Flex's output without a sink, (B, H, T, hd), as the output with one: the sink adds e^s to the
    denominator Z = e^lse of every weight, so each output is scaled by Z / (Z + e^s) =
    sigmoid(lse - s). `lse` (B, H, T) is the kernel's log-sum-exp of the scores it saw, and
    `sink_logit` the sink's score (sink_scores). Autograd takes the gradient to the sink through
    the sigmoid, and to the scores through lse, which flex's backward differentiates."""
    return (out.float() * torch.sigmoid(lse.float() - sink_logit)[..., None]).type_as(out)


# FlexAttention's BlockMask says which 128 x 128 blocks of the score grid to visit at all (in full,
# or through the mask_mod); the causal and the windowed one are written down directly, because
# create_block_mask would first evaluate the mask on all T x T pairs (10 bytes each: 640 MiB at 8K
# tokens, 2.5 TB at 500K).


def flex_mask_mod(window=0, doc_ids=None):
    """`visible` as FlexAttention's mask_mod(b, h, q_idx, kv_idx)."""
    if doc_ids is None:
        return lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx, window)
    return lambda b, h, q_idx, kv_idx: visible(q_idx, kv_idx, window, doc_ids[b, q_idx],
                                               doc_ids[b, kv_idx])


def make_block_mask(doc_ids, T, device, window=0):
    """The BlockMask of one forward pass over T tokens (causal, within documents, within the window
    if any), built once per forward and shared by every layer, at flex_mask_length(T): padded
    positions are a document of their own after the last one."""
    T_mask = flex_mask_length(T, device)
    if doc_ids is None:
        if window:
            return window_block_mask(T_mask, window, device)
        return causal_block_mask(T_mask, device)
    if T_mask > T:
        doc_ids = torch.cat([doc_ids, (doc_ids[:, -1:] + 1).expand(-1, T_mask - T)], dim=1)
    # Documents are a training-time feature, where T is the training context: the dense evaluation
    # inside create_block_mask is affordable there.
    return create_block_mask(flex_mask_mod(window, doc_ids), doc_ids.shape[0], None, T_mask, T_mask,
                             device=device)


def flex_mask_length(T, device):
    """The length FlexAttention runs at. The compiled CPU kernel built for AVX2 (torch 2.11 to 2.15)
    returns wrong values, and not the same ones twice, when the sequence ends inside one of its
    blocks (measured on this project's CI machine: T = 8, 24, 40 and 120 wrong, multiples of 16
    right; its AVX-512 build is right). On CPU the sequence is therefore padded to whole 128-token
    blocks; on GPU it runs as it is."""
    return T if torch.device(device).type != "cpu" else -(-T // 128) * 128


def write_causal_block_mask(T, device, block=128):
    """The causal BlockMask: query block i sees key blocks 0..i-1 in full and block i through the
    mask. O((T / block)^2) small ints."""
    n = -(-T // block)
    rows = torch.arange(n, device=device, dtype=torch.int32)
    diagonal_count = torch.ones(1, 1, n, device=device, dtype=torch.int32)
    # only column 0 is read
    diagonal_index = torch.zeros(1, 1, n, n, device=device, dtype=torch.int32)
    diagonal_index[..., 0] = rows
    full_count = rows.view(1, 1, n)  # block i has i full blocks before it
    # entries past the count are unused
    full_index = rows.view(1, 1, 1, n).expand(1, 1, n, n).contiguous()
    return BlockMask.from_kv_blocks(diagonal_count, diagonal_index, full_count, full_index,
                                    BLOCK_SIZE=block, mask_mod=flex_mask_mod(), seq_lengths=(T, T))


def causal_block_mask(T, device):
    """The causal BlockMask over T tokens, kept for the next forward at the same length
    (write_causal_block_mask writes one)."""
    # inside a compiled graph the mask is part of the graph: no cache, no guards
    if torch.compiler.is_compiling():
        return write_causal_block_mask(T, device)
    return _kept_causal_block_mask(T, torch.device(device), torch.is_inference_mode_enabled())


# Causal masks kept by (length, device): evaluation calls the model again and again at one length,
# and a long mask is (T / 128)^2 indices plus their transpose, rebuilt for nothing each time. A few
# entries only, so a sweep over lengths does not keep every mask; inference-mode tensors are kept
# apart (the third key) because autograd refuses to save them for a later backward.
CAUSAL_MASKS_KEPT = 4


@functools.lru_cache(maxsize=CAUSAL_MASKS_KEPT)
def _kept_causal_block_mask(T, device, inference_mode):
    return write_causal_block_mask(T, device)


def window_block_mask(T, window, device, block=128):
    """The causal sliding-window BlockMask, block-banded: query block i sees the key blocks whose
    every pair has 0 <= q - k < window in full, and through the mask the diagonal block and the
    blocks the band's lower edge cuts; the rest is skipped, so the cost grows as T x window. For
    blocks of B rows, every pair of query block i and key block c < i is inside the window iff (i -
    c + 1) B <= window, and some pair is iff (i - c - 1) B + 1 < window."""
    n = -(-T // block)
    rows = torch.arange(n, device=device, dtype=torch.int64)[:, None]
    cols = torch.arange(n, device=device, dtype=torch.int64)[None, :]
    full = (cols < rows) & ((rows - cols + 1) * block <= window)
    partial = (cols <= rows) & ((rows - cols - 1) * block + 1 < window) & ~full
    # The index tensors are n x n like causal_block_mask's (BlockMask's transpose for
    # the backward pass reads their width as the number of key blocks); only the first
    # `count` entries of a row are used.
    def ordered(blocks):
        count = blocks.sum(dim=1).to(torch.int32)
        # hits first
        index = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return count.view(1, 1, n), index.view(1, 1, n, n)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block,
                                    mask_mod=flex_mask_mod(window), seq_lengths=(T, T))


# The key of the compiled kernel that serves a layer: `prior` its score_mod's bias function
# (table_bias for a prior read from its distance_table, a prior's kernel form, or None), `ssmax`,
# `static_shapes` (the CPU's workaround for a score_mod that reads a tensor, _make_flex_kernel),
# and `sink`, None or sink_form's "lse" (the kernel also returns its log-sum-exp) or "key" (the
# sink is a key).
FlexKernelKey = namedtuple("FlexKernelKey", "prior ssmax static_shapes sink")


def flex_kernel_key(bias_fn, use_ssmax, has_features, cpu, sink=None):
    """The FlexKernelKey of a layer whose score_mod reads its prior through `bias_fn`."""
    reads_tensors = bias_fn is not None or use_ssmax or has_features or sink is not None
    return FlexKernelKey(bias_fn, use_ssmax, cpu and reads_tensors, sink)


def build_flex_kernels(model):
    """Every flex kernel a forward of `model` can ask for (flex_kernel), on a CPU or a GPU, with
    either flex_prior: made before any trace, so that a compiled forward only reads them. Making
    one costs nothing (it compiles at its first call). Transformer calls it when it is made."""
    kinds = set()  # each distinct (score_mod's bias functions, token features?, SSMax?) of the layers
    for layer, block in enumerate(model.blocks):
        prior = model.prior_of_layer(layer)
        if prior is None:
            bias_fns, has_features = (None,), False
        else:  # with flex_prior = "table" and "formula"
            kernel_form = prior.kernel_bias_fn or prior.bias_fn
            bias_fns = (table_bias, kernel_form) if prior.DISTANCE_ONLY else (kernel_form,)
            has_features = not prior.DISTANCE_ONLY
        kinds.add((bias_fns, has_features, block.attn.ssmax_scale is not None))
    for bias_fns, has_features, use_ssmax in kinds:
        for cpu in (False, True):
            sink = sink_form(cpu) if model.config.attn_sink else None
            for bias_fn in bias_fns:
                flex_kernel(flex_kernel_key(bias_fn, use_ssmax, has_features, cpu, sink))


_FLEX_KERNELS = {}  # FlexKernelKey -> its compiled kernel


def flex_kernel(key):
    """The compiled FlexAttention of `key` (a FlexKernelKey), built at its first request. Building
    writes module state (this cache, and dynamo's recompile budget), which a traced region must not
    do: inside an activation-checkpointed Block dynamo refuses it (an unsafe side effect), elsewhere
    it breaks the graph and changes what the graph's guards saw, so the next call compiles the model
    again. Transformer therefore builds every kernel it can ask for when it is made
    (build_flex_kernels), and traced code only reads."""
    kernel = _FLEX_KERNELS.get(key)
    if kernel is not None:
        return kernel
    if torch.compiler.is_compiling():
        raise RuntimeError(f"no flex kernel for {key} was built before torch.compile traced "
                           "the model; call build_flex_kernels(model) after changing its priors")
    # dynamo's recompile budget (8) is per code object, and every variant, sequence length and mask
    # shape of a kernel shares one: an evaluation sweep over lengths, or a test comparing encodings,
    # would exhaust it and fail under fullgraph. Raised here, outside any trace (never lowering a
    # user's setting).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    kernel = _make_flex_kernel(*key)
    _FLEX_KERNELS[key] = kernel
    return kernel


def _make_flex_kernel(bias_fn, use_ssmax, static_shapes, sink=None):
    """One compiled FlexAttention per FlexKernelKey. The prior's tensors, its token features and
    SSMax's table are arguments, not captured from a module, so every layer (and every model of that
    variant) reuses one compiled kernel instead of recompiling per layer, and gradients flow to them
    as to q, k and v; the variants share this function's code, and so one recompile budget (which
    flex_kernel raises). `static_shapes` (the CPU, for a score_mod that reads any tensor):
    inductor's C++ flex template (torch 2.11 to 2.15) fails to compile these once dynamo has made a
    size dynamic (an undeclared `cur_qSplitSize2` for FoX + SSMax's gates and SSMax's table by query
    after the batch and length, `cur_kvSplitSize` for a distance table's gather under a
    document-and-window mask, `cur_qSplitSize5` for ALiBi's slopes once a model of another head
    count, or on torch 2.11 another variant, ran the kernel: dynamo's record of the sizes seen is
    the code's too), so on a CPU each shape gets its own.
    `sink`: "lse" returns (output, log-sum-exp), "key" scores the sink's key."""

    def kernel(q, k, v, block_mask, prior_tensors, features, factor_table, sink_table=None):
        prior = None if bias_fn is None else (bias_fn, prior_tensors)

        def score_mod(score, b, h, q_idx, kv_idx):
            query = key = None
            # queries and keys are the same tokens: one (B, H, T) tensor each
            if features is not None:
                query = tuple(t[b, h, q_idx] for t in features)
                key = tuple(t[b, h, kv_idx] for t in features)
            return kernel_scores(score, b, h, q_idx, kv_idx, prior,
                                 factor_table if use_ssmax else None, query, key)

        if sink == "key":
            score_mod = sink_score_mod(score_mod, sink_table)
        return flex_call(q, k, v, score_mod, block_mask, sink == "lse")

    return torch.compile(kernel, fullgraph=True, dynamic=False if static_shapes else None)


def flex_call(q, k, v, score_mod, block_mask, with_lse):
    """flex_attention's output, and with `with_lse` its log-sum-exp per query, (B, H, T) fp32."""
    gqa = k.shape[1] != q.shape[1]
    if not with_lse:
        return torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=gqa)
    out, aux = torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


# The flex path joins the others (ATTENTION, in "Attention")
ATTENTION["flex"] = flex_attention
