"""The learnable-bias rivals of BAM (model.py: T5Prior, FIREPrior, FoXPrior): each formula against a loop over
i, j written out here from its paper, and what the widened prior contract must keep (token features that
stay inside their document, a window, a KV cache that equals full recomputation). Every test of
test_attention_paths.py and test_forward.py parametrised over model.PE_CHOICES (flex == sdpa == eager, sdpa == eager
gradients, causality, packed documents) and tests/test_export_hf.py's export cases cover these encodings as well."""

import math

import pytest
import torch

from model import (KVCache, ModelConfig, Transformer, fire_bias, fire_kernel_bias, fire_mlp, fire_piecewise,
                   fire_segments, fox_bias, positions_in_documents, t5_bias, t5_bucket)
from tiny_models import VOCAB, batch, logits_with, tiny_config, tiny_model

RIVALS = ("t5", "fire", "fox")


def t5_bucket_loop(d, num_buckets=32, max_distance=128):
    """Raffel et al.'s causal bucket of distance d = i - j, one integer at a time."""
    n = max(d, 0)
    exact = num_buckets // 2
    if n < exact:
        return n
    return min(num_buckets - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)))


def test_t5_buckets_are_the_papers_and_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    dist = torch.arange(-5, 3000)
    prior = Transformer(tiny_config("t5")).priors[0]
    table, max_distance = prior.tensors()
    got = t5_bias(dist.float(), 1, table, max_distance)
    expected = torch.stack([table[1, t5_bucket_loop(int(d))] for d in dist])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    library = T5Attention._relative_position_bucket(-dist, bidirectional=False, num_buckets=32, max_distance=128)
    torch.testing.assert_close(got, table[1, library], rtol=0, atol=0)
    assert len({t5_bucket_loop(d) for d in range(200)}) == 32  # every bucket reached within 128 and beyond


# (num_buckets, max_distance) settings where adding the exact buckets' offset before flooring (in fp32) put a
# distance one bucket higher than transformers, which truncates the log-spaced part first
T5_ROUNDING_CASES = ((42, 8192), (28, 10000), (40, 32768), (50, 65536), (70, 10000), (84, 16384), (92, 8192),
                     (100, 4096), (128, 65536))


