"""QK-norm (model.qk_norm, issue 58): an RMSNorm over each head's query and key with a gain per channel, before
the rotation, as Qwen3 has it. Its formula against plain torch; every encoding, with and without SSMax, equal on
the attention paths in values and gradients (the fast lane: sdpa against eager; flex against eager in the full
suite); the KV cache; the gains as a parallel run and the optimizer need them; a run that turns it on."""

import dataclasses
import math

import pytest
import torch

from bam import checkpoint, sizing
from bam.config import PARAMETER_ADDING_MODEL_KEYS, load_config
from model import PE_CHOICES, Transformer, apply_rope, attention_context
from tiny_models import (assert_grads_equal, batch, generated_equals_recomputed, logits_and_grads, logits_with,
                         tiny_config, tiny_model)

EVERY_ENCODING = [(pe, ssmax) for pe in PE_CHOICES for ssmax in (False, True)]


def qk_model(pe="rope", ssmax=False, **kw):
    model = tiny_model(pe=pe, ssmax=ssmax, qk_norm=True, **kw)
    with torch.no_grad():  # gains off their initial 1, so that a test cannot pass for want of them
        for block in model.blocks:
            for norm in (block.attn.q_norm, block.attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    return model


def test_qk_norm_is_an_rmsnorm_of_each_heads_query_and_key_before_the_rotation():
    """q_h <- g_q * q_h / rms(q_h), k_h alike with g_k, per head and token over its head_dim channels, then RoPE:
    written here with plain tensors (Qwen3's order: Qwen3Attention normalises, then applies the rotary
    embedding)."""
    model = qk_model("rope", n_kv_head=2)
    attn, cfg = model.blocks[0].attn, model.config
    B, T, H, KV, hd = 2, 9, cfg.n_head, cfg.kv_heads, cfg.head_dim
    x = torch.randn(B, T, cfg.n_embd, generator=torch.Generator().manual_seed(5))
    ctx = attention_context(model, 0, T, torch.arange(T)[None])
    with torch.no_grad():
        q, k, _ = attn.project(x, ctx)

        def normed(y, heads, gain):
            y = y.view(B, T, heads, hd).transpose(1, 2)
            return gain * y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

        want_q = apply_rope(normed(x @ attn.wq.weight.T, H, attn.q_norm.weight), *ctx.rope)
        want_k = apply_rope(normed(x @ attn.wk.weight.T, KV, attn.k_norm.weight), *ctx.rope)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    # a logit is then bounded by the gains, whatever the scale of x
    with torch.no_grad():
        q_big, k_big, _ = attn.project(1000 * x, ctx)
    bound = hd * attn.q_norm.weight.abs().max() * attn.k_norm.weight.abs().max() / math.sqrt(hd)
    assert (q_big @ k_big.repeat_interleave(H // KV, 1).transpose(-2, -1) / math.sqrt(hd)).abs().max() <= bound + 1e-3


@pytest.mark.parametrize("pe,ssmax", EVERY_ENCODING)
def test_every_encoding_with_qk_norm_gives_eager_values_and_gradients_on_sdpa(pe, ssmax):
    model = qk_model(pe, ssmax)
    idx, doc_ids = batch()
    results = {impl: logits_and_grads(model, impl, idx, doc_ids) for impl in ("sdpa", "eager")}
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    grads, expected = results["sdpa"][1], results["eager"][1]
    assert "blocks.0.attn.q_norm.weight" in grads
    assert_grads_equal(grads, expected)


@pytest.mark.slow
@pytest.mark.parametrize("pe,ssmax", EVERY_ENCODING)
def test_every_encoding_with_qk_norm_gives_eager_values_on_flex(pe, ssmax):
    model = qk_model(pe, ssmax)
    idx, doc_ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(logits_with(model, "flex", idx, doc_ids), logits_with(model, "eager", idx, doc_ids),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pe,pattern", [("rope", ""), ("fox", ""), ("bam", "rope@6 bam+ssmax@full")])
def test_generation_with_qk_norm_equals_recomputing_the_sequence(pe, pattern):
    """The cache holds the keys after QK-norm and the rotation, as the full forward computes them."""
    generated_equals_recomputed(qk_model(pe, True, layer_pattern=pattern))


def test_the_gains_start_at_one_are_1d_and_are_not_decayed():
    """1-D (FSDP2 shards no 0-d tensor), no weight decay (a norm's gain, as the others), counted in the sizes and
    in the memory plan's activations."""
    plain, normed = tiny_model(pe="rope"), tiny_model(pe="rope", qk_norm=True)
    gains = [p for n, p in normed.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(gains) == 2 * normed.config.n_layer
    assert all(p.dim() == 1 and p.shape == (normed.config.head_dim,) and torch.equal(p, torch.ones_like(p))
               for p in gains)
    no_decay = next(g for g in normed.optim_groups(0.1) if g["name"] == "no_decay")["params"]
    assert all(any(p is q for q in no_decay) for p in gains)
    assert normed.num_params() - plain.num_params() == 2 * normed.config.n_layer * normed.config.head_dim
    assert sizing.Sizes.of(normed.config).total == normed.num_params()
    assert sizing.activation_bytes(normed.config, 1024, True, "none") > \
        sizing.activation_bytes(plain.config, 1024, True, "none")
    # the same weights otherwise: turning QK-norm on draws nothing from the random generator
    shared = {n: p for n, p in plain.state_dict().items()}
    assert all(torch.equal(p, shared[n]) for n, p in normed.state_dict().items() if n in shared)


def test_a_config_turns_it_on_and_init_from_may_add_it():
    """model.qk_norm from the command line; and train.init_from may turn it on over a checkpoint without it (the
    gains are new parameters, at their initial 1; bam.config.PARAMETER_ADDING_MODEL_KEYS), as DroPE's recipe
    does (docs/training.md)."""
    cfg = load_config("configs/tiny.toml", ["--model.qk_norm=true"])
    assert cfg.model.qk_norm
    base = tiny_config("rope")
    state = Transformer(base).state_dict()
    assert checkpoint.added_parameters(dataclasses.replace(base, qk_norm=True), state) == (
        ["blocks.*.attn.q_norm.weight (2 tensors)", "blocks.*.attn.k_norm.weight (2 tensors)"], [])
    assert "qk_norm" in PARAMETER_ADDING_MODEL_KEYS
