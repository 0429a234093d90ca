"""The tiny model every test that builds one in this process starts from, its batches, and the relative error
the comparisons of two models' numbers use: a 2-layer, 4-head, 32-wide config at 97 tokens, a seeded model
whose prior, SSMax and sink parameters are moved off their initial values, and a batch of several documents
per row. A test asks for what it needs beyond that by the ModelConfig fields it passes. The small training
runs are tests/small_runs.py's.

Used by every file of tests/model/ and by test_checkpoint.py, test_compile.py, test_downstream.py,
test_eval.py, test_eval_attention.py, test_eval_contract.py, test_export_hf.py, test_fsdp.py,
test_import_hf.py, test_io_errors.py, test_outputs.py and test_train.py (tests/test_structure.py holds this
list to the imports)."""

import torch

from model import ModelConfig, Transformer

VOCAB = 97
GPT2_VOCAB = 50257  # a model fed GPT-2's ids: the evaluators' prompts, an export's tokenizer, lm-eval


def tiny_config(pe="bam", ssmax=False, **fields):
    """The tiny ModelConfig, `fields` overriding it. FIRE's MLP has 6 hidden units, not 32: flex's inference
    kernel sums over them, and on a CPU each compiled FIRE kernel took ~6 s more of C++ at 32."""
    tiny = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=16, fire_mlp_width=6)
    return ModelConfig(**{**tiny, **fields}, pe=pe, ssmax=ssmax)


def tiny_model(seed=0, **fields):
    """A Transformer of tiny_config(**fields), seeded by `seed`."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**fields))
    # Move every prior, SSMax and sink parameter off its initial value so a test cannot pass because of a
    # special init (e.g. ALiBi's shape exactly 1, SSMax's scale exactly 1, a sink's logit exactly 0).
    with torch.no_grad():
        for prior in model.priors:
            for p in prior.parameters():
                p.add_(0.3 * torch.randn_like(p))
        for block in model.blocks:
            if block.attn.ssmax_scale is not None:
                block.attn.ssmax_scale.add_(0.2 * torch.randn_like(block.attn.ssmax_scale))
        for block in model.blocks:
            if block.attn.sink_logit is not None:
                block.attn.sink_logit.add_(0.3 * torch.randn_like(block.attn.sink_logit))
    return model


def batch(B=2, T=40, seed=1, vocab=VOCAB):
    """(idx, doc_ids) of B <= 2 rows of T random tokens below `vocab`; targets, where a test needs them, are
    idx rolled by one (torch.roll(idx, -1, 1))."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, T), generator=g)
    # row 0: three documents, row 1: two documents, boundaries not on flex's 128-token blocks
    a, b, c = T // 4 + 1, T // 2 + 1, 5 * T // 8
    doc_ids = torch.tensor([[0] * a + [1] * b + [2] * (T - a - b), [0] * c + [1] * (T - c)][:B])
    return idx, doc_ids


def logits_with(model, impl, idx, doc_ids=None, **kw):
    model.config.attn_impl = impl
    return model(idx, doc_ids=doc_ids, **kw)[0]


def logits_and_grads(model, impl, idx, doc_ids):
    """The logits and every parameter's gradient of one training forward and backward on `impl`."""
    model.zero_grad(set_to_none=True)
    model.config.attn_impl = impl
    logits, loss = model(idx, targets=idx, doc_ids=doc_ids)
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(grads, expected):
    """Two paths' gradients by parameter name: the same parameters, each within the tolerance every path
    comparison of the model's tests uses (fp32 on a CPU)."""
    assert grads.keys() == expected.keys(), sorted(set(grads) ^ set(expected))
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def generated_equals_recomputed(model, new_tokens=12):
    """Greedy generation with the KV cache from a (2, 10) prompt, asserted equal to recomputing the whole
    sequence at every step; returns that sequence."""
    model.eval()
    prompt, _ = batch(B=2, T=10)
    out = model.generate(prompt, max_new_tokens=new_tokens, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    return seq


def relative_error(got, want, *, norm):
    """How far `got` is from `want`, relative to `want`, in float64: norm="max" is max |got - want| / max |want|
    (the worst element against the largest: logits), norm="l2" is ||got - want|| / ||want|| (a whole tensor:
    weights, gradients). Two dicts of tensors (state dicts, gradients by name) must have the same keys and
    give the largest error over them."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        return max(relative_error(got[name], want[name], norm=norm) for name in want)
    difference, want = got.double() - want.double(), want.double()
    if norm == "max":
        return (difference.abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if norm == "l2":
        return (difference.norm() / want.norm().clamp_min(1e-30)).item()
    raise ValueError(f"norm={norm!r}; allowed: max, l2")