def t5_scan_settings():
    """A grid of settings ModelConfig accepts (even num_buckets, max_distance > num_buckets / 2), with the
    default (32, 128) and the cases that once differed."""
    grid = set(T5_ROUNDING_CASES) | {(32, 128)}
    for nb in list(range(2, 66, 2)) + [96, 128]:
        for md in (nb // 2 + 1, nb, 100, 128, 1000, 1024, 8192, 10000, 32768, 65536):
            if md > nb // 2:
                grid.add((nb, md))
    return sorted(grid)


def t5_scan_distances(nb, md):
    """0 .. 3 x max_distance, each bucket's boundary (the real distance where the log-spaced part reaches an
    integer) and its neighbours, and distances far past max_distance."""
    exact = nb // 2
    edges = [round(exact * (md / exact) ** ((b - exact) / (nb - exact))) + k
             for b in range(exact, nb + 1) for k in (-1, 0, 1)]
    far = [4 * md, 2 ** 20, 2 ** 24 - 1, 2 ** 24]
    return torch.cat([torch.arange(3 * md + 1), torch.tensor(edges + far)]).clamp(min=0)


def test_t5_buckets_equal_transformers_over_a_scan_of_settings():
    """The bucket of every distance is transformers' T5Attention._relative_position_bucket's (causal:
    relative_position = memory - query = -(i - j)), exactly, for each setting of the grid."""
    from transformers.models.t5.modeling_t5 import T5Attention

    settings = t5_scan_settings()
    assert len(settings) > 300
    for nb, md in settings:
        ModelConfig(pe="t5", t5_num_buckets=nb, t5_max_distance=md)  # a setting the config accepts
        dist = t5_scan_distances(nb, md)
        ours = t5_bucket(dist.float(), nb, torch.tensor(float(md)))
        theirs = T5Attention._relative_position_bucket(-dist, bidirectional=False, num_buckets=nb, max_distance=md)
        wrong = (ours != theirs).nonzero().flatten()
        assert not len(wrong), (f"(num_buckets {nb}, max_distance {md}): distances {dist[wrong][:5].tolist()} in "
                                f"buckets {ours[wrong][:5].tolist()}, transformers {theirs[wrong][:5].tolist()}")
    # the case that was reported: 21 + 18.999998 rounds to 40.0 in fp32; transformers truncates to 18 first
    assert t5_bucket(torch.tensor(4641.0), 42, torch.tensor(8192.0)).item() == 39


def test_t5_bucket_through_the_model_matches_transformers_at_a_rounding_case():
    """The prior's own tensors (the max_distance buffer) give transformers' buckets, dense and per scalar as
    FlexAttention's score_mod calls the function."""
    from transformers.models.t5.modeling_t5 import T5Attention

    prior = Transformer(tiny_config("t5", t5_num_buckets=42, t5_max_distance=8192)).priors[0]
    table, max_distance = prior.tensors()
    dist = torch.arange(4600, 4700)
    theirs = T5Attention._relative_position_bucket(-dist, bidirectional=False, num_buckets=42, max_distance=8192)
    torch.testing.assert_close(t5_bias(dist.float(), 1, table, max_distance), table[1, theirs], rtol=0, atol=0)
    scalars = torch.stack([t5_bias(d.float(), torch.tensor(1), table, max_distance) for d in dist])
    torch.testing.assert_close(scalars, table[1, theirs], rtol=0, atol=0)


def test_fire_bias_is_the_papers_formula():
    """f(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1), f an MLP 1 -> W -> H with a ReLU (no output bias:
    softmax ignores a per-head constant)."""
    torch.manual_seed(0)
    prior = tiny_model(pe="fire", n_layer=1).priors[0].double()
    log_c, log_L, w1, b1, w2 = (t.detach() for t in prior.tensors()[:5])  # the MLP's (fire_segments: below)
    c, L = math.exp(log_c), math.exp(log_L)
    T, H = 40, w2.shape[0]
    with torch.no_grad():
        prior.log_threshold.fill_(math.log(17.0))  # a threshold inside the sequence: both branches of max(L, i)
    log_L, L = prior.log_threshold.detach(), 17.0
    i, j = torch.arange(T, dtype=torch.float64)[:, None], torch.arange(T, dtype=torch.float64)[None, :]
    got = fire_bias(i - j, torch.arange(H).view(H, 1, 1), (i,), (j,), log_c, log_L, w1, b1, w2)
    for qi in range(T):
        for kj in range(qi + 1):
            x = math.log(c * (qi - kj) + 1) / math.log(c * max(L, qi) + 1)
            hidden = torch.relu(w1 * x + b1)
            torch.testing.assert_close(got[:, qi, kj], w2 @ hidden, rtol=1e-12, atol=1e-12)


def fire_weights(dtype):
    """A FIRE MLP with the corner cases of its breakpoints: a flat unit on and one off, two units that switch at
    the same input, rising and falling units."""
    g = torch.Generator().manual_seed(0)
    W, H = 12, 3
    w1, b1 = torch.randn(W, generator=g, dtype=dtype), torch.randn(W, generator=g, dtype=dtype)
    w1[0], b1[0], w1[1], b1[1] = 0.0, 0.7, 0.0, -0.4
    w1[3], b1[3] = 2 * w1[2], 2 * b1[2]
    w2 = torch.randn(H, W, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (w1, b1, w2)]


def fire_forms(x, w1, b1, w2, upstream=None):
    """(H, N) biases of the inputs x by fire_mlp (the dense paths' form) and by fire_piecewise (what flex's
    score_mod evaluates in training), and, given `upstream`, each one's gradients in (w1, b1, w2)."""
    head = torch.arange(w2.shape[0])[:, None]
    forms = fire_mlp(x, None, w1, b1, w2).T, fire_piecewise(x, head, *fire_segments(w1, b1, w2))
    if upstream is None:
        return forms
    return [torch.autograd.grad((bias * upstream).sum(), (w1, b1, w2)) for bias in forms]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
def test_fires_piecewise_form_equals_its_mlp_in_values_and_gradients(dtype, tolerance):
    """The same function of x, breakpoints included, and the same gradients in every weight, to rounding, away
    from the breakpoints (where ReLU's derivative is a convention: relu'(0) = 0, and the piecewise form may take
    either side's)."""
    w1, b1, w2 = fire_weights(dtype)
    breaks = (-b1 / w1).detach()[2:]
    x = torch.cat([torch.linspace(-4, 4, 1601, dtype=dtype), breaks + 1e-3, breaks - 1e-3])
    mlp, piecewise = fire_forms(torch.cat([x, breaks]), w1, b1, w2)
    torch.testing.assert_close(piecewise, mlp, rtol=0, atol=tolerance * float(mlp.detach().abs().max()))
    upstream = torch.randn(w2.shape[0], len(x), generator=torch.Generator().manual_seed(1), dtype=dtype)
    for got, expected in zip(*fire_forms(x, w1, b1, w2, upstream)[::-1]):
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * float(expected.abs().max()))


