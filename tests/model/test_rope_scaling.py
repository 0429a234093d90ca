"""RoPE's context extensions (`rope_scaling`: PI, NTK-aware, dynamic NTK, YaRN), whole and partial
(`rope_fraction`): the frequencies and YaRN's temperature against formulas written out independently here and
against transformers' implementation; a bad setting in one line."""

import math

import pytest
import torch

from model import ENCODINGS, ModelConfig, Transformer, apply_rope, attention_context, rope_frequencies
from tiny_models import VOCAB, tiny_config


FACTORS = [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]

SCALINGS = ["linear", "ntk", "dynamic_ntk", "yarn"]


def rope_cfg(scaling, factor, head_dim=64, theta=500_000.0, context=512, **kw):
    return ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=2 * head_dim, block_size=context,
                       pe="rope", rope_theta=theta, rope_scaling=scaling, rope_factor=factor, **kw)


def expected_inv_freq(scaling, s, d, theta, L0, length, beta_fast=32.0, beta_slow=1.0, fraction=1.0):
    """Partial RoPE (p-RoPE) turns the first fraction of the pairs, r = 2 x their count of the d dimensions, at
    RoPE's frequencies, and a scaling acts on them alone: NTK stretches the slowest turning one by exactly s."""
    r = 2 * round(fraction * d / 2)
    pairs = range(r // 2)
    if scaling == "linear":  # Chen et al. 2023: positions (equivalently frequencies) divided by s
        return [theta ** (-2 * i / d) / s for i in pairs]
    if scaling == "ntk":  # NTK-aware: a larger base, theta * s^(d / (r - 2)), r = d for whole RoPE
        base = theta * s ** (d / (r - 2))
        return [base ** (-2 * i / d) for i in pairs]
    if scaling == "dynamic_ntk":  # transformers / Code Llama: the scale follows the length past L0
        grown = s * length / L0 - (s - 1) if length > L0 else 1.0
        base = theta * grown ** (d / (r - 2))
        return [base ** (-2 * i / d) for i in pairs]
    # YaRN (Peng et al. 2023) as its reference code: dimension where pair i turns `r` times over L0 ...
    def dim_at(turns):
        return d * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = max(math.floor(dim_at(beta_fast)), 0), min(math.ceil(dim_at(beta_slow)), r - 1)
    out = []
    for i in pairs:
        keep = 1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1 below lo (extrapolate), 0 above hi
        freq = theta ** (-2 * i / d)
        out.append(freq * keep + freq / s * (1.0 - keep))
    return out


@pytest.mark.parametrize("fraction", [1.0, 0.25])
@pytest.mark.parametrize("scaling", SCALINGS)
# the last: at a quarter of the pairs YaRN's ramp would run past the turning pairs, which its end is held to
@pytest.mark.parametrize("head_dim,theta,context", [(64, 500_000.0, 512), (48, 10_000.0, 4096), (128, 1e6, 2048),
                                                    (64, 10_000.0, 1024)])
def test_rope_frequencies_match_the_formulas(scaling, head_dim, theta, context, fraction):
    for s in FACTORS:
        cfg = rope_cfg(scaling, s, head_dim, theta, context, rope_fraction=fraction)
        for length in (context // 2, context, 3 * context, int(s * context)):
            inv_freq, factor = rope_frequencies(cfg, length)
            expected = torch.tensor(expected_inv_freq(scaling, s, head_dim, theta, context, length,
                                                      fraction=fraction), dtype=torch.float64)
            torch.testing.assert_close(inv_freq, expected, rtol=1e-12, atol=0)
            assert factor == (0.1 * math.log(s) + 1.0 if scaling == "yarn" else 1.0)
        if scaling != "dynamic_ntk":
            continue
        # dynamic NTK is plain RoPE up to L0, and static NTK once s L / L0 - (s - 1) = s: at L = L0 (2s - 1) / s
        plain_cfg = rope_cfg("none", 1.0, head_dim, theta, context, rope_fraction=fraction)
        plain = rope_frequencies(plain_cfg, context)[0]
        torch.testing.assert_close(rope_frequencies(cfg, context)[0], plain, rtol=0, atol=0)
        static = rope_frequencies(rope_cfg("ntk", s, head_dim, theta, context, rope_fraction=fraction), 1)[0]
        torch.testing.assert_close(rope_frequencies(cfg, context * (2 * s - 1) / s)[0], static, rtol=1e-12, atol=0)


def test_yarn_ramp_keeps_fast_pairs_and_interpolates_slow_ones():
    """The defining property, independent of the ramp's exact shape: pairs turning more than beta_fast
    times over L0 keep their frequency, pairs turning fewer than beta_slow times are divided by s."""
    d, theta, L0, s = 64, 10_000.0, 2048, 16.0
    inv_freq, _ = rope_frequencies(rope_cfg("yarn", s, d, theta, L0), L0)
    plain = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    turns = L0 * plain / (2 * math.pi)
    fast, slow = turns > 32 * 1.5, turns < 1 / 1.5  # a margin for the outward rounding of the ramp's ends
    assert fast.any() and slow.any() and not (fast | slow).all()
    torch.testing.assert_close(inv_freq[fast], plain[fast], rtol=1e-12, atol=0)
    torch.testing.assert_close(inv_freq[slow], plain[slow] / s, rtol=1e-12, atol=0)
    assert bool(((inv_freq <= plain) & (inv_freq >= plain / s)).all())


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("s", FACTORS)
def test_yarn_temperature_scales_the_logits_by_one_over_t(s, fraction):
    """YaRN paper: softmax(q.k / (t sqrt(d))) with sqrt(1/t) = 0.1 ln s + 1, so the logit between q and k
    at the same position (no rotation left) is q.k times (0.1 ln s + 1)^2. Under partial RoPE only the turning
    pairs (dimensions i and i + 8 for i < 8 x fraction) carry it, as transformers' partial rotary models do."""
    cfg = rope_cfg("yarn", s, head_dim=16, rope_fraction=fraction)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    turning = torch.tensor([i % 8 < 8 * fraction for i in range(16)])
    for pos in (0, 7, 5000):
        cos, sin = ENCODINGS["rope"].rotation(torch.tensor([pos]), cfg)
        rotated = (apply_rope(q, cos, sin) * apply_rope(k, cos, sin)).sum()
        expected = (q * k)[..., turning].sum() * (0.1 * math.log(s) + 1) ** 2 + (q * k)[..., ~turning].sum()
        torch.testing.assert_close(rotated, expected, rtol=1e-5, atol=1e-6)


def transformers_inv_freq(scaling, s, d, theta, L0, length, fraction=1.0):
    """The same quantity from transformers' own RoPE initialisation (a second implementation). transformers
    has no static NTK-aware scaling; its dynamic one with factor 1 at length s L0 is exactly that. Its
    partial_rotary_factor computes the frequencies of the first fraction x d dimensions as a RoPE of that
    width: base theta over width r is p-RoPE's theta^(d/r) over width d."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_type, factor, seq_len, max_pos = {
        "linear": ("linear", s, None, L0),
        "ntk": ("dynamic", 1.0, int(s * L0), L0),
        "dynamic_ntk": ("dynamic", s, length, L0),
        "yarn": ("yarn", s, None, int(s * L0)),
    }[scaling]
    scaling_dict = {"rope_type": rope_type, "factor": factor, "partial_rotary_factor": fraction}
    if rope_type == "yarn":
        scaling_dict.update(original_max_position_embeddings=L0, beta_fast=32.0, beta_slow=1.0)
    config = transformers.LlamaConfig(hidden_size=2 * d, num_attention_heads=2, max_position_embeddings=max_pos,
                                      rope_theta=theta, rope_scaling=scaling_dict)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq.double(), attention_factor


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("theta,L0", [(500_000.0, 512), (10.0, 1024)])  # the second: YaRN's ramp ends at the width
def test_rope_frequencies_match_transformers(scaling, fraction, theta, L0):
    """Whole RoPE, and partial RoPE against transformers' partial_rotary_factor under the base that makes the
    two conventions the same frequencies (docs/training.md, "Partial RoPE"): every scaling acts on the
    turning pairs as transformers' does on its rotary width."""
    d = 64
    for s in FACTORS:
        for length in ((L0, 3 * L0) if scaling == "dynamic_ntk" else (L0,)):
            ref, ref_factor = transformers_inv_freq(scaling, s, d, theta, L0, length, fraction)
            cfg = rope_cfg(scaling, s, d, theta ** (1 / fraction), L0, rope_fraction=fraction)
            ours, factor = rope_frequencies(cfg, length)
            torch.testing.assert_close(ours, ref, rtol=2e-6, atol=0, msg=lambda m: f"{scaling} s={s}: {m}")
            assert factor == pytest.approx(ref_factor, rel=1e-12)


def test_dynamic_ntk_follows_the_length_of_the_forward():
    model = Transformer(rope_cfg("dynamic_ntk", 4.0, head_dim=8, context=16, attn_impl="eager"))
    for T in (10, 16, 40):
        ctx = attention_context(model, 0, T, torch.arange(T)[None])
        inv_freq = torch.tensor(expected_inv_freq("dynamic_ntk", 4.0, 8, 500_000.0, 16, T), dtype=torch.float64)
        angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
        torch.testing.assert_close(ctx.rope[0], angles.cos().float())
        torch.testing.assert_close(ctx.rope[1], angles.sin().float())


def test_rope_original_context_defaults_to_block_size():
    assert rope_cfg("linear", 2.0, context=512).rope_context == 512
    assert rope_cfg("linear", 2.0, context=512, rope_original_context=256).rope_context == 256
    a = rope_frequencies(rope_cfg("yarn", 8.0, context=512), 1)[0]
    b = rope_frequencies(rope_cfg("yarn", 8.0, context=64, rope_original_context=512), 1)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw,match", [
    (dict(rope_scaling="xpos"), "allowed: none, linear, ntk, dynamic_ntk, yarn"),
    (dict(rope_scaling="linear", rope_factor=0.5), "rope_factor = 0.5: allowed: a finite number >= 1"),
    (dict(rope_factor=2.0), "no effect with rope_scaling='none'"),
    (dict(pe="bam", rope_scaling="yarn", rope_factor=2.0), "rope_scaling needs a rotary encoding"),
    (dict(rope_scaling="yarn", rope_factor=2.0, yarn_beta_slow=40.0), "0 < yarn_beta_slow < yarn_beta_fast"),
    (dict(rope_original_context=-1), "rope_original_context = -1: allowed: an integer >= 0"),
    (dict(attn_window=-3), "attn_window = -3: allowed: an integer >= 0"),
    (dict(rope_fraction=1.5), r"rope_fraction = 1.5: allowed: a finite number >= 0, <= 1"),
    (dict(rope_fraction=-0.25), r"rope_fraction = -0.25: allowed: a finite number >= 0, <= 1"),
    (dict(rope_fraction=0.3), r"rope_fraction=0.3 turns 1.2 of the 4 pairs of head_dim=8; allowed: a multiple of 1/4"),
    (dict(pe="bam", rope_fraction=0.5), "rope_fraction needs a rotary encoding"),
    (dict(rope_fraction=0.0, rope_scaling="yarn", rope_factor=2.0), "no effect with rope_fraction=0"),
    (dict(rope_fraction=0.25, rope_scaling="ntk", rope_factor=2.0), "ntk' needs more than one turning pair"),
])
def test_bad_baseline_config_names_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{"pe": "rope", **kw})
