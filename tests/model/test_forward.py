"""What a forward of model.py's Transformer sees and returns: no query sees the future or another document
(for every encoding x SSMax), doc_ids are checked, logits for the last k positions only, the loss on sparse
targets, finite logits far past the training context, sampling inside the top k."""

import pytest
import torch

from model import PE_CHOICES
from tiny_models import VOCAB, batch, tiny_model


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


def test_bad_doc_ids_shape():
    model = tiny_model()
    idx, doc_ids = batch()
    with pytest.raises(ValueError, match="doc_ids must have the shape of idx"):
        model(idx, doc_ids=doc_ids[:, :-1])
    with pytest.raises(ValueError, match="non-decreasing"):
        model(idx, doc_ids=doc_ids.flip(1))


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


@pytest.mark.parametrize("impl", [pytest.param("flex", marks=pytest.mark.slow), "sdpa"])
def test_logits_far_past_block_size_are_finite(impl):
    model = tiny_model(pe="bam", ssmax=True)
    with torch.no_grad():
        model.priors[0].shape[:2] = torch.tensor([-0.8, -2.0])  # anti-local heads
        idx = torch.randint(0, VOCAB, (1, 64 * model.config.block_size))
        model.config.attn_impl = impl
        logits = model(idx, last_k=4)[0]
    assert logits.shape == (1, 4, VOCAB) and torch.isfinite(logits).all()


def test_sampling_with_top_k_stays_in_top_k():
    model = tiny_model(pe="bam")
    prompt, _ = batch(B=1, T=5)
    g = torch.Generator().manual_seed(0)
    out = model.generate(prompt, max_new_tokens=1, temperature=1.0, top_k=3, generator=g)
    top3 = model(prompt)[0][0, -1].topk(3).indices
    assert out[0, -1] in top3
