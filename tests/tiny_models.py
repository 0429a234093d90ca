"""The tiny models and batches the CPU tests of model.py share (test_model.py, test_baselines.py,
test_rivals.py): a 2-layer, 4-head, 32-wide config at 97 tokens, a seeded model whose prior and SSMax
parameters are moved off their initial values, and a batch of several documents per row."""

import torch

from model import ModelConfig, Transformer

VOCAB = 97


def tiny(pe="bam", ssmax=False, **kw):
    cfg = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=16, pe=pe, ssmax=ssmax)
    cfg.update(kw)
    return ModelConfig(**cfg)


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = Transformer(tiny(**kw))
    # Move every prior and SSMax parameter off its initial value so a test cannot pass because of a
    # special init (e.g. ALiBi's shape exactly 1, SSMax's scale exactly 1).
    with torch.no_grad():
        for prior in model.priors:
            for p in prior.parameters():
                p.add_(0.3 * torch.randn_like(p))
        for block in model.blocks:
            if block.attn.ssmax_scale is not None:
                block.attn.ssmax_scale.add_(0.2 * torch.randn_like(block.attn.ssmax_scale))
    return model


def batch(B=2, T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (B, T), generator=g)
    # row 0: three documents, row 1: two documents, boundaries not on flex's 128-token blocks
    a, b, c = T // 4 + 1, T // 2 + 1, 5 * T // 8
    doc_ids = torch.tensor([[0] * a + [1] * b + [2] * (T - a - b), [0] * c + [1] * (T - c)][:B])
    return idx, doc_ids


def logits_with(model, impl, idx, doc_ids=None, **kw):
    model.config.attn_impl = impl
    return model(idx, doc_ids=doc_ids, **kw)[0]


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
