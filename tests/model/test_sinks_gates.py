"""Learned attention sinks (ModelConfig.attn_sink) and gated attention (attn_gate), issue 47 point 3: both off
is today's model (its state dict and logits against a reference saved before they existed); the sink is a softmax
with one more term in its denominator and no value, on every path, forward and gradients (its own included),
composed with SSMax and the priors; the gate is the paper's formula; generation with a KV cache equals the full
forward; flex's log-sum-exp form of the sink equals the materialised one, traced forward and backward as a GPU
compiles it.

tests/model/reference/default_models.pt was written by the model.py of commit d531d6e (before these fields existed):
for each case below, `make_model(pe=..., ssmax=...)` of tests/tiny_models.py (today's `tiny_model`, which
since moves the sinks' logits too, after every other draw), its state-dict keys, the sum of its weights
and its logits at the last three positions of `batch(T=24)` with its documents:

    ref[name] = dict(keys=list(sd), logits=model(idx, doc_ids=doc_ids)[0][:, -3:],
                     weights_sum=sum(float(v.double().sum()) for v in sd.values()))
"""

import math
import os

import pytest
import torch

import model as model_module
from model import (PE_CHOICES, AttnContext, BAMPrior, ModelConfig, Transformer, attention_context, dense_mask, ggd_bias,
                   positions_in_documents, ssmax_log_n)
from flex_on_cpu import flex_backward_as_inductor_lowers_it, take_flex, trace_flex_as_a_gpu
from tiny_models import (assert_grads_equal, batch, generated_equals_recomputed, logits_and_grads, logits_with,
                         tiny_config, tiny_model)

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference", "default_models.pt")


def with_sinks_off_init(model, seed=3):
    """Sinks moved off 0, each head its own, so that no case passes for a special value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.sink_logit is not None:
                block.attn.sink_logit.copy_(2 * torch.randn(block.attn.sink_logit.shape, generator=g))
    return model


def sink_gate_model(pe="bam", ssmax=True, **kw):
    return with_sinks_off_init(tiny_model(pe=pe, ssmax=ssmax, **{"attn_sink": True, "attn_gate": True, **kw}))


# -- off is today's model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(torch.load(REFERENCE)))
def test_both_off_is_the_model_before_they_existed(name):
    """Same seed, same weights (every key, nothing added, the random draws in the same order) and the same
    logits as the model.py that had no sink or gate. Bitwise on the machine that wrote the reference; a CPU
    with other vector units may round the last bit of a sum differently, hence the 1e-6."""
    reference = torch.load(REFERENCE)[name]
    pe, ssmax = name.split("+")[0], name.endswith("+ssmax")
    then = dict(pe=pe, ssmax=ssmax, fire_mlp_width=32)  # the reference's FIRE had model.py's default width
    for model in (tiny_model(**then), tiny_model(**then, attn_sink=False, attn_gate=False)):
        state = model.state_dict()
        assert list(state) == reference["keys"]
        assert sum(float(v.double().sum()) for v in state.values()) == pytest.approx(reference["weights_sum"],
                                                                                     rel=1e-12)
        idx, doc_ids = batch(T=24)
        with torch.no_grad():
            logits = model(idx, doc_ids=doc_ids)[0]
        torch.testing.assert_close(logits[:, -3:], reference["logits"], rtol=1e-6, atol=1e-6)


def test_a_sink_adds_one_parameter_and_draws_nothing_from_the_generator():
    """A sink starts at 0 without a random draw: every other weight is the sink-less model's, bitwise; and a sink
    at -inf takes no mass, so that model computes the sink-less one's logits on every path. (Without SSMax: with
    it, a document's first token, whose one key makes log n = 0, gives the sink e^0 whatever its logit, -inf x 0
    being NaN; model.sink_scores.)"""
    initial = {}
    for sink in (False, True):
        torch.manual_seed(0)
        initial[sink] = Transformer(tiny_config(attn_sink=sink)).state_dict()
    extra = set(initial[True]) - set(initial[False])
    assert extra == {f"blocks.{i}.attn.sink_logit" for i in range(2)}
    assert all(torch.equal(initial[True][k], v) for k, v in initial[False].items())
    assert all(torch.equal(initial[True][k], torch.zeros(4)) for k in extra)
    plain, sunk = tiny_model(), tiny_model(attn_sink=True)  # the prior moved off its init, alike in both
    with torch.no_grad():
        for block in sunk.blocks:
            block.attn.sink_logit.fill_(-math.inf)
    idx, doc_ids = batch()
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            torch.testing.assert_close(logits_with(sunk, impl, idx, doc_ids), logits_with(plain, impl, idx, doc_ids),
                                       rtol=1e-6, atol=1e-6)


# -- the sink: a softmax with one more term ---------------------------------------------------------------------


def attention_inputs(ssmax, B=2, T=12, H=4, hd=8, seed=0):
    """Random q, k, v, a BAM prior and SSMax's scales off their inits, the sinks, and the context of a forward
    over two documents per row, as the model builds it."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, hd, generator=g, dtype=torch.float64).float() for _ in range(3))
    doc_ids = torch.tensor([[0] * 5 + [1] * (T - 5), [0] * 8 + [1] * (T - 8)])
    pos = torch.arange(T)
    pos_in_doc = positions_in_documents(doc_ids)
    ctx = AttnContext("eager", pos, pos, dense_mask(pos, pos, 0, doc_ids), ssmax_log_n(pos_in_doc) if ssmax else None,
                      None, pos_in_doc)
    prior_module = BAMPrior(ModelConfig(n_head=H, n_embd=H * hd, n_layer=1))
    with torch.no_grad():
        for p in prior_module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    scale = (1 + 0.3 * torch.randn(H, generator=g)) if ssmax else None
    sink = 2 * torch.randn(H, generator=g)
    return q, k, v, ctx, prior_module, scale, sink, doc_ids


