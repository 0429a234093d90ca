"""A training step that compiles well, checked on the CPU: the compiled forward with document masking is one
graph (no graph break, hence no host read of a tensor inside it), one BlockMask per forward serves every
layer, and the causal mask is cached per length."""

import pytest
import torch

import model as model_module
from model import ModelConfig, Transformer, check_doc_ids

pytestmark = pytest.mark.slow  # every test compiles (dynamo's explain, torch.compile, flex kernels)

VOCAB = 97


def tiny(pe, ssmax, **kw):
    cfg = dict(vocab_size=VOCAB, n_layer=3, n_head=4, n_embd=32, block_size=64, pe=pe, ssmax=ssmax)
    cfg.update(kw)
    return ModelConfig(**cfg)


def batch(B=2, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    doc_ids = torch.tensor([[0] * 20 + [1] * 30 + [2] * (T - 50), [0] * 41 + [1] * (T - 41)])
    return idx[:, :-1], idx[:, 1:], doc_ids


@pytest.mark.parametrize("pe,ssmax", [("bam", True), ("rope", False), ("sinusoidal", True)])
def test_compiled_forward_with_doc_ids_is_one_graph(pe, ssmax):
    """train.py compiles the model and calls it with doc_ids; on the CPU that is the sdpa path. A graph break
    (e.g. reading doc_ids back to check them) would split the graph and, on a GPU, sync the device."""
    torch.manual_seed(0)
    model = Transformer(tiny(pe, ssmax, attn_impl="sdpa"))
    x, y, doc_ids = batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_flex_with_prior_tables_is_one_graph():
    """The GPU trains on flex, where the prior tables are built inside the forward (Transformer._flex_prior_tables):
    they must trace into the same one graph. On the CPU flex has no backward, so this traces an inference forward;
    bench/gpu_check.py's graphs section traces the training forward on a GPU."""
    torch.manual_seed(0)
    model = Transformer(tiny("bam", True, attn_impl="flex", flex_prior="table"))
    x, y, doc_ids = batch()
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_explain_sees_a_host_read_of_doc_ids():
    """The check above can fail: the ordering check, traced instead of skipped, is a graph break."""

    class Checked(torch.nn.Module):
        def forward(self, doc_ids):
            check_doc_ids(doc_ids)
            return doc_ids * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(Checked())(batch()[2])
    assert explained.graph_break_count >= 1


@pytest.mark.parametrize("docs", [False, True])
def test_one_block_mask_per_forward_shared_by_all_layers(monkeypatch, docs):
    built, seen = [], []
    real_make = model_module.make_block_mask

    def counting_make(*args):
        built.append(real_make(*args))
        return built[-1]

    def recording_flex(q, k, v, ctx, prior, ssmax_scale, features=None):
        # flex itself compiles C++ for half a minute on a CPU; what matters here is which mask each layer gets
        seen.append(ctx.mask)
        return torch.zeros_like(q)

    monkeypatch.setattr(model_module, "make_block_mask", counting_make)
    monkeypatch.setitem(model_module.ATTENTION, "flex", recording_flex)
    torch.manual_seed(0)
    model = Transformer(tiny("bam", True, attn_impl="flex"))
    x, _, doc_ids = batch()
    with torch.no_grad():
        model(x, doc_ids=doc_ids if docs else None)
    assert len(built) == 1
    assert len(seen) == model.config.n_layer and all(mask is built[0] for mask in seen)


def test_causal_block_mask_cached_per_length_device_and_mode():
    model_module._kept_causal_block_mask.cache_clear()
    first = model_module.cached_causal_block_mask(300, "cpu")
    assert model_module.cached_causal_block_mask(300, torch.device("cpu")) is first
    other = model_module.cached_causal_block_mask(200, "cpu")
    assert other is not first and other.seq_lengths == (200, 200)
    # the cached mask is the causal mask of its length
    fresh = model_module.causal_block_mask(300, "cpu")
    assert torch.equal(first.to_dense(), fresh.to_dense()) and first.seq_lengths == (300, 300)
    with torch.inference_mode():  # inference tensors cannot be saved for a later backward: kept apart
        assert model_module.cached_causal_block_mask(300, "cpu") is not first
    # bounded: a sweep over many lengths keeps only the most recent few
    for T in range(400, 400 + 128 * model_module.CAUSAL_MASKS_KEPT, 128):
        model_module.cached_causal_block_mask(T, "cpu")
    assert model_module._kept_causal_block_mask.cache_info().currsize == model_module.CAUSAL_MASKS_KEPT
    assert model_module.cached_causal_block_mask(300, "cpu") is not first

    # make_block_mask serves the cached mask at flex's CPU length (whole 128-token blocks, model.flex_mask_length)
    assert model_module.make_block_mask(None, 300, "cpu") is model_module.cached_causal_block_mask(384, "cpu")