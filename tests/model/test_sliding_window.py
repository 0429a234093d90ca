"""Sliding-window attention (`attn_window`, RoPE-local among others): its masks against a pairwise reference
(dense and flex's block-banded one, block-sparse at long context), each encoding's windowed logits against the
crop each query can see run without a window, flex against eager, SSMax counting only the keys inside, and a
KV cache that keeps the last W - 1 positions."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from model import KVCache, ModelConfig, Transformer, attention_context, positions_in_documents, window_block_mask
from tiny_models import VOCAB, batch, generated_equals_recomputed, logits_with, tiny_model


def window_reference_mask(T, W, doc_ids):
    """Query i sees key j iff j <= i, i - j < W and both are in the same document, pair by pair."""
    B = doc_ids.shape[0]
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                mask[b, 0, i, j] = j <= i and i - j < W and doc_ids[b, i] == doc_ids[b, j]
    return mask


@pytest.mark.parametrize("W", [1, 3, 9, 40])
def test_dense_window_mask_matches_pairwise_reference(W):
    model = tiny_model(pe="rope", attn_window=W, attn_impl="eager")
    idx, doc_ids = batch(T=24)
    ctx = attention_context(model, 0, 24, positions_in_documents(doc_ids), doc_ids)
    assert torch.equal(ctx.mask, window_reference_mask(24, W, doc_ids))


@pytest.mark.parametrize("T", [5, 128, 300, 1000])
@pytest.mark.parametrize("W", [1, 2, 127, 128, 129, 256, 300, 5000])
def test_window_block_mask_equals_create_block_mask(T, W):
    """The block-banded mask written down directly covers exactly the pairs create_block_mask finds by
    evaluating the mask on every pair."""
    direct = window_block_mask(T, W, "cpu")
    reference = create_block_mask(lambda b, h, q, k: (q >= k) & (q - k < W), None, None, T, T, device="cpu")
    assert torch.equal(direct.to_dense(), reference.to_dense())


def test_window_block_mask_is_block_sparse_at_long_context():
    """64K tokens, W = 512: each query block visits 5 key blocks (3 full, the one the band's edge cuts and
    the diagonal), not up to T / 128 = 512."""
    T, W = 65536, 512
    mask = window_block_mask(T, W, "cpu")
    visited = mask.kv_num_blocks + mask.full_kv_num_blocks
    assert int(visited.max()) == 5 and int(mask.full_kv_num_blocks.max()) == 3
    assert int(visited.sum()) <= 5 * (T // 128)
    assert 0.99 < mask.sparsity() / 100 < 1


def crop_reference(model_cfg, model, idx, doc_ids, W):
    """For a one-layer model with a relative encoding, the windowed logit of query i is the logit of the
    last token of the crop it can see (the W latest tokens of its document) run with no window: same keys,
    same distances, and SSMax's n_i = the crop's length."""
    ref = torch.empty(*idx.shape, VOCAB)
    full = Transformer(ModelConfig(**{**model_cfg.__dict__, "attn_window": 0, "attn_impl": "eager"}))
    full.load_state_dict(model.state_dict())
    crops = {}  # crop length -> [(row, query, first token)], so crops of one length run as one batch
    for b in range(idx.shape[0]):
        for i in range(idx.shape[1]):
            start = max(i - W + 1, int((doc_ids[b] == doc_ids[b, i]).nonzero()[0]))
            crops.setdefault(i + 1 - start, []).append((b, i, start))
    for length, group in crops.items():
        tokens = torch.stack([idx[b, start:start + length] for b, _, start in group])
        last = full(tokens, last_k=1)[0][:, 0]
        for (b, i, _), logits in zip(group, last):
            ref[b, i] = logits
    return ref


# partial RoPE: RoPE-local with half the pairs turning
WINDOW_GRID = [(pe, ssmax, {}) for pe in ("nope", "rope", "alibi", "bam", "kerple_log", "t5", "fox")
               for ssmax in (False, True)] + [("rope", ssmax, {"rope_fraction": 0.5}) for ssmax in (False, True)]


@pytest.mark.parametrize("pe,ssmax,settings", WINDOW_GRID)
def test_window_on_eager_and_sdpa_equals_the_crop_reference(pe, ssmax, settings):
    W = 7
    model = tiny_model(pe=pe, ssmax=ssmax, n_layer=1, attn_window=W, bam_train_loc=True, **settings)
    idx, doc_ids = batch(T=30)
    with torch.no_grad():
        ref = crop_reference(model.config, model, idx, doc_ids, W)
        for impl in ("eager", "sdpa"):
            torch.testing.assert_close(logits_with(model, impl, idx, doc_ids), ref, atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{impl}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("W,docs", [(129, False), (129, True), (5, False)])
def test_flex_window_equals_eager(W, docs):
    """Eager is held to the pairwise mask and the crop reference above; flex is held to eager. T = 300
    spans partial 128-blocks; W = 129 cuts through blocks, W = 5 lies inside the diagonal ones."""
    idx = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50]) if docs else None
    model = tiny_model(pe="bam", ssmax=True, attn_window=W)
    with torch.no_grad():
        torch.testing.assert_close(logits_with(model, "flex", idx, doc_ids), logits_with(model, "eager", idx, doc_ids),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pe,ssmax,W,kv,settings", [
    ("rope", False, 4, 0, {}), ("bam", True, 6, 2, {}), ("alibi", True, 1, 0, {}), ("sinusoidal", False, 3, 0, {}),
    ("rope", True, 30, 0, {}), ("rope", False, 5, 2, {"rope_fraction": 0.5})])
def test_windowed_generation_equals_full_recompute_with_the_window(pe, ssmax, W, kv, settings):
    """The cache keeps only the last W - 1 positions, and the tokens are those of recomputing the whole
    sequence with the same window at every step."""
    model = tiny_model(pe=pe, ssmax=ssmax, n_kv_head=kv, attn_window=W, **settings)
    seq = generated_equals_recomputed(model)
    with torch.no_grad():
        cache = KVCache(model.config, 2, 22, "cpu", torch.float32)
        model(seq, kv_cache=cache)
    assert cache.k[0].shape[2] == min(W - 1, 22)
    if W < seq.shape[1]:  # and the window matters: without it the same weights compute other logits
        with torch.no_grad():
            windowed = model(seq)[0]
            model.config.attn_window = 0
            assert not torch.allclose(model(seq)[0], windowed, atol=1e-4)


def test_windowed_cache_refuses_a_gap():
    model = tiny_model(pe="rope", attn_window=4)
    cache = KVCache(model.config, 1, 20, "cpu", torch.float32)
    idx, _ = batch(B=1, T=8)
    with torch.no_grad():
        model(idx, kv_cache=cache)
        with pytest.raises(ValueError, match="position 9 was not next"):
            model(idx[:, :1], kv_cache=cache, start_pos=9)


def test_ssmax_counts_only_the_keys_inside_the_window():
    model = tiny_model(pe="bam", ssmax=True, attn_window=5, attn_impl="eager")
    idx, doc_ids = batch(T=24)
    ctx = attention_context(model, 0, 24, positions_in_documents(doc_ids), doc_ids)
    visible = window_reference_mask(24, 5, doc_ids).sum(-1)[:, 0]  # (B, T) keys each query sees
    torch.testing.assert_close(ctx.log_n, visible.float().log())
    assert int(visible.max()) == 5 and int(visible.min()) == 1


def test_a_window_as_wide_as_the_sequence_changes_nothing():
    model = tiny_model(pe="bam", ssmax=True)
    idx, doc_ids = batch()
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        model.config.attn_window = idx.shape[1]
        for impl in ("eager", "sdpa"):
            torch.testing.assert_close(logits_with(model, impl, idx, doc_ids), ref, atol=1e-6, rtol=1e-5)