def test_fires_kernel_form_equals_its_formula_in_values_and_gradients():
    """What flex's score_mod reads (fire_kernel_bias: psi(d) from a table by distance and 1 / psi(max(L, i)) a
    token feature, so that no score reads c or L) against fire_bias: in training (the MLP's piecewise form, which
    broadcasts, on the whole grid) the same biases and the same gradient in c, L and the MLP's weights, which reach
    c and L through the tables by ordinary autograd (issue 57 point 7); in inference (the MLP, one score at a time,
    as in the kernel) the same biases at sampled scores."""
    torch.manual_seed(0)
    prior = tiny_model(pe="fire", n_layer=1, fire_mlp_width=8).priors[0]
    with torch.no_grad():
        prior.log_threshold.fill_(math.log(17.0))  # a threshold inside the sequence: both branches of max(L, i)
    T, H = 40, prior.w2.shape[0]
    pos = torch.cat([torch.arange(25), torch.arange(15)])[None]  # two documents
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).float()
    head = torch.arange(H).view(H, 1, 1)
    features = tuple(t[0, 0][:, None] for t in prior.token_features(None, pos))  # at the queries, (T, 1) each
    formula = fire_bias(dist, head, features, features, *prior.tensors())
    kernel = fire_kernel_bias(dist, head, features, features, *prior.kernel_tensors(T, torch.device("cpu")))
    torch.testing.assert_close(kernel, formula, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(H, T, T, generator=torch.Generator().manual_seed(1)) * (dist >= 0)
    params = {"log_c": prior.log_c, "log_threshold": prior.log_threshold, "w1": prior.w1, "b1": prior.b1,
              "w2": prior.w2}
    want = torch.autograd.grad((formula * upstream).sum(), list(params.values()))
    got = torch.autograd.grad((kernel * upstream).sum(), list(params.values()))
    for name, g, w in zip(params, got, want):
        assert w.abs().sum() > 0, name
        # sums over 6,400 scores in another order (the MLP as a matmul, or by segments): fp32 rounding, relative
        # to the largest gradient
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=name)
    with torch.no_grad():  # inference: the MLP itself, evaluated per score
        features = prior.token_features(None, pos)
        tensors = prior.kernel_tensors(T, torch.device("cpu"))
        for q, k, h in torch.randint(0, T, (60, 3)).tolist():
            q, k, h = max(q, k), min(q, k), h % H
            one = fire_kernel_bias(torch.tensor(float(q - k)), torch.tensor(h), tuple(t[0, 0, q] for t in features),
                                   None, *tensors)
            torch.testing.assert_close(one, formula[h, q, k].detach(), rtol=1e-5, atol=1e-6)


def test_fire_reads_a_checkpoint_whose_scalars_are_0d():
    """Before log c and log L were shape (1,) (FSDP2 and flex's backward take no 0-d parameter) they were 0-d;
    such a state dict still loads, to the same values."""
    model = tiny_model(pe="fire")
    state = {k: v.reshape(()) if k.endswith(("log_c", "log_threshold")) else v for k, v in model.state_dict().items()}
    assert state["priors.0.log_c"].dim() == 0
    fresh = Transformer(model.config)
    fresh.load_state_dict(state)
    assert fresh.priors[0].log_c.shape == (1,)
    assert all(torch.equal(v, state[k].reshape(v.shape)) for k, v in fresh.state_dict().items())


