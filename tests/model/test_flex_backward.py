"""The flex training path, which only a GPU runs, traced on the CPU: for every encoding of model.ENCODINGS (with
and without SSMax, and for a distance-only prior both flex_prior forms), the model's own flex kernels are traced
forward and backward by AOT autograd as torch.compile traces them on a GPU, the joint graph of each score_mod is
put through inductor's own check of it (validate_joint_graph, which refuses a score_mod that indexes a tensor
with a gradient more than once: FoX's gates at i and at j, FIRE's MLP once per hidden unit, issue 45 point 3),
and the backward, run by torch's dense reference of flex's backward, gives sdpa's gradients.

torch's flex (2.11 to 2.15) refuses a CPU input with a gradient before it traces (_validate_device): the test
lifts that refusal, which is all that stands between the CPU and the trace. Private torch APIs are looked up
first, so a torch that moved them skips the test with the reason instead of passing it."""

import math

import pytest
import torch

import model as model_module
from model import ENCODINGS, FLEX_PRIORS, AdditivePrior, Transformer
from flex_on_cpu import private_apis, take_flex, trace_flex_as_a_gpu
from tiny_models import assert_grads_equal, batch, tiny_config

pytestmark = pytest.mark.slow


def variants():
    for pe, encoding in ENCODINGS.items():
        distance_only = issubclass(encoding, AdditivePrior) and encoding.DISTANCE_ONLY
        for ssmax in (False, True):
            for flex_prior in FLEX_PRIORS if distance_only or ssmax else FLEX_PRIORS[:1]:
                yield pe, ssmax, flex_prior


def config(pe, ssmax, flex_prior, attn_impl):
    return tiny_config(pe, ssmax, n_head=2, block_size=64, flex_prior=flex_prior, attn_impl=attn_impl)


def loss_and_grads(model, idx, doc_ids):
    loss = model(idx, targets=idx, doc_ids=doc_ids)[1]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pe,ssmax,flex_prior", list(variants()))
def test_every_encodings_flex_backward_passes_inductors_check_and_equals_sdpa(pe, ssmax, flex_prior, monkeypatch):
    checked = trace_flex_as_a_gpu(monkeypatch)
    # 128 tokens, a whole flex block: on the CPU a shorter sequence is padded, a copy that would hide a view
    idx, doc_ids = batch(T=128)
    torch.manual_seed(0)
    # the GPU's choice: flex also for training (on the CPU, attention_path refuses it for lack of a backward)
    flex = take_flex(monkeypatch, Transformer(config(pe, ssmax, flex_prior, "flex")))
    reference = Transformer(config(pe, ssmax, flex_prior, "sdpa"))
    reference.load_state_dict(flex.state_dict())
    try:
        loss, grads = loss_and_grads(flex, idx, doc_ids)
    finally:
        torch._dynamo.reset()
    monkeypatch.undo()
    assert checked  # a flex backward was traced and checked (the layers share one compiled kernel)
    expected_loss, expected = loss_and_grads(reference, idx, doc_ids)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_equal(grads, expected)


@pytest.mark.parametrize("pe", [name for name, encoding in ENCODINGS.items() if issubclass(encoding, AdditivePrior)])
def test_no_prior_gives_flex_a_0d_tensor_with_a_gradient(pe):
    """flex's backward cannot take a captured 0-d tensor that needs a gradient (pytorch#145208: fails in torch
    2.11 and 2.13, fixed in 2.15), and FSDP2 cannot shard one: every tensor a prior passes to the kernel in
    training is at least 1-d."""
    model = Transformer(config(pe, True, "formula", "sdpa"))
    tensors = [t for prior in model.priors for t in prior.tensors()] + [b.attn.ssmax_scale for b in model.blocks]
    assert all(t.dim() >= 1 for t in tensors if t.requires_grad)


def captured_by_score_mods(monkeypatch):
    """From here on, every flex kernel the model makes is traced by a backend that records, for each
    flex_attention call in its graph, the (shape, requires_grad) of every tensor its score_mod captures (the HOP's
    score_mod_other_buffers), then runs the graph as traced; flex's CPU refusal of inputs with a gradient is
    lifted. Returns the list they are added to."""
    flex_module = private_apis()[3]
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    captured = []

    def recording(gm, example_inputs):
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        for node in gm.graph.nodes:
            if node.target is torch.ops.higher_order.flex_attention:
                buffers = node.args[7]  # (query, key, value, score_mod, block_mask, scale, options, buffers, ...)
                for buffer in buffers:
                    tensor = example_inputs[placeholders.index(buffer)]
                    captured.append((tuple(tensor.shape), tensor.requires_grad))
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **{**options, "backend": recording}))
    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})
    torch._dynamo.reset()
    return captured


@pytest.mark.parametrize("pe,ssmax,flex_prior", [v for v in variants() if v[2] == "table" or
                                                 not getattr(ENCODINGS[v[0]], "DISTANCE_ONLY", True)])
def test_no_score_mod_captures_a_scalar_or_a_per_head_tensor_that_needs_a_gradient(pe, ssmax, flex_prior,
                                                                                      monkeypatch):
    """Inductor's flex backward adds the gradient of every captured tensor with one atomic add per visited score:
    a scalar with a gradient takes T^2 adds into one address, a per-head vector T^2 / H (issue 57 point 7: FIRE's
    log c and log L, SSMax's scales in FIRE's and FoX's kernels). Every tensor with a gradient that a score_mod
    reads is a table by distance, query or token, or (FIRE) the MLP's per-head slopes by segment. The default form
    only: with flex_prior = "formula" a distance-only prior reads its per-head parameters per score by design
    (docs/benchmarks.md compares the two)."""
    captured = captured_by_score_mods(monkeypatch)
    idx, doc_ids = batch(T=128)
    torch.manual_seed(0)
    model = take_flex(monkeypatch, Transformer(config(pe, ssmax, flex_prior, "flex")))
    try:
        model(idx, targets=idx, doc_ids=doc_ids)
    finally:
        torch._dynamo.reset()
    n_head = model.config.n_head
    assert captured or (pe in ("nope", "rope", "sinusoidal") and not ssmax), "no flex kernel was traced"
    hot = [(shape, grad) for shape, grad in captured if grad and math.prod(shape) <= n_head]
    assert not hot, f"a score_mod reads a scalar or a per-head tensor with a gradient: {hot}"
    if ssmax:
        assert any(grad and len(shape) == 3 for shape, grad in captured)  # SSMax's (B, H, T) table, with its gradient
