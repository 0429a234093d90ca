"""ModelConfig.layer_pattern (issue 47 point 1): each layer's encoding, window and SSMax. A pattern with every
layer alike is today's model-wide config, bitwise; the designs it must express read as intended; one context
(one mask) per distinct window; the KV cache keeps each layer's window; bad patterns get one line."""

import pytest
import torch

import model as model_module
from bam.sizing import Sizes
from model import KVCache, LayerKind
from tiny_models import batch, generated_equals_recomputed, tiny_config, tiny_model


def kinds(pe="rope", ssmax=False, window=0, n_layer=4, **kw):
    return tiny_config(pe, ssmax, n_layer=n_layer, attn_window=window, **kw).layer_kinds


def test_the_designs_of_issue_47_read_as_intended():
    rope_w, nope_full = LayerKind("rope", 256, False), LayerKind("nope", 0, False)
    # RNoPE-SWA (Cohere, 3 RoPE-window : 1 NoPE-full), written out and with the window model-wide
    assert kinds(layer_pattern="rope@256*3 nope@full", n_layer=8) == (rope_w,) * 3 + \
        (nope_full,) + (rope_w,) * 3 + (nope_full,)
    assert kinds(window=256, layer_pattern="rope*3 nope@full") == (rope_w,) * 3 + (nope_full,)
    # iRoPE / SmolLM3: NoPE every 4th layer, full attention everywhere
    assert kinds(layer_pattern="rope rope rope nope") == (LayerKind("rope", 0, False),) * 3 + (nope_full,)
    # Gemma's 5 local : 1 global and nanochat's "SSSL"
    assert kinds(n_layer=12, layer_pattern="rope@512*5 rope@full") == ((LayerKind("rope", 512, False),) * 5
                                                                       + (LayerKind("rope", 0, False),)) * 2
    assert kinds(n_layer=8, layer_pattern="@128*3 @full") == ((LayerKind("rope", 128, False),) * 3
                                                              + (LayerKind("rope", 0, False),)) * 2
    # BAM + SSMax global, RoPE-window local; the model-wide ssmax is the default a word may turn off
    assert kinds(n_layer=3, layer_pattern="rope@64*2 bam+ssmax@full") == (LayerKind("rope", 64, False),) * 2 + \
        (LayerKind("bam", 0, True),)
    assert kinds(pe="bam", ssmax=True, n_layer=3, layer_pattern="rope-ssmax@64*2 bam") == \
        (LayerKind("rope", 64, False),) * 2 + (LayerKind("bam", 0, True),)


@pytest.mark.parametrize("model_wide,pattern", [
    (dict(pe="bam", ssmax=True, attn_window=6), dict(pe="nope", layer_pattern="bam+ssmax@6")),
    (dict(pe="rope", attn_window=5), dict(pe="alibi", ssmax=True, layer_pattern="rope-ssmax@5, rope-ssmax@5")),
    (dict(pe="fox", ssmax=True), dict(pe="fox", layer_pattern="fox+ssmax@full")),
    (dict(pe="alibi"), dict(pe="bam", layer_pattern="alibi")),  # a shared prior: one module, as model-wide
    (dict(pe="bam", bam_per_layer=False, ssmax=True), dict(bam_per_layer=False, layer_pattern="bam+ssmax")),
])
def test_a_pattern_with_every_layer_alike_is_the_model_wide_config_bitwise(model_wide, pattern):
    """Same seed, same parameters under the same names, and logits and gradients torch.equal on the CPU's
    training path (sdpa) and the reference (eager), with documents."""
    idx, doc_ids = batch(T=24)
    results = []
    for kw in (model_wide, pattern):
        model = tiny_model(**kw)
        grads = {}
        for impl in ("eager", "sdpa"):
            model.zero_grad(set_to_none=True)
            model.config.attn_impl = impl
            logits, loss = model(idx, torch.roll(idx, -1, 1), doc_ids=doc_ids)
            loss.backward()
            grads[impl] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        results.append((model.state_dict(), grads))
    (state, grads), (state_p, grads_p) = results
    assert list(state) == list(state_p)
    assert all(torch.equal(state[k], state_p[k]) for k in state)
    for impl in ("eager", "sdpa"):
        assert torch.equal(grads[impl][0], grads_p[impl][0]), impl
        assert grads[impl][1].keys() == grads_p[impl][1].keys()
        for name, g in grads[impl][1].items():
            assert torch.equal(g, grads_p[impl][1][name]), f"{impl} {name}"


