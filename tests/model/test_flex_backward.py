"""The flex training path, which only a GPU runs, traced on the CPU: for every encoding of model.ENCODINGS (with
and without SSMax, and for a distance-only prior both flex_prior forms), the model's own flex kernels are traced
forward and backward by AOT autograd as torch.compile traces them on a GPU, the joint graph of each score_mod is
put through inductor's own check of it (validate_joint_graph, which refuses a score_mod that indexes a tensor
with a gradient more than once: FoX's gates at i and at j, FIRE's MLP once per hidden unit, issue 45 point 3),
and the backward, run by torch's dense reference of flex's backward, gives sdpa's gradients.

torch 2.13's flex refuses a CPU input with a gradient before it traces (_validate_device): the test lifts that
refusal, which is all that stands between the CPU and the trace. Private torch APIs are looked up first, so a
torch that moved them skips the test with the reason instead of passing it."""

import pytest
import torch

from model import ENCODINGS, FLEX_PRIORS, AdditivePrior, Transformer
from flex_on_cpu import take_flex, trace_flex_as_a_gpu
from tiny_models import batch, tiny_config

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
    assert grads.keys() == expected.keys(), set(grads) ^ set(expected)
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("pe", [name for name, encoding in ENCODINGS.items() if issubclass(encoding, AdditivePrior)])
def test_no_prior_gives_flex_a_0d_tensor_with_a_gradient(pe):
    """flex's backward cannot take a captured 0-d tensor that needs a gradient (pytorch#145208, fixed after 2.13),
    and FSDP2 cannot shard one: every tensor a prior passes to the kernel in training is at least 1-d."""
    model = Transformer(config(pe, True, "formula", "sdpa"))
    tensors = [t for prior in model.priors for t in prior.tensors()] + [b.attn.ssmax_scale for b in model.blocks]
    assert all(t.dim() >= 1 for t in tensors if t.requires_grad)