def test_fire_resumes_an_optimizer_whose_state_is_0d():
    """The optimizer state of such a checkpoint is 0-d too: train.py gives it the parameter's shape, or the first
    step after the resume would fail (AdamW: "output with shape [] doesn't match the broadcast shape [1]")."""
    import train

    model = tiny_model(pe="fire", n_layer=1)
    optimizer = torch.optim.AdamW(model.parameters())
    idx, doc_ids = batch()
    model(idx, targets=idx)[1].backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        state.update({k: v.reshape(()) for k, v in state.items() if k != "step" and v.numel() == 1})
    resumed = torch.optim.AdamW(model.parameters())
    resumed.load_state_dict(saved)
    train.reshape_older_state(resumed)
    resumed.step()
    assert resumed.state[model.priors[0].log_c]["exp_avg"].shape == (1,)


def test_fox_bias_is_the_sum_of_log_forget_gates_inside_the_document():
    """Bias of (i, j) = sum over l = j+1..i of log sigmoid(w_h . x_l + b_h), with i, j in one document."""
    torch.manual_seed(0)
    prior = tiny_model(pe="fox", n_layer=1).priors[0]
    idx, doc_ids = batch(B=2, T=30)
    x = torch.randn(2, 30, prior.gate.in_features)
    c, c_keys = prior.token_features(x, positions_in_documents(doc_ids))
    assert torch.equal(c, c_keys) and c_keys.data_ptr() != c.data_ptr()  # a copy: score_mod indexes each once
    H = c.shape[1]
    got = fox_bias(None, None, (c[..., :, None], None), (None, c_keys[..., None, :]))
    log_f = torch.nn.functional.logsigmoid(x.double() @ prior.gate.weight.double().T + prior.gate.bias.double())
    for b in range(2):
        for i in range(30):
            for j in range(i + 1):
                if doc_ids[b, i] != doc_ids[b, j]:
                    continue
                expected = log_f[b, j + 1:i + 1].sum(dim=0) if i > j else torch.zeros(H, dtype=torch.float64)
                torch.testing.assert_close(got[b, :, i, j].double(), expected, rtol=1e-5, atol=1e-5)


def test_fox_gates_of_a_document_do_not_depend_on_the_documents_before_it():
    """After 3000 tokens of strongly forgetting documents (log f ~ -8 each: a running sum near -24000, where
    fp32 steps are 0.002 apart), the last document's cumulative gates are those it has alone, to fp32 rounding."""
    torch.manual_seed(0)
    prior = tiny_model(pe="fox", n_layer=1).priors[0]
    with torch.no_grad():
        prior.gate.bias.fill_(-8.0)
    x = torch.randn(1, 3040, prior.gate.in_features)
    doc_ids = torch.tensor([[0] * 1000 + [1] * 2000 + [2] * 40])
    packed, _ = prior.token_features(x, positions_in_documents(doc_ids))
    alone, _ = prior.token_features(x[:, -40:], torch.arange(40)[None])
    torch.testing.assert_close(packed[..., -40:], alone, rtol=1e-6, atol=1e-5)


def test_fox_gate_init_bias_starts_the_gates_open_and_its_default_is_the_reference_init():
    """fox_gate_init_bias b sets every gate's bias to b, so the gates start near sigmoid(b) (5: ~0.993); it
    takes no random numbers, so every other weight is the same for a seed, and the default 0 is the reference
    code's (biases exactly 0, gates near 1/2): a default model's weights are what they were before the field."""
    torch.manual_seed(0)
    default = Transformer(tiny_config("fox", ssmax=True))
    torch.manual_seed(0)
    opened = Transformer(tiny_config("fox", ssmax=True, fox_gate_init_bias=5.0))
    assert ModelConfig().fox_gate_init_bias == 0.0
    a, b = default.state_dict(), opened.state_dict()
    biases = {k for k in a if k.endswith("gate.bias") and k.startswith("priors.")}
    assert len(biases) == 2 and a.keys() == b.keys()
    for k in a:
        if k not in biases:
            assert torch.equal(a[k], b[k]), k
    for k in biases:
        assert torch.equal(a[k], torch.zeros(4)) and torch.equal(b[k], torch.full((4,), 5.0))
    x = torch.nn.functional.rms_norm(torch.randn(2, 50, 32), (32,))  # a layer's normalised input
    open_gates, half_gates = opened.priors[0].log_gates(x).exp(), default.priors[0].log_gates(x).exp()
    assert abs(open_gates.median().item() - 0.9933) < 2e-3 and open_gates.min() > 0.98
    assert abs(half_gates.median().item() - 0.5) < 0.05
    with pytest.raises(ValueError, match="fox_gate_init_bias"):
        ModelConfig(pe="fox", fox_gate_init_bias=float("inf"))