def softmax_with_a_sink_by_hand(q, k, v, doc_ids, prior_module, scale, sink):
    """gpt-oss's softmax written out, in float64: w_ij = exp(z_ij) / (exp(z_sink,i) + sum_j' exp(z_ij')) over the
    keys j' query i sees, z_ij = (q.k / sqrt(d) + BAM's bias) * s_h log n_i, z_sink,i = sink_h * s_h log n_i (no
    prior: the sink has no position), and the output sum_j w_ij v_j."""
    B, H, T, hd = q.shape
    q, k, v = q.double(), k.double(), v.double()
    shape, log_scale, loc = (t.double() for t in prior_module.tensors())
    out = torch.zeros(B, H, T, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = [j for j in range(i + 1) if doc_ids[b, j] == doc_ids[b, i]]
                factor = scale[h].double() * math.log(len(keys)) if scale is not None else 1.0
                logits = torch.stack([(q[b, h, i] @ k[b, h, j] / math.sqrt(hd)
                                       + ggd_bias(torch.tensor(float(i - j), dtype=torch.float64), h, shape,
                                                  log_scale, loc)) * factor for j in keys])
                sink_logit = sink[h].double() * factor
                top = torch.maximum(logits.max(), sink_logit)
                weights = (logits - top).exp() / ((sink_logit - top).exp() + (logits - top).exp().sum())
                out[b, h, i] = (weights[:, None] * v[b, h, keys]).sum(dim=0)
    return out


@pytest.mark.parametrize("ssmax", [False, True])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_sink_is_a_softmax_with_one_more_term_and_no_value(impl, ssmax):
    q, k, v, ctx, prior_module, scale, sink, doc_ids = attention_inputs(ssmax)
    prior = (prior_module.bias_fn, prior_module.tensors())
    got = model_module.ATTENTION[impl](q, k, v, ctx, prior, scale, None, sink)
    expected = softmax_with_a_sink_by_hand(q, k, v, doc_ids, prior_module, scale, sink)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # and the sink takes mass: without it the same inputs give another output
    assert not torch.allclose(model_module.ATTENTION[impl](q, k, v, ctx, prior, scale, None), got, atol=1e-3)


@pytest.mark.parametrize("ssmax", [False, True])
def test_sdpa_gradients_equal_eager_for_the_sink_ssmax_and_the_prior(ssmax):
    q, k, v, ctx, prior_module, scale, sink, _ = attention_inputs(ssmax)
    leaves = [q, k, v, sink] + list(prior_module.parameters()) + ([scale] if ssmax else [])
    grads = {}
    for impl in ("eager", "sdpa"):
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        prior = (prior_module.bias_fn, prior_module.tensors())
        out = model_module.ATTENTION[impl](q, k, v, ctx, prior, scale, None, sink)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads[impl] = [t.grad.clone() for t in leaves if t.requires_grad]
    assert grads["sdpa"][3].abs().sum() > 0  # the sink's own gradient
    for got, expected in zip(grads["sdpa"], grads["eager"]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pe", PE_CHOICES)
def test_sinks_and_gates_on_sdpa_equal_eager_for_every_encoding(pe):
    """The whole model with SSMax, documents, sinks and gates: logits and every parameter's gradient (the sinks'
    and the gates' included) of the CPU training path equal the reference's."""
    model = sink_gate_model(pe)
    idx, doc_ids = batch()
    results = {impl: logits_and_grads(model, impl, idx, doc_ids) for impl in ("eager", "sdpa")}
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    grads, expected = results["sdpa"][1], results["eager"][1]
    assert {"blocks.0.attn.sink_logit", "blocks.1.attn.wg.weight"} <= set(grads)
    assert_grads_equal(grads, expected)


@pytest.mark.parametrize("pe,ssmax,kw", [("bam", True, {}), ("rope", False, dict(attn_window=6, n_kv_head=2)),
                                         ("fox", True, {}), ("nope", False, dict(attn_gate=False))])
def test_kv_cache_generation_with_sinks_and_gates_equals_the_full_forward(pe, ssmax, kw):
    model = sink_gate_model(pe, ssmax, **kw)
    seq = generated_equals_recomputed(model)
    with torch.no_grad():
        cache = model_module.KVCache(model.config, 2, seq.shape[1], "cpu", torch.float32)
        first, _ = model(seq[:, :15], kv_cache=cache)
        rest, _ = model(seq[:, 15:], kv_cache=cache, start_pos=15)
        torch.testing.assert_close(torch.cat([first, rest], dim=1), model(seq)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pe,ssmax,kw", [("bam", True, dict(flex_prior="table")), ("fox", True, {}),
                                         ("rope", False, dict(attn_window=6, n_kv_head=2)),
                                         ("alibi", False, dict(flex_prior="formula", attn_gate=False))])
def test_on_the_cpu_flex_adds_the_sink_as_one_more_key_and_equals_eager(pe, ssmax, kw):
    """torch's compiled CPU FlexAttention (2.11 to 2.15) returns no log-sum-exp: there the sink is the first key
    of one more key block (model.sink_block_mask), seen by every query and scoring the sink's logit. The model's
    own CPU kernels (inductor's C++), with documents and without, 40 tokens and 130 (padded to 256)."""
    model = sink_gate_model(pe, ssmax, **kw)
    for T, docs in ((40, True), (130, False)):
        idx, doc_ids = batch(T=T)
        with torch.no_grad():
            expected = logits_with(model, "eager", idx, doc_ids if docs else None)
            got = logits_with(model, "flex", idx, doc_ids if docs else None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- the gate ---------------------------------------------------------------------------------------------------


def test_the_gate_is_the_papers_formula():
    """Qiu et al. 2025, eq. (G1, elementwise): Y' = Y * sigmoid(X W_theta), X the layer's normalised input, Y each
    head's attention output, before the output projection; written here with plain matrices and softmax."""
    model = tiny_model(pe="nope", attn_gate=True, attn_impl="eager")
    attn = model.blocks[0].attn
    B, T, C, H, hd = 2, 9, 32, 4, 8
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(5))
    ctx = attention_context(model, 0, T, torch.arange(T)[None])
    with torch.no_grad():
        got = attn(x, ctx, None)
        q, k, v = ((x @ w.weight.T).view(B, T, H, hd).transpose(1, 2) for w in (attn.wq, attn.wk, attn.wv))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(hd)).masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
        heads = (scores.softmax(-1) @ v).transpose(1, 2)  # (B, T, H, hd)
        gate = torch.sigmoid(x @ attn.wg.weight.T).view(B, T, H, hd)
        expected = (heads * gate).reshape(B, T, H * hd) @ attn.wo.weight.T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_gate_starts_as_the_papers_near_one_half():
    """The paper's gate is more output columns of q's projection, initialised with it: N(0, init_std), so every
    gate starts near sigmoid(0) = 1/2 (the model does not start as the ungated one, as the paper's does not)."""
    model = tiny_model(pe="nope", attn_gate=True, init_std=0.02)
    weight = model.blocks[0].attn.wg.weight
    assert weight.shape == (4 * 8, 32) and abs(weight.std().item() - 0.02) < 0.004
    x = torch.nn.functional.rms_norm(torch.randn(64, 32), (32,))
    gates = model.blocks[0].attn.output_gate(x[None])
    assert abs(gates.mean().item() - 0.5) < 0.01 and (gates - 0.5).abs().max() < 0.15


