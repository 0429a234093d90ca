"""
The `transformers` face of model.py: a PretrainedConfig and a causal-LM PreTrainedModel that build
model.Transformer as it is, so an exported folder computes exactly what this repository computes.

export_hf.py copies this file and model.py, verbatim, into the exported folder; `from .model import`
below makes transformers' remote-code loader (`trust_remote_code=True`) copy model.py along with it.
It is not imported from the repository itself. Nothing about an encoding is written here: every
ModelConfig field travels in `config.json` under "bam_model" (read with dataclasses.fields, so a new
field, prior or option in model.py is exported without touching this file).

Generation uses the library's KV cache (DynamicCache): model.py asks its cache for
`update(layer, start, k, v) -> (all keys, all values)`, which `_CacheView` answers with
`Cache.update(k, v, layer)`, and, for a prior with token features (FoX's cumulative gates, FIRE's positions;
model.AdditivePrior), for `past_features` / `update_features`, which `_CacheView` keeps on the Cache object
beside the library's keys and values (greedy and sampled generation; beam reordering does not reach them).
"""

from dataclasses import asdict

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .model import ModelConfig, Transformer, broadcast_leading

# newer transformers renamed `past_key_values` to `cache`; the output takes the name this version has
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class BAMConfig(PretrainedConfig):
    model_type = "bam_lm"

    def __init__(self, bam_model=None, **kwargs):
        cfg = ModelConfig.from_dict(bam_model)
        self.bam_model = asdict(cfg)
        # The library's standard names, for its utilities (cache sizing, pipelines); model.py itself reads
        # only bam_model. No max_position_embeddings: the training context (block_size) is no limit at
        # inference, and tools would read one as the longest input the model accepts.
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.n_embd
        self.num_hidden_layers = cfg.n_layer
        self.num_attention_heads = cfg.n_head
        self.num_key_value_heads = cfg.kv_heads
        # model.py's LM head is its own matrix (as in the paper) unless tie_embeddings makes it the embedding's
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        kwargs.setdefault("use_cache", True)
        kwargs.setdefault("eos_token_id", 50256)
        kwargs.setdefault("bos_token_id", 50256)
        super().__init__(**kwargs)


class _CacheView:
    """model.py's kv_cache interface over a transformers Cache: the library's cache holds the keys (after
    RoPE) and values of every layer, model.py asks for them by layer and start position."""

    def __init__(self, cache):
        self.cache = cache

    def first_key(self, start, window):
        """The library's cache keeps every position from 0; a sliding window (a layer's attn_window) is then
        applied by the attention mask, over all of them."""
        return 0

    def update(self, layer, start, k, v):
        cached = self.cache.get_seq_length(layer)
        if cached != start:
            raise ValueError(f"the KV cache of layer {layer} holds {cached} positions, but the new tokens start "
                             f"at position {start}")
        return self.cache.update(k, v, layer)

    def _features(self):
        if not hasattr(self.cache, "bam_token_features"):
            self.cache.bam_token_features = {}
        return self.cache.bam_token_features

    def past_features(self, layer, start):
        stored = self._features().get(layer)
        return None if stored is None else tuple(t[..., :start] for t in stored)

    def update_features(self, layer, start, features):
        past = self.past_features(layer, start)
        if past is not None and past[0].shape[-1] != start:
            raise ValueError(f"the token features of layer {layer} hold {past[0].shape[-1]} positions, but the new "
                             f"tokens start at position {start}")
        joined = features if past is None else tuple(torch.cat(broadcast_leading(p, t), dim=-1)
                                                     for p, t in zip(past, features))
        self._features()[layer] = joined
        return joined


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


class _Wrapped(torch.nn.Module):
    """Transformer under the attribute name BAMForCausalLM gives it, so buffer names match."""

    def __init__(self, config):
        super().__init__()
        self.model = Transformer(ModelConfig.from_dict(config.bam_model))


class BAMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = BAMConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_cache_class = True
    # read only with tie_word_embeddings (ModelConfig.tie_embeddings): model.safetensors then holds the one
    # matrix once, and loading ties the head to it again, as model.py's Transformer does
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}
    # Loaded with torch_dtype=torch.bfloat16 (the usual way), the positional priors, SSMax's scales and the sinks'
    # logits (model.Transformer.prior_parameters) stay fp32, as training keeps them under autocast: in bf16 BAM's
    # shape b = -0.3 alone moves a logit at distance 0 by up to 3.6. transformers 5 reads the strict list for bf16
    # and fp16, older versions the other one.
    _keep_in_fp32_modules = _keep_in_fp32_modules_strict = ["model.priors.", "ssmax_scale", "sink_logit"]

    def __init__(self, config):
        super().__init__(config)
        self.model = Transformer(ModelConfig.from_dict(config.bam_model))
        self.post_init()

    def _init_weights(self, module):
        """transformers calls this, after loading, for each module that has a parameter or buffer the checkpoint
        did not set. Weights: Transformer(...) initialised them as in training. Non-persistent buffers (such
        as ALiBi's slopes) are functions of the config that model.py computes in __init__, but the library
        builds the model on the meta device, so they are empty here: take them from a model built for real."""
        own = getattr(module, "_non_persistent_buffers_set", ())
        if not own:
            return
        prefix = next(name for name, m in self.named_modules() if m is module)
        reference = self._reference_buffers()
        for name in own:
            key = f"{prefix}.{name}" if prefix else name
            setattr(module, name, reference[key].to(getattr(module, name).device))

    def _reference_buffers(self):
        if getattr(self, "_reference", None) is None:
            with torch.device("cpu"), _no_init():  # the weights are thrown away: skip their random init
                fresh = _Wrapped(self.config)
            self._reference = dict(fresh.named_buffers())
        return self._reference

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        self.model.tok_emb = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, labels=None, use_cache=None,
                logits_to_keep=0, return_dict=True, past_key_values=None, **kwargs):
        """The usual causal-LM call. `attention_mask` may only mark right padding (trailing zeros), which
        cannot change the logits of the tokens before it; model.py has no notion of left padding, so
        batches with it must be split by length."""
        if input_ids is None:
            raise ValueError("BAMForCausalLM needs input_ids (inputs_embeds are not supported)")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("BAMForCausalLM does not take inputs_embeds; pass input_ids")
        cache = cache if cache is not None else past_key_values  # the older name
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None and not isinstance(cache, Cache):
            raise ValueError("BAMForCausalLM needs a transformers Cache (e.g. DynamicCache), not legacy tuples")
        start = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.ndim == 2:
            mask = attention_mask.bool()
            if start and not bool(mask.all()):
                raise ValueError("BAMForCausalLM: padded batches cannot continue from a KV cache (model.py has "
                                 "no padding mask); generate each prompt alone or give prompts of one length")
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("BAMForCausalLM: only right padding is supported (zeros at the end of "
                                 "attention_mask), not left padding")
        kv_cache = _CacheView(cache) if cache is not None else None
        keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
        logits, _ = self.model(input_ids, last_k=keep, kv_cache=kv_cache, start_pos=start)
        loss = None
        if labels is not None:
            if keep is not None:
                raise ValueError("labels need logits at every position: leave logits_to_keep at 0")
            # transformers' convention: labels are the inputs (not shifted), -100 is ignored
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return output if return_dict else output.to_tuple()


BAMConfig.register_for_auto_class()
BAMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