def test_fox_gate_init_bias_round_trips_through_a_checkpoint(tmp_path):
    from bam.checkpoint import load_model, save_model

    torch.manual_seed(0)
    model = Transformer(tiny_config("fox", ssmax=True, fox_gate_init_bias=5.0))
    save_model(model, str(tmp_path / "m.pt"))
    back = load_model(str(tmp_path / "m.pt"))
    assert back.config == model.config and back.config.fox_gate_init_bias == 5.0
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    idx, doc_ids = batch(B=2, T=16)
    torch.testing.assert_close(back(idx, doc_ids=doc_ids)[0], model(idx, doc_ids=doc_ids)[0], rtol=0, atol=0)


def cached_logits(model, seq, prompt_len, window_steps=None):
    """The logits of every position from prompt_len on, computed one token at a time with a KV cache."""
    cache = KVCache(model.config, seq.shape[0], seq.shape[1], "cpu", torch.float32)
    out = [model(seq[:, :prompt_len], kv_cache=cache)[0][:, -1:]]
    for t in range(prompt_len, seq.shape[1] - 1):
        out.append(model(seq[:, t:t + 1], kv_cache=cache, start_pos=t)[0])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("pe", RIVALS)
@pytest.mark.parametrize("ssmax,window", [(False, 0), (True, 0), (True, 6)])
def test_cached_decoding_equals_full_recomputation(pe, ssmax, window):
    """Logits, not only tokens: FoX continues its cumulative gates from the cache, FIRE needs each query's
    absolute position, T5 its distance; with a window the cache keeps only the last W - 1 positions."""
    model = tiny_model(pe=pe, ssmax=ssmax, attn_window=window).eval()
    seq, _ = batch(B=2, T=24)
    with torch.no_grad():
        full = model(seq)[0][:, 9:-1]
        torch.testing.assert_close(cached_logits(model, seq, 10), full, atol=2e-5, rtol=1e-4)
        out = model.generate(seq[:, :10], max_new_tokens=8, temperature=0)
        ref = seq[:, :10]
        for _ in range(8):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("pe", RIVALS)
def test_window_on_every_path(pe):
    """flex == sdpa == eager with a window cutting through documents; that the windowed eager path is the
    crop of each query's last W keys is test_sliding_window.py's crop reference (T5, FoX: functions of the keys
    inside the window; FIRE's query position counts from the document's start, not the window's)."""
    model = tiny_model(pe=pe, ssmax=True, attn_window=7)
    idx, doc_ids = batch(T=40)
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        for impl in ("sdpa", "flex"):
            torch.testing.assert_close(logits_with(model, impl, idx, doc_ids), ref, atol=2e-5, rtol=1e-4)
        model.config.attn_window = 0
        assert not torch.allclose(logits_with(model, "eager", idx, doc_ids), ref, atol=1e-4)


def test_fire_depends_on_the_query_position_and_t5_fox_do_not_on_a_shift():
    """FIRE's bias changes when both positions move by the same amount (past its threshold L); T5's does not."""
    head = torch.arange(4).view(4, 1, 1)
    fire = tiny_model(pe="fire", n_layer=1).priors[0]
    with torch.no_grad():
        fire.log_threshold.fill_(math.log(4.0))
    i, j = torch.tensor([[10.0]]), torch.tensor([[3.0]])
    near = fire_bias(i - j, head, (i,), (j,), *fire.tensors())
    far = fire_bias(i - j, head, (i + 50,), (j + 50,), *fire.tensors())
    assert (near - far).abs().max() > 1e-3
    t5 = tiny_model(pe="t5", n_layer=1).priors[0]
    assert torch.equal(t5_bias(i - j, head, *t5.tensors()), t5_bias((i + 50) - (j + 50), head, *t5.tensors()))