def test_state_dict_keys_without_a_pattern_are_todays():
    """Written out for a 2-layer BAM + SSMax model: checkpoints and exports of every config before layer_pattern
    load as they did."""
    per_layer = ["attn_norm.weight", "attn.ssmax_scale", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight",
                 "attn.wo.weight", "mlp_norm.weight", "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
    expected = {"tok_emb.weight", "norm.weight", "lm_head.weight"}
    expected |= {f"blocks.{i}.{name}" for i in range(2) for name in per_layer}
    expected |= {f"priors.{i}.{name}" for i in range(2) for name in ("shape", "log_scale", "loc")}
    assert set(tiny_model(pe="bam", ssmax=True).state_dict()) == expected


def test_each_layer_gets_its_own_prior_and_ssmax_and_a_layer_without_is_skipped():
    model = tiny_model(pe="rope", n_layer=4, layer_pattern="rope@4 bam+ssmax alibi rope-ssmax@4")
    assert model.prior_index == (None, 0, 1, None)
    assert [type(p).__name__ for p in model.priors] == ["BAMPrior", "ALiBiPrior"]
    assert [b.attn.ssmax_scale is not None for b in model.blocks] == [False, True, False, False]
    assert [b.attn.rotary for b in model.blocks] == [True, False, False, True]
    assert model.prior_of_layer(0) is None and model.prior_of_layer(1) is model.priors[0]
    summary = model.prior_summary()
    assert len(summary["bam_shape"]) == 1 and len(summary["ssmax_scale"]) == 1 and len(summary["alibi_slope"]) == 1
    # the prior's optimizer group holds exactly the BAM layer's prior and SSMax scales
    assert {id(p) for p in model.prior_parameters()} == {id(p) for p in model.priors[0].parameters()} | \
        {id(model.blocks[1].attn.ssmax_scale)}
    assert Sizes.of(model.config).total == model.num_params()


def test_one_attention_context_per_distinct_window(monkeypatch):
    """A forward builds one mask per window the layers use, not one per layer (on flex: one BlockMask each)."""
    model = tiny_model(pe="rope", n_layer=6, attn_window=5, layer_pattern="rope*2 nope@full", attn_impl="eager")
    built = []
    original = model_module.attention_context

    def counting(*args):
        ctx = original(*args)
        built.append(ctx.window)
        return ctx

    monkeypatch.setattr(model_module, "attention_context", counting)
    seen = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda attn, args: seen.append(args[1].window))
    idx, doc_ids = batch(T=24)
    with torch.no_grad():
        model(idx, doc_ids=doc_ids)
    assert built == [5, 0] and seen == [5, 5, 0] * 2


@pytest.mark.slow
def test_flex_builds_one_block_mask_per_window_and_equals_eager(monkeypatch):
    model = tiny_model(pe="bam", ssmax=True, n_layer=4, layer_pattern="rope-ssmax@129*3 bam@full")
    calls = []
    real = model_module.make_block_mask
    monkeypatch.setattr(model_module, "make_block_mask",
                        lambda doc_ids, T, device, window=0: calls.append(window) or real(doc_ids, T, device, window))
    idx = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50])
    with torch.no_grad():
        model.config.attn_impl = "eager"
        expected = model(idx, doc_ids=doc_ids)[0]
        model.config.attn_impl = "flex"
        got = model(idx, doc_ids=doc_ids)[0]
    assert calls == [129, 0]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_pattern_with_every_layer_alike_is_the_model_wide_config_bitwise_on_flex():
    """The flex path's forward (a CPU has no flex backward): the same kernel, the same mask, the same logits."""
    idx = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50])
    logits = []
    for kw in (dict(pe="bam", ssmax=True, attn_window=129), dict(pe="rope", layer_pattern="bam+ssmax@129")):
        model = tiny_model(attn_impl="flex", **kw)
        with torch.no_grad():
            logits.append(model(idx, doc_ids=doc_ids)[0])
    assert torch.equal(*logits)


@pytest.mark.parametrize("pe,ssmax,pattern,kv", [("rope", False, "rope@4 nope@full", 0),
                                                 ("bam", True, "rope-ssmax@3 bam+ssmax@full", 2),
                                                 ("fox", False, "fox@5 fire", 0)])