def test_sinks_join_the_prior_group_and_gates_the_decayed_matrices():
    model = Transformer(tiny_config("bam", ssmax=True, attn_sink=True, attn_gate=True))
    groups = {g["name"]: {id(p) for p in g["params"]} for g in model.optim_groups(0.1)}
    ids = [i for group in groups.values() for i in group]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    for block in model.blocks:
        assert id(block.attn.sink_logit) in groups["prior"] and id(block.attn.wg.weight) in groups["decay"]
    assert model.prior_summary()["sink_logit"] == [[0.0] * 4] * 2


# -- flex: the log-sum-exp form, traced as a GPU compiles it ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pe,ssmax,flex_prior", [("bam", True, "table"), ("nope", False, "table"),
                                                 ("fox", True, "formula")])
def test_flex_with_sinks_and_gates_equals_eager_forward_and_backward(pe, ssmax, flex_prior, monkeypatch):
    """out * sigmoid(lse - sink) from flex's log-sum-exp equals the materialised softmax with the sink's column:
    logits and the gradient of every parameter, the sinks' own included. The flex kernels are compiled as
    tests/model/test_flex_backward.py compiles them (AOT autograd, inductor's check of the joint graph, flex's backward
    run by torch's dense reference of it), since the CPU's inductor kernel has no log-sum-exp and no backward:
    model.sink_form is made the GPU's, "lse", here."""
    checked = trace_flex_as_a_gpu(monkeypatch)
    monkeypatch.setattr(model_module, "attention_path", lambda model, T_q, T_k, has_docs: model.config.attn_impl)
    monkeypatch.setattr(model_module, "sink_form", lambda cpu: "lse")
    model = sink_gate_model(pe, ssmax, flex_prior=flex_prior)
    idx, doc_ids = batch(T=128)
    try:
        results = {impl: logits_and_grads(model, impl, idx, doc_ids) for impl in ("flex", "eager")}
    finally:
        torch._dynamo.reset()
    assert checked  # flex's backward was traced, through its log-sum-exp
    torch.testing.assert_close(results["flex"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    grads, expected = results["flex"][1], results["eager"][1]
    assert "blocks.1.attn.sink_logit" in grads
    assert_grads_equal(grads, expected)


@pytest.mark.slow
def test_a_model_with_sinks_and_gates_compiles_to_one_graph_and_trains_as_eager(monkeypatch):
    """torch.compile(fullgraph) of the whole model on flex (a GPU's path, traced on the CPU with the aot_eager
    backend as tests/test_compile.py does), in the GPU's form of the sink: one graph, and the logits and gradients of
    eager. SSMax from its table, built inside the compiled graph: flex's backward gives it the gradient the traced
    joint graph asks for, as inductor's does (flex_on_cpu.flex_backward_as_inductor_lowers_it)."""
    import copy
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    flex_backward_as_inductor_lowers_it(monkeypatch)
    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})
    monkeypatch.setattr(model_module, "sink_form", lambda cpu: "lse")  # the GPU's form (with_sink)
    torch._dynamo.reset()
    model = sink_gate_model("bam", True, flex_prior="table")
    reference = copy.deepcopy(model)
    reference.config.attn_impl = "eager"
    take_flex(monkeypatch, model)
    model_module.build_flex_kernels(model)
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    idx, doc_ids = batch(T=128)
    try:
        logits, loss = compiled(idx, targets=idx, doc_ids=doc_ids)
        loss.backward()
    finally:
        torch._dynamo.reset()
    expected, expected_loss = reference(idx, targets=idx, doc_ids=doc_ids)
    expected_loss.backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