def test_rival_configs_build_and_their_parameters_train_in_the_prior_group():
    for pe in RIVALS:
        model = Transformer(tiny_config(pe))
        prior_ids = {id(p) for p in model.prior_parameters()}
        assert prior_ids and all(id(p) in prior_ids for prior in model.priors for p in prior.parameters())
        assert type(model.priors[0]).family == "learnable-bias rivals"
    assert len(Transformer(tiny_config("t5", n_layer=3)).priors) == 1  # T5 shares one table across layers
    with pytest.raises(ValueError, match="t5_num_buckets"):
        ModelConfig(pe="t5", t5_num_buckets=31)
    with pytest.raises(ValueError, match="fire_init_c"):
        ModelConfig(pe="fire", fire_init_c=0.0)


@pytest.mark.slow
def test_eval_priors_shows_each_rivals_curves_and_foxs_gates(tmp_path):
    """T5, FIRE: the bias against distance per head (from the prior's own function); FoX: no curve, but the
    quantiles of every head's gates and its memory on validation text, and their plot."""
    import numpy as np

    from bam.data import write_shard
    from eval import priors
    from eval.options import EvalOptions

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_shard(str(data_dir / "demo_val_000000.bin"), np.random.default_rng(0).integers(0, VOCAB, 2000))
    options = EvalOptions(progress=False, verbose=False, out=str(tmp_path / "out"))
    for pe in RIVALS:
        model = tiny_model(pe=pe, n_layer=2).eval()
        if pe == "fox":  # layer 1's gates made constant: f = sigmoid(b_h), memory = -1 / log sigmoid(b_h)
            with torch.no_grad():
                model.priors[1].gate.weight.zero_()
                model.priors[1].gate.bias.copy_(torch.tensor([-1.0, 0.0, 2.0, 5.0]))
        res = priors.evaluate_priors(model, options=options, max_distance=300, data_dir=str(data_dir))
        heads = res["heads"]
        assert len(heads) == 8
        if pe == "fox":
            assert "bias_at" not in heads[0] and (tmp_path / "out" / "priors_gates.png").is_file()
            for h in heads:
                assert 0 < h["gate_p10"] <= h["gate_median"] <= h["gate_p90"] < 1 and h["memory"] > 0
            for h in heads[4:]:
                f = torch.sigmoid(torch.tensor([-1.0, 0.0, 2.0, 5.0], dtype=torch.float64))[h["head"]]
                assert h["gate_median"] == pytest.approx(float(f), rel=1e-5)
                assert h["memory"] == pytest.approx(float(-1 / f.log()), rel=1e-4)
        else:
            head = torch.arange(4).view(4, 1)
            prior = model.priors[0]
            with torch.no_grad():
                expected = prior.distance_curve(torch.tensor([[100.0]]), head)[:, 0]
            for h in heads:
                if h["layer"] == 0:
                    assert h["bias_at"]["100"] == pytest.approx(float(expected[h["head"]]), rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_fox_ssmax_on_flex_compiles_for_a_sweep_of_batch_and_length_on_cpu():
    """An evaluation sweep calls flex at shapes that change batch and length together (passkey: a few prompts
    at one length, then fewer at a longer one). Inductor's C++ flex template (torch 2.11 to 2.15) fails to
    compile FoX + SSMax's second shape once dynamo has made it dynamic (an undeclared `cur_kvSplitSize3` or
    `cur_qSplitSize2`; the 5-digit grid's passkey at 8K tokens): on a CPU that kernel is compiled per shape
    (model._make_flex_kernel). These two shapes, batch 2 then 1, fail to compile without it; 4 x 1,024 then
    2 x 2,048 compiled either way. Flex must also agree with sdpa at both."""
    model = tiny_model(pe="fox", ssmax=True, n_layer=1, n_head=6, n_embd=96, block_size=128).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for B, T in [(2, 128), (1, 256)]:
            idx = torch.randint(0, VOCAB, (B, T))
            flex, sdpa = (logits_with(model, impl, idx, last_k=4) for impl in ("flex", "sdpa"))
            torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)