def test_generation_with_a_pattern_equals_full_recompute(pe, ssmax, pattern, kv):
    """The cache keeps W - 1 positions in a windowed layer and every one in a full layer, and the tokens are
    those of recomputing the whole sequence at every step."""
    model = tiny_model(pe=pe, ssmax=ssmax, n_kv_head=kv, layer_pattern=pattern)
    seq = generated_equals_recomputed(model)
    with torch.no_grad():
        cache = KVCache(model.config, 2, 22, "cpu", torch.float32)
        model(seq, kv_cache=cache)
    windows = [kind.window for kind in model.config.layer_kinds]
    assert [k.shape[2] for k in cache.k] == [w - 1 if w else 22 for w in windows]


def test_an_evaluators_attn_window_changes_the_layers_that_take_the_model_wide_one():
    model = tiny_model(pe="rope", attn_window=4, layer_pattern="rope nope@full")
    assert model.config.layer_windows == (4, 0)
    model.config.attn_window = 9
    assert model.config.layer_windows == (9, 0)


@pytest.mark.parametrize("kw,match", [
    (dict(layer_pattern="rope xpos"), r"unknown encoding 'xpos' in layer_pattern 'rope xpos'; allowed: nope, rope"),
    (dict(layer_pattern="rope*3"), r"describes 3 layers, which does not divide n_layer=2"),
    (dict(layer_pattern="rope@-4 nope"), r"word 'rope@-4' is not ENCODING\[\+ssmax\|-ssmax\]\[@WINDOW\|@full\]"),
    (dict(layer_pattern="rope+SSMAX nope"), r"word 'rope\+SSMAX' is not"),
    (dict(layer_pattern="rope*0 nope"), r"word 'rope\*0' is not .*COUNT >= 1"),
    (dict(layer_pattern="sinusoidal nope"), r"mixes sinusoidal with other encodings"),
    (dict(pe="rope", rope_scaling="yarn", rope_factor=4.0, layer_pattern="nope alibi"),
     r"rope_scaling needs a rotary encoding \(pe = 'rope' in some layer\)"),
    (dict(layer_pattern=["rope", "nope"]), r"layer_pattern must be a string"),
    (dict(pe="rope", rope_fraction=0.5, layer_pattern="nope alibi"),
     r"rope_fraction needs a rotary encoding \(pe = 'rope' in some layer\)"),
])
def test_bad_patterns_name_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match) as error:
        tiny_config(**kw)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("pattern,match", [
    ("rope*1000000000", r"describes 1000000000 layers, which does not divide n_layer=2"),
    ("nope rope*999999999999999999999999", r"describes 1000000000000000000000000 layers"),
    ("rope@99999999999999999999", r"window 99999999999999999999: allowed: an integer >= 0, <= 2147483647"),
    ("rope@" + "9" * 5000, r"word 'rope@99999.*' is not ENCODING"),
])
def test_a_pattern_is_refused_in_one_line_before_any_layer_is_listed(pattern, match):
    """Issue 59: a repeat count of a billion was expanded into a list (MemoryError) before it was checked, and a
    window past any position was accepted and overflowed at step 0. The layers are counted, and every window
    held to attn_window's range, before anything is built; a 5,000-digit number is refused as a malformed word."""
    import tracemalloc
    tracemalloc.start()
    with pytest.raises(ValueError, match=match) as error:
        tiny_config(layer_pattern=pattern)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "\n" not in str(error.value) and len(str(error.value)) < 300
    assert peak < 1 << 20  # constant memory, whatever the count


def test_partial_rope_turns_the_pattern_s_rope_layers_under_a_non_rotary_default():
    # pe = "nope" with RoPE in one layer: rope_fraction reaches that layer (0 = NoPE there, exactly)
    idx, doc_ids = batch()

    def logits(**kw):
        model = tiny_model(pe="nope", **kw)
        with torch.no_grad():
            return model(idx, doc_ids=doc_ids)[0]
    assert torch.equal(logits(layer_pattern="rope nope", rope_fraction=0.0), logits(layer_pattern="nope nope"))
    assert not torch.equal(logits(layer_pattern="rope nope", rope_fraction=0.5), logits(layer_pattern="nope nope"))
