"""model.py: the three attention paths against each other, the priors against the paper's formulas,
and the structural properties (causality, document isolation, KV cache) on tiny CPU models."""

import math

import pytest
import torch

import model as model_module
from bam.checkpoint import load_model, save_model
from model import (CHECKED_SETTINGS, ENCODINGS, PE_CHOICES, PRIORS, ModelConfig, Transformer, alibi_slopes, apply_rope,
                   ggd_bias)
from tiny_models import VOCAB, batch, generated_equals_recomputed, logits_with, tiny_model, tiny_config


def settings_id(settings):
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


# Every encoding, at its defaults and at each of its checked_settings (partial RoPE), x SSMax x documents; then
# per-layer patterns (ModelConfig.layer_pattern) on the tiny models' two layers: RNoPE-SWA's RoPE window and
# NoPE full attention, BAM + SSMax global with a RoPE window, a per-layer prior with token features beside a
# shared one (one kernel, table or formula, per layer kind on flex)
# and issue 47's designs together: a pattern, partial RoPE in its RoPE layers, learned sinks, gated attention
ALL_AT_ONCE = dict(layer_pattern="rope@5 bam+ssmax@full", rope_fraction=0.5, attn_sink=True, attn_gate=True)
PATTERNS = [("rope", False, "rope@5 nope@full"), ("bam", True, "rope-ssmax@5 bam+ssmax@full"),
            ("fox", False, "fox@5 alibi+ssmax")]
