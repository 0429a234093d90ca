"""Each encoding of model.ENCODINGS but T5, FIRE and FoX (test_t5_fire_fox.py) against its formula written out
independently here: BAM's Generalized-Gaussian prior (docs/paper.md §2) and what it reduces to (ALiBi at its
init, NoPE), ALiBi's slopes, KERPLE's kernels and their bounds, RoPE's turn (whole and partial), the sinusoidal
table; and the registry: every encoding registered once, named by its family."""

import math

import pytest
import torch

import model as model_module
from model import ENCODINGS, PE_CHOICES, PRIORS, ModelConfig, Transformer, alibi_slopes, apply_rope, ggd_bias
from tiny_models import batch, tiny_config, tiny_model


def test_ggd_bias_is_the_papers_formula():
    """Against docs/paper.md §2 written out independently: -exp(a) * (|d - mu| + eps) ** b, mu = e^l - e^-l."""
    dist = torch.arange(0, 3000, 7, dtype=torch.float64)
    for b, a, l in [(1.0, -2.0, 0.0), (0.0, 0.5, 0.0), (-0.6, 0.1, 0.0), (2.3, -5.0, 0.2), (-1.7, 1.0, -0.1)]:
        mu = math.exp(l) - math.exp(-l)
        expected = -math.exp(a) * ((dist - mu).abs() + 1e-5) ** b
        t = lambda x: torch.tensor([x], dtype=torch.float64)
        got = ggd_bias(dist, 0, t(b), t(a), t(l))
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=0)


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


def test_alibi_slopes():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (ALiBi's reference code)
    s16 = [2.0 ** (-(i + 1) / 2) for i in range(16)]
    assert alibi_slopes(12) == pytest.approx(alibi_slopes(8) + s16[0::2][:4])


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


def test_every_prior_is_registered_once_and_builds_its_layers():
    for name, enc in PRIORS.items():
        model = Transformer(tiny_config(name, n_layer=3))
        assert isinstance(model.priors[0], enc) and len(model.priors) in (1, 3), name
        assert set(model.prior_summary()) - {"ssmax_scale"}, name  # something per head to log
    assert set(PRIORS) <= set(PE_CHOICES) == set(ENCODINGS)


def test_every_encoding_names_the_family_the_report_groups_it_by():
    from model import ENCODINGS

    expected = {"nope": "baselines", "sinusoidal": "baselines", "rope": "RoPE", "alibi": "fixed and kernel priors",
                "kerple_log": "fixed and kernel priors", "kerple_power": "fixed and kernel priors", "bam": "BAM",
                "t5": "learnable-bias rivals", "fire": "learnable-bias rivals", "fox": "learnable-bias rivals"}
    assert {name: enc.family for name, enc in ENCODINGS.items()} == expected
    assert [name for name, enc in ENCODINGS.items() if not getattr(enc, "DISTANCE_ONLY", True)] == ["fire", "fox"]