GRID = [pytest.param(pe, settings, ssmax, docs, id=f"{pe}-{settings_id(settings)}-{ssmax}-{docs}")
        for pe, settings in CHECKED_SETTINGS for ssmax in (False, True) for docs in (False, True)] + \
    [pytest.param(pe, {"layer_pattern": pattern}, ssmax, docs, id=f"{pe}-{pattern}-{ssmax}-{docs}")
     for pe, ssmax, pattern in PATTERNS for docs in (False, True)] + \
    [pytest.param("bam", ALL_AT_ONCE, False, docs, id=f"bam-all-at-once-{docs}") for docs in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("pe,settings,ssmax,docs", GRID)
def test_flex_and_sdpa_outputs_match_eager(pe, settings, ssmax, docs):
    model = tiny_model(pe=pe, ssmax=ssmax, bam_train_loc=True, **settings)
    idx, doc_ids = batch()
    doc_ids = doc_ids if docs else None
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        for impl in ("sdpa", "flex"):
            torch.testing.assert_close(logits_with(model, impl, idx, doc_ids), ref, atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{impl}: {m}")


@pytest.mark.parametrize("pe,settings,ssmax,docs", GRID)
def test_sdpa_gradients_match_eager(pe, settings, ssmax, docs):
    # bam_train_loc so the location parameter's gradient is checked as well
    model = tiny_model(pe=pe, ssmax=ssmax, bam_train_loc=True, **settings)
    idx, doc_ids = batch(T=24)
    targets = torch.roll(idx, -1, dims=1)
    grads = {}
    for impl in ("eager", "sdpa"):
        model.zero_grad(set_to_none=True)
        model.config.attn_impl = impl
        _, loss = model(idx, targets, doc_ids=doc_ids if docs else None)
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["eager"].keys() == grads["sdpa"].keys()
    prior_names = [n for n in grads["eager"] if n.startswith("priors") or "ssmax" in n]
    if pe == "bam" or ssmax:
        assert prior_names, "the prior/SSMax parameters must receive gradients"
    for name, g in grads["eager"].items():
        assert g.abs().sum() > 0 or name.endswith("loc"), f"{name} got no gradient"
        torch.testing.assert_close(grads["sdpa"][name], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.cuda  # flex has no backward on the CPU in torch 2.13
@pytest.mark.parametrize("pe,ssmax", [("bam", True), ("alibi", False), ("rope", True), ("t5", True), ("fire", False),
                                     ("fox", True)])  # FoX, FIRE: flex differentiates through their token features
def test_flex_gradients_match_eager_on_gpu(pe, ssmax):
    # head_dim 16: CUDA's flex kernels refuse narrower heads ("NYI: embedding dimension ... at least 16")
    model = tiny_model(pe=pe, ssmax=ssmax, n_embd=64).cuda()
    assert model.blocks[0].attn.wq.out_features // model.config.n_head == 16
    idx, doc_ids = (t.cuda() for t in batch(T=256))
    grads = {}
    for impl in ("eager", "flex"):
        model.zero_grad(set_to_none=True)
        model.config.attn_impl = impl
        model(idx, torch.roll(idx, -1, 1), doc_ids=doc_ids)[1].backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, g in grads["eager"].items():
        torch.testing.assert_close(grads["flex"][name], g, atol=1e-4, rtol=1e-3)


def test_ggd_bias_is_the_papers_formula():
    """Against docs/paper.md §2 written out independently: -exp(a) * (|d - mu| + eps) ** b, mu = e^l - e^-l."""
    dist = torch.arange(0, 3000, 7, dtype=torch.float64)
    for b, a, l in [(1.0, -2.0, 0.0), (0.0, 0.5, 0.0), (-0.6, 0.1, 0.0), (2.3, -5.0, 0.2), (-1.7, 1.0, -0.1)]:
        mu = math.exp(l) - math.exp(-l)
        expected = -math.exp(a) * ((dist - mu).abs() + 1e-5) ** b
        t = lambda x: torch.tensor([x], dtype=torch.float64)
        got = ggd_bias(dist, 0, t(b), t(a), t(l))
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=0)


def test_kerple_biases_are_the_papers_formulas():
    """Against Chi et al. (KERPLE) written out independently in float64: log kernel -r1 ln(1 + r2 |d|),
    power kernel -r1 |d| ** r2, with r1, r2 the prior's constrained (positive) values."""
    torch.manual_seed(0)
    cfg = tiny_config("kerple_log")
    dist = torch.arange(-2000, 2000, 7, dtype=torch.float64)
    for name, formula in (("kerple_log", lambda d, r1, r2: -r1 * torch.log(1 + r2 * d.abs())),
                          ("kerple_power", lambda d, r1, r2: -r1 * d.abs() ** r2)):
        prior = ENCODINGS[name](cfg).double()
        r1, r2 = prior.tensors()
        for head in range(cfg.n_head):
            expected = formula(dist, r1[head].item(), r2[head].item())
            torch.testing.assert_close(prior.bias_fn(dist, head, r1, r2), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_parameters_stay_in_their_bounds(name):
    """r1, r2 > 0 for any raw value (and r2 <= 2 for the power kernel); init as the reference code:
    r1 in (0, 2] / (0, 1], r2 in (0, 1] / (0, 2]; the gradient at distance 0 is finite."""
    torch.manual_seed(0)
    prior = ENCODINGS[name](tiny_config(name, n_head=64, n_embd=128))
    r1, r2 = prior.tensors()
    upper = {"kerple_log": (2.0, 1.0), "kerple_power": (1.0, 2.0)}[name]
    assert 0.01 < r1.min() and r1.max() <= upper[0] + 1e-5 and 0.01 < r2.min() and r2.max() <= upper[1] + 1e-5
    with torch.no_grad():
        prior.raw_r1.copy_(torch.linspace(-60, 60, 64))
        prior.raw_r2.copy_(torch.linspace(60, -60, 64))
    r1, r2 = prior.tensors()
    assert (r1 >= 0.01).all() and (r2 >= 0.01).all() and torch.isfinite(r1).all()
    if name == "kerple_power":
        assert (r2 <= 2.0).all()
    bias = prior.bias_fn(torch.arange(0.0, 50.0)[None, :], torch.arange(64)[:, None], r1, r2)
    bias.sum().backward()
    assert torch.isfinite(prior.raw_r1.grad).all() and torch.isfinite(prior.raw_r2.grad).all()


def test_every_prior_is_registered_once_and_builds_its_layers():
    for name, enc in PRIORS.items():
        model = Transformer(tiny_config(name, n_layer=3))
        assert isinstance(model.priors[0], enc) and len(model.priors) in (1, 3), name
        assert set(model.prior_summary()) - {"ssmax_scale"}, name  # something per head to log
    assert set(PRIORS) <= set(PE_CHOICES) == set(ENCODINGS)


def test_alibi_slopes():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (ALiBi's reference code)
    s16 = [2.0 ** (-(i + 1) / 2) for i in range(16)]
    assert alibi_slopes(12) == pytest.approx(alibi_slopes(8) + s16[0::2][:4])


def transplant(src, dst):
    """Copy every weight except the positional priors, so two encodings differ only in the prior."""
    state = {k: v for k, v in src.state_dict().items() if not k.startswith("priors")}
    dst.load_state_dict(state, strict=False)
    return dst


@pytest.mark.parametrize("ssmax", [False, True])
def test_bam_at_alibi_init_is_alibi(ssmax):
    torch.manual_seed(0)
    alibi = Transformer(tiny_config("alibi", ssmax=ssmax, attn_impl="eager"))
    bam = transplant(alibi, Transformer(tiny_config("bam", ssmax=ssmax, bam_init="alibi", attn_impl="eager")))
    idx, doc_ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(bam(idx, doc_ids=doc_ids)[0], alibi(idx, doc_ids=doc_ids)[0],
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("setting", ["shape0", "scale_to_zero", "uniform_init"])
def test_bam_reduces_to_nope(setting):
    torch.manual_seed(0)
    nope = Transformer(tiny_config("nope", attn_impl="eager"))
    bam = transplant(nope, Transformer(tiny_config("bam", bam_init="uniform" if setting == "uniform_init" else "alibi",
                                            attn_impl="eager")))
    with torch.no_grad():
        for prior in bam.priors:
            if setting == "shape0":
                prior.shape.zero_()
                prior.log_scale.normal_()  # any scale: a constant bias is ignored by softmax
            elif setting == "scale_to_zero":
                prior.log_scale.fill_(-40.0)
                prior.shape.normal_()
    idx, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(bam(idx)[0], nope(idx)[0], atol=1e-6, rtol=1e-5)


def test_negative_shape_prefers_distant_tokens():
    """b < 0: with no content signal, a head gives more weight to far keys than to near ones (docs/paper.md §2)."""
    from model import AttnContext, dense_mask, eager_attention
    T = 64
    shape, log_scale, loc = torch.tensor([-0.6]), torch.tensor([0.0]), torch.tensor([0.0])
    dist = torch.arange(T, dtype=torch.float32)
    bias = ggd_bias(dist, 0, shape, log_scale, loc)
    assert torch.all(bias[1:] > bias[:-1]), "bias must increase (less negative) with distance"
    assert bias[0] == pytest.approx(-1e3, rel=1e-3)  # eps = 1e-5 ** -0.6 = 1000 (docs/paper.md §2)
    pos = torch.arange(T)
    ctx = AttnContext("eager", pos, pos, dense_mask(pos, pos), None, None)
    # attention weights of the last query over its keys: q.k = 0 leaves the prior alone, and v = identity
    # returns the weights themselves
    v = torch.eye(T)[None, None]
    w = eager_attention(torch.zeros(1, 1, T, T), torch.zeros(1, 1, T, T), v, ctx,
                        (ggd_bias, (shape, log_scale, loc)), None)[0, 0, -1]
    assert w[0] > w[T // 2] > w[-2] > w[-1]  # the farthest key gets the most weight, the query itself least


def test_extreme_negative_shape_stays_finite():
    model = tiny_model(pe="bam", ssmax=True)
    with torch.no_grad():
        for prior in model.priors:
            prior.shape.fill_(-12.0)  # (1e-5) ** -12 = 1e60 would overflow fp32 without the cap
    idx, doc_ids = batch()
    for impl in ("eager", "sdpa"):
        model.zero_grad(set_to_none=True)
        model.config.attn_impl = impl
        logits, loss = model(idx, torch.roll(idx, -1, 1), doc_ids=doc_ids)
        assert torch.isfinite(logits).all() and torch.isfinite(loss)
        loss.backward()
        for n, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), n


def test_rope_scores_depend_only_on_relative_position():
    hd = 16
    cfg = ModelConfig(n_head=1, n_embd=hd, pe="rope", rope_theta=500_000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, hd, generator=g), torch.randn(1, 1, 1, hd, generator=g)

    def score(i, j):
        qi = apply_rope(q, *ENCODINGS["rope"].rotation(torch.tensor([i]), cfg))
        kj = apply_rope(k, *ENCODINGS["rope"].rotation(torch.tensor([j]), cfg))
        return (qi * kj).sum().item()

    for i, j in [(5, 2), (100, 37), (3000, 0)]:
        for shift in (1, 1000, 250_000):
            assert score(i + shift, j + shift) == pytest.approx(score(i, j), rel=1e-4, abs=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3  # and they do depend on it


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.0])
def test_rope_turns_each_pair_by_position_times_its_frequency(fraction):
    """RoFormer (Su et al. 2021, eq. 34): the pair (x_a, x_b) of frequency theta^(-2i/d) at position p turns by
    +p theta^(-2i/d), to (x_a cos - x_b sin, x_a sin + x_b cos); our pairs are (i, i + d/2). Written out here
    one entry at a time. A turn the other way keeps every score relative, so only this catches it; it is
    also the turn of transformers' Llama, which imports and exports rely on. Partial RoPE (p-RoPE) turns the
    first rope_fraction of the pairs, the fastest, at these same frequencies; the others keep x as it is."""
    hd = 16
    cfg = ModelConfig(n_head=1, n_embd=hd, pe="rope", rope_theta=10_000.0, rope_fraction=fraction)
    x = torch.randn(1, 1, 7, hd, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    turned = apply_rope(x, *ENCODINGS["rope"].rotation(torch.arange(7), cfg))
    expected = torch.zeros_like(x)
    for p in range(7):
        for i in range(hd // 2):
            angle = p * 10_000.0 ** (-2 * i / hd) if i < fraction * hd // 2 else 0.0
            a, b = x[0, 0, p, i].item(), x[0, 0, p, i + hd // 2].item()
            expected[0, 0, p, i] = a * math.cos(angle) - b * math.sin(angle)
            expected[0, 0, p, i + hd // 2] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(turned, expected, atol=1e-6, rtol=1e-5)


def logits_and_grads(model, impl, idx, doc_ids):
    model.zero_grad(set_to_none=True)
    model.config.attn_impl = impl
    logits, loss = model(idx, torch.roll(idx, -1, 1), doc_ids=doc_ids)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_logits_and_grads(a, b, impls=("eager", "sdpa")):
    """torch.equal logits and gradients of two models, on each path, with and without documents."""
    idx, doc_ids = batch(T=24)
    for impl in impls:
        for docs in (None, doc_ids):
            (la, ga), (lb, gb) = logits_and_grads(a, impl, idx, docs), logits_and_grads(b, impl, idx, docs)
            assert torch.equal(la, lb), impl
            assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga), impl


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("linear", 4.0)])
def test_rope_fraction_one_is_whole_rope_bit_for_bit(scaling, factor, monkeypatch):
    """rope_fraction = 1.0 is the RoPE every run and checkpoint before partial RoPE computed: the same logits
    and gradients, bit for bit, as whole-width RoPE written here with model.py's own frequency helper
    (every pair at theta^(-2i/d), divided by s under linear scaling)."""
    kw = dict(pe="rope", rope_scaling=scaling, rope_factor=factor, rope_original_context=8)
    model = tiny_model(rope_fraction=1.0, **kw)
    whole = tiny_model(**kw)

    def whole_rotation(positions, cfg, length=None):
        inv_freq = model_module.inverse_frequencies(cfg.head_dim, cfg.rope_theta, positions.device) / factor
        angles = positions.to(torch.float64)[..., None] * inv_freq
        return angles.cos().float(), angles.sin().float()

    monkeypatch.setattr(whole, "rotation", whole_rotation)
    assert_same_logits_and_grads(model, whole)


def test_rope_fraction_zero_is_nope():
    """No pair turns: the model is NoPE with the same weights, bit for bit (logits and gradients)."""
    partial = tiny_model(pe="rope", rope_fraction=0.0)
    nope = tiny_model(pe="nope")
    nope.load_state_dict(partial.state_dict())
    assert_same_logits_and_grads(partial, nope)


@pytest.mark.parametrize("pe,ssmax", [(pe, s) for pe in PE_CHOICES for s in (False, True)])
def test_causality(pe, ssmax):
    model = tiny_model(pe=pe, ssmax=ssmax)
    idx, _ = batch(B=1)
    changed = idx.clone()
    changed[0, 25:] = (changed[0, 25:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :25], b[:, :25], atol=1e-6, rtol=1e-5)
    assert (a[:, 25:] - b[:, 25:]).abs().max() > 1e-4


@pytest.mark.parametrize("pe,ssmax", [(pe, s) for pe in PE_CHOICES for s in (False, True)])
def test_packed_documents_equal_separate_documents(pe, ssmax):
    """Document isolation: a document's logits inside a packed row equal the logits of the document on
    its own (so changing another document changes nothing, and SSMax counts only in-document keys)."""
    model = tiny_model(pe=pe, ssmax=ssmax)
    idx, doc_ids = batch(B=1)
    with torch.no_grad():
        packed = model(idx, doc_ids=doc_ids)[0]
        for d in doc_ids.unique():
            cols = (doc_ids[0] == d).nonzero().flatten()
            alone = model(idx[:, cols])[0]
            torch.testing.assert_close(packed[:, cols], alone, atol=1e-5, rtol=1e-4)
        other = idx.clone()
        other[doc_ids == 1] = (other[doc_ids == 1] + 3) % VOCAB
        changed = model(other, doc_ids=doc_ids)[0]
    keep = doc_ids[0] != 1
    torch.testing.assert_close(changed[:, keep], packed[:, keep], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pe,ssmax,per_layer,kv", [("bam", True, True, 0), ("bam", False, False, 2),
                                                  ("rope", False, True, 2), ("sinusoidal", True, True, 0)])
def test_parameter_count_matches_formula(pe, ssmax, per_layer, kv):
    cfg = tiny_config(pe, ssmax=ssmax, bam_per_layer=per_layer, n_kv_head=kv, bam_train_loc=True)
    d, L, H, V, hidden = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size, 2 * cfg.n_embd
    kv_width = (kv or H) * (d // H)
    per_block = d * d + 2 * d * kv_width + d * d + 3 * d * hidden + 2 * d  # q,k,v,o; SwiGLU; two norms
    expected = 2 * V * d + L * per_block + d  # embedding + untied head + blocks + final norm
    if pe == "bam":
        expected += 3 * H * (L if per_layer else 1)  # shape, log-scale, location
    if ssmax:
        expected += H * L
    assert Transformer(cfg).num_params() == expected


def test_paper_prior_parameter_count():
    """384 trainable prior parameters for the 12-layer, 16-head model (docs/paper.md §2)."""
    model = Transformer(ModelConfig.preset("121m", vocab_size=128, n_embd=64, pe="bam"))
    trainable = sum(p.numel() for prior in model.priors for p in prior.parameters() if p.requires_grad)
    assert trainable == 2 * 16 * 12 == 384


def test_sinusoidal_table_is_added_at_the_token_embeddings_scale():
    """As in the official code (unit table on N(0, 1) embeddings): about 0.7 : 1 at init, not 35 : 1."""
    model = tiny_model(pe="sinusoidal", n_embd=64)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
    idx, _ = batch(B=2, T=16)
    with torch.no_grad():
        model(idx)
        tokens = model.tok_emb(idx)
    ratio = (seen["x"] - tokens).pow(2).mean().sqrt() / tokens.pow(2).mean().sqrt()
    assert 0.5 < ratio < 1.0, ratio


def test_sinusoidal_table_is_vaswanis_formula_at_the_position_in_each_document():
    """PE(p, 2i) = sin(p / base^(2i/d)) and PE(p, 2i+1) = cos(p / base^(2i/d)) (Vaswani et al. 2017, 3.5),
    written out here one entry at a time, at the token embeddings' scale, p counted from each document's start."""
    model = tiny_model(pe="sinusoidal", n_embd=64)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
    idx, doc_ids = batch(B=2, T=16)
    with torch.no_grad():
        model(idx, doc_ids=doc_ids)
        added = seen["x"] - model.tok_emb(idx)
    cfg, expected = model.config, torch.zeros(2, 16, 64, dtype=torch.float64)
    for b in range(2):
        for t in range(16):
            p = t - doc_ids[b].tolist().index(doc_ids[b, t].item())
            for i in range(32):
                angle = p / cfg.sinusoidal_base ** (2 * i / 64)
                expected[b, t, 2 * i], expected[b, t, 2 * i + 1] = math.sin(angle), math.cos(angle)
    torch.testing.assert_close(added, (cfg.init_std * expected).float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pe,ssmax,kv,settings", [
    ("bam", True, 0, {}), ("rope", False, 2, {}), ("sinusoidal", False, 0, {}), ("alibi", True, 0, {}),
    ("nope", False, 0, {}), ("fox", True, 2, {}), ("fire", False, 2, {}), ("rope", True, 0, {"rope_fraction": 0.5}),
    ("rope", False, 2, {"rope_fraction": 0.25, "rope_scaling": "yarn", "rope_factor": 4.0}),
    ("bam", False, 2, ALL_AT_ONCE)])
def test_kv_cache_generation_equals_full_recompute(pe, ssmax, kv, settings):
    generated_equals_recomputed(tiny_model(pe=pe, ssmax=ssmax, n_kv_head=kv, **settings))


def test_sampling_with_top_k_stays_in_top_k():
    model = tiny_model(pe="bam")
    prompt, _ = batch(B=1, T=5)
    g = torch.Generator().manual_seed(0)
    out = model.generate(prompt, max_new_tokens=1, temperature=1.0, top_k=3, generator=g)
    top3 = model(prompt)[0][0, -1].topk(3).indices
    assert out[0, -1] in top3


@pytest.mark.parametrize("impl", [pytest.param("flex", marks=pytest.mark.slow), "sdpa"])
def test_logits_far_past_block_size_are_finite(impl):
    model = tiny_model(pe="bam", ssmax=True)
    with torch.no_grad():
        model.priors[0].shape[:2] = torch.tensor([-0.8, -2.0])  # anti-local heads
        idx = torch.randint(0, VOCAB, (1, 64 * model.config.block_size))
        model.config.attn_impl = impl
        logits = model(idx, last_k=4)[0]
    assert logits.shape == (1, 4, VOCAB) and torch.isfinite(logits).all()


def test_last_k_equals_slice_of_full_logits():
    model = tiny_model(pe="bam", ssmax=True)
    idx, doc_ids = batch()
    with torch.no_grad():
        full = model(idx, doc_ids=doc_ids)[0]
        last = model(idx, doc_ids=doc_ids, last_k=3)[0]
    torch.testing.assert_close(last, full[:, -3:])


def test_sparse_targets_give_the_dense_loss_and_gradients():
    model = tiny_model(pe="bam", ssmax=True)
    idx, doc_ids = batch()
    targets = torch.full_like(idx, -1)
    targets[0, 5], targets[1, -1], targets[1, 7] = 3, 11, 2
    grads = []
    for sparse in (False, True):
        model.zero_grad()
        logits, loss = model(idx, targets, doc_ids=doc_ids, sparse_targets=sparse)
        loss.backward()
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
        if sparse:
            assert logits.shape == (3, VOCAB)
        else:
            dense_loss = loss
    torch.testing.assert_close(loss, dense_loss)
    for dense, sparse in zip(*grads):
        torch.testing.assert_close(sparse, dense)
    # A batch without a single target: a zero loss, not a NaN, and backward still works.
    _, loss = model(idx, torch.full_like(idx, -1), doc_ids=doc_ids, sparse_targets=True)
    loss.backward()
    assert loss.item() == 0


@pytest.mark.slow
def test_gqa_matches_across_implementations():
    model = tiny_model(pe="bam", ssmax=True, n_kv_head=2)
    idx, doc_ids = batch()
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        torch.testing.assert_close(logits_with(model, "sdpa", idx, doc_ids), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits_with(model, "flex", idx, doc_ids), ref, atol=2e-5, rtol=1e-4)


def test_shared_prior_has_one_set_of_parameters():
    model = Transformer(tiny_config("bam", bam_per_layer=False))
    assert len(model.priors) == 1
    assert model.prior_summary()["bam_shape"] == [[1.0] * 4]


def test_optimizer_groups_cover_every_trainable_parameter_once():
    model = Transformer(tiny_config("bam", ssmax=True))
    groups = {g["name"]: g for g in model.optim_groups(0.1)}
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert groups["decay"]["weight_decay"] == 0.1
    assert groups["prior"]["weight_decay"] == groups["no_decay"]["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in groups["decay"]["params"])
    assert len(groups["prior"]["params"]) == 2 * 2 + 2  # shape + log-scale per layer, SSMax per layer


def test_load_model_from_file_and_run_dir(tmp_path):
    model = tiny_model(pe="bam", ssmax=True)
    (tmp_path / "checkpoints").mkdir()
    save_model(model, tmp_path / "checkpoints" / "step_00000010.pt")
    idx, _ = batch()
    for path in (tmp_path / "checkpoints" / "step_00000010.pt", tmp_path):
        loaded = load_model(str(path), attn_impl="eager")
        assert loaded.config.attn_impl == "eager"
        with torch.no_grad():
            torch.testing.assert_close(loaded(idx)[0], model(idx)[0])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_model(str(tmp_path / "nothing"))


@pytest.mark.parametrize("kw,match", [
    (dict(pe="xpos"), "allowed: " + ", ".join(PE_CHOICES)),
    (dict(attn_impl="flash"), "allowed: auto, flex, sdpa, eager"),
    (dict(n_head=5), "must divide n_embd"),
    (dict(n_kv_head=3), "must divide n_head"),
    (dict(bam_init="zeros"), "allowed: alibi, uniform"),
    (dict(flex_prior="fast"), "unknown flex_prior 'fast'; allowed: table, formula"),
])
def test_bad_config_names_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kw)


def test_bad_doc_ids_shape():
    model = tiny_model()
    idx, doc_ids = batch()
    with pytest.raises(ValueError, match="doc_ids must have the shape of idx"):
        model(idx, doc_ids=doc_ids[:, :-1])
    with pytest.raises(ValueError, match="non-decreasing"):
        model(idx, doc_ids=doc_ids.flip(1))


def test_flex_training_on_cpu_is_a_clear_error():
    model = tiny_model(pe="bam", attn_impl="flex")
    idx, _ = batch()
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        model(idx, torch.roll(idx, -1, 1))


@pytest.mark.parametrize("T", [5, 128, 200, 300, 1000])
def test_causal_block_mask_equals_create_block_mask(T):
    from torch.nn.attention.flex_attention import create_block_mask

    from model import causal_block_mask
    direct = causal_block_mask(T, "cpu")
    reference = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cpu")
    assert torch.equal(direct.to_dense(), reference.to_dense())


@pytest.mark.slow
def test_flex_matches_eager_across_partial_blocks():
    model = tiny_model(pe="bam", ssmax=True)
    idx = torch.randint(0, VOCAB, (1, 300))  # two full 128-token blocks and a partial one
    with torch.no_grad():
        torch.testing.assert_close(logits_with(model, "flex", idx), logits_with(model, "eager", idx),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pe", PE_CHOICES)
def test_eager_attention_stays_fp32_under_bf16_autocast(pe, monkeypatch):
    """eager is the reference the other paths are held to, and a GPU runs under bf16 autocast, which would round
    q.k (and the weights' product with v) to 8 bits: from the same inputs it computes what it computes in fp32."""
    model = tiny_model(pe=pe, ssmax=True, attn_impl="eager")
    calls = []
    eager = model_module.ATTENTION["eager"]
    monkeypatch.setitem(model_module.ATTENTION, "eager", lambda *args: calls.append(args) or eager(*args))
    idx, doc_ids = batch()
    with torch.no_grad():
        model(idx, doc_ids=doc_ids)
    plain = eager(*calls[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = eager(*calls[-1])
    assert torch.equal(under_autocast, plain)
