"""Prior tables on flex (ModelConfig.flex_prior = "table", model.distance_table): the table path against the
formula path it replaces, forward on the compiled CPU kernel and with gradients on the dense paths; which
priors are routed to a table; and that a table is built once per forward and prior module."""

import pytest
import torch
import torch.nn as nn

import model as model_module
from model import (ATTENTION, PRIORS, AdditivePrior, AttnContext, ModelConfig, alibi_bias, alibi_slopes, dense_mask,
                   distance_table, kernel_scores, positional_scores, positions_in_documents, ssmax_log_n, ssmax_table,
                   table_bias)
from tiny_models import VOCAB, batch, tiny_model

DISTANCE_PRIORS = [name for name, enc in PRIORS.items() if enc.DISTANCE_ONLY]


def logits(model, flex_prior, idx, doc_ids, window):
    model.config.attn_impl, model.config.flex_prior, model.config.attn_window = "flex", flex_prior, window
    with torch.no_grad():
        return model(idx, doc_ids=doc_ids)[0]


def test_only_a_prior_of_the_head_and_distance_is_called_distance_only():
    assert set(DISTANCE_PRIORS) >= {"alibi", "bam", "kerple_log", "kerple_power"}
    assert AdditivePrior.DISTANCE_ONLY is True  # the default a new prior inherits, and must switch off if it reads more


# The forward grid. Every distance-only prior shares one compiled table kernel per SSMax setting, but each mask kind
# (causal, window, documents, both) and head layout (MHA, GQA) is a compilation of its own, ~15 s of C++ on a CPU;
# the formula path compiles one kernel per prior as well, so the whole grid against the compiled formula kernels
# would be ~70 compilations. The grid is therefore held to the eager path (the same formulas on the dense grid, the
# reference every flex test uses), and the compiled formula kernel to the table kernel at the training setting
# (documents), at the shapes of test_attention_paths.py's flex tests, whose kernels a suite run has compiled already.
# On CPU both grid lengths run at 256 (flex_mask_length pads to whole 128-token blocks); 200 ends inside a
# block, so padded queries and keys and the table's last entries are exercised; on a GPU they are two shapes.
@pytest.mark.slow
@pytest.mark.parametrize("ssmax", [False, True])
def test_flex_table_equals_formula_forward(ssmax):
    g = torch.Generator().manual_seed(1)
    for pe in DISTANCE_PRIORS:
        idx, doc_ids = torch.randint(0, VOCAB, (2, 40), generator=g), batch(T=40)[1]
        model = tiny_model(pe=pe, ssmax=ssmax, bam_train_loc=True)
        torch.testing.assert_close(logits(model, "table", idx, doc_ids, 0), logits(model, "formula", idx, doc_ids, 0),
                                   atol=1e-6, rtol=1e-6, msg=lambda m: f"{pe} ssmax={ssmax}, table vs formula: {m}")
        # Every pair of settings (head layout, length, documents, window) meets in one of these four cases, at
        # half the compilations of their full product: n_kv_head 0 = multi-head, 2 = grouped-query.
        for n_kv_head, T, docs, window in ((0, 256, False, 0), (0, 200, True, 50), (2, 256, True, 0), (2, 200, False, 50)):
            model = tiny_model(pe=pe, ssmax=ssmax, n_kv_head=n_kv_head, bam_train_loc=True)
            idx = torch.randint(0, VOCAB, (2, T), generator=g)
            doc_ids = batch(T=T)[1] if docs else None
            table = logits(model, "table", idx, doc_ids, window)
            model.config.attn_impl = "eager"
            with torch.no_grad():
                reference = model(idx, doc_ids=doc_ids)[0]
            torch.testing.assert_close(table, reference, atol=1e-5, rtol=1e-5, msg=lambda m: (
                f"{pe} ssmax={ssmax} kv={n_kv_head} T={T} docs={docs} window={window}: {m}"))


@pytest.mark.slow
def test_a_formula_kernel_serves_models_of_another_head_count_on_cpu():
    """Every ALiBi model on flex shares one compiled formula kernel, whose score_mod reads the slopes by head.
    Inductor's C++ flex template (torch 2.11 to 2.15) failed to compile it once a model of another head count had
    made their size dynamic (`cur_qSplitSize5`), so on a CPU a kernel that reads a tensor has static shapes
    (model.flex_kernel_key)."""
    for n_head in (4, 6):
        model = tiny_model(pe="alibi", n_head=n_head, n_embd=8 * n_head)
        idx, doc_ids = batch()
        flex = logits(model, "formula", idx, doc_ids, 0)
        model.config.attn_impl = "eager"
        with torch.no_grad():
            reference = model(idx, doc_ids=doc_ids)[0]
        torch.testing.assert_close(flex, reference, atol=1e-5, rtol=1e-5, msg=lambda m: f"{n_head} heads: {m}")


def dense_case(pe, ssmax, T=29, H=4):
    """What a dense path needs to score one batch with documents: positions, mask, log n, prior, SSMax."""
    cfg = ModelConfig(n_head=H, n_embd=8 * H, pe=pe, ssmax=ssmax, bam_train_loc=True)
    torch.manual_seed(0)
    prior = PRIORS[pe](cfg)
    with torch.no_grad():
        for p in prior.parameters():
            p.add_(0.3 * torch.randn_like(p))
    for buffer in prior.buffers():  # ALiBi's fixed slopes: their gradient is compared too, as if they were learned
        buffer.requires_grad_(True)
    scale = nn.Parameter(1 + 0.2 * torch.randn(H)) if ssmax else None
    doc_ids = batch(T=T)[1]
    pos = torch.arange(T)
    log_n = ssmax_log_n(positions_in_documents(doc_ids)) if ssmax else None
    return prior, scale, pos, doc_ids, log_n


def prior_grads(prior, scale, loss):
    params = [p for p in (*prior.parameters(), *prior.buffers()) if p.requires_grad]
    params += [scale] if scale is not None else []
    # allow_unused: a buffer the bias reads only through an integer (T5's max distance, via its buckets) has none
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    used = [(p, g) for p, g in zip(params, grads) if g is not None]
    return [p for p, _ in used], [g for _, g in used]


@pytest.mark.parametrize("pe,ssmax", [(pe, ssmax) for pe in DISTANCE_PRIORS for ssmax in (False, True)])
def test_table_scores_equal_formula_with_every_prior_gradient(pe, ssmax):
    """The flex kernel's score function (kernel_scores) reading the prior and SSMax's factor from their tables, on
    the whole grid, against positional_scores (the formula): the same logits and the same gradient for every prior
    and SSMax parameter, which on the table path reaches them through the tables by ordinary autograd."""
    prior, scale, pos, doc_ids, log_n = dense_case(pe, ssmax)
    B, H, T = 2, 4, len(pos)
    g = torch.Generator().manual_seed(2)
    scores, weights = torch.randn(B, H, T, T, generator=g), torch.randn(B, H, T, T, generator=g)
    mask = dense_mask(pos, pos, 0, doc_ids)
    b, head = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(H, 1, 1)

    def loss(logits):  # softmax over the visible keys, then a fixed random readout
        return (logits.masked_fill(~mask, float("-inf")).softmax(-1) * weights).sum(), logits.masked_fill(~mask, 0)

    formula_loss, formula = loss(positional_scores(scores, head, pos[:, None], pos[None, :],
                                                   None if log_n is None else log_n[:, None, :, None],
                                                   (prior.bias_fn, prior.tensors()), scale))
    tabled = (table_bias, (distance_table((prior.bias_fn, prior.tensors()), H, T, pos.device),))
    factors = None if scale is None else ssmax_table(scale, log_n, B)
    table_loss, table = loss(kernel_scores(scores, b, head, pos[:, None], pos[None, :], tabled, factors))
    torch.testing.assert_close(table, formula, atol=1e-6, rtol=1e-6)
    params, want = prior_grads(prior, scale, formula_loss)
    _, got = prior_grads(prior, scale, table_loss)
    assert len(got) == len(want)
    assert params and all(w.abs().sum() > 0 for w in want)
    for p, w, t in zip(params, want, got):
        torch.testing.assert_close(t, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("pe", DISTANCE_PRIORS)
def test_dense_paths_give_the_table_prior_the_formulas_gradients(pe, impl):
    """A prior read from its table (table_bias) through the dense attention paths: the output and the gradient of
    every prior and SSMax parameter equal those of its formula, with documents and grouped-query attention."""
    prior, scale, pos, doc_ids, log_n = dense_case(pe, True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, len(pos), 8, generator=g)
    k, v = (torch.randn(2, 2, len(pos), 8, generator=g) for _ in range(2))
    ctx = AttnContext(impl, pos, pos, dense_mask(pos, pos, 0, doc_ids), log_n, None)
    out = {}
    for name in ("formula", "table"):
        formula = (prior.bias_fn, prior.tensors())
        used = formula if name == "formula" else (table_bias, (distance_table(formula, 4, len(pos), pos.device),))
        y = ATTENTION[impl](q, k, v, ctx, used, scale)
        out[name] = (y, *prior_grads(prior, scale, (y * v.repeat_interleave(2, 1)).sum())[1])
    for want, got in zip(out["formula"], out["table"]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class NotDistanceOnlyPrior(AdditivePrior):
    """A stand-in for a prior that reads more than the head and i - j (FoX's forget gates, FIRE's query
    position): the flag alone must keep it off the table; its formula here is ALiBi's, to have one."""

    DISTANCE_ONLY = False
    METRICS_PREFIX = "not_distance_only"

    @staticmethod
    def bias_fn(dist, head, query, key, slopes):  # the contract's form for a prior with token features
        return alibi_bias(dist, head, slopes) + 0 * (query[0] - key[0])

    def __init__(self, cfg):
        super().__init__()
        self.slopes = nn.Parameter(torch.tensor(alibi_slopes(cfg.n_head)))

    def tensors(self):
        return (self.slopes,)

    def token_features(self, x, pos_in_doc, past=None):
        return (torch.zeros(x.shape[0], 1, x.shape[1], device=x.device),)

    def head_parameters(self):
        return {"slope": self.slopes.tolist()}


@pytest.fixture
def recorded_kernels(monkeypatch):
    """Which flex kernels a forward calls (each once in the list, in the order of their first call), and how many
    distance tables it builds; no kernel is compiled (a fake one returns zeros), so routing is checked without
    FlexAttention's half a minute of C++ compilation on a CPU. The model builds its kernels when it is made
    (model.build_flex_kernels), so what counts is which one each layer calls."""
    called, tables = [], []
    real_table = model_module.distance_table

    def make(*key):  # a FlexKernelKey's fields: the score_mod's bias function, SSMax, static shapes, sink
        def kernel(q, *args):
            if key not in called:
                called.append(key)
            return torch.zeros_like(q)
        return kernel

    def counting_table(*args):
        tables.append(real_table(*args))
        return tables[-1]

    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})
    monkeypatch.setattr(model_module, "_make_flex_kernel", make)
    monkeypatch.setattr(model_module, "distance_table", counting_table)
    monkeypatch.setitem(model_module.ENCODINGS, "not_distance_only", NotDistanceOnlyPrior)
    return called, tables


def flex_forward(model, flex_prior="table"):
    model.config.attn_impl, model.config.flex_prior = "flex", flex_prior
    idx = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        model(idx, doc_ids=batch(T=40)[1])


@pytest.mark.slow
@pytest.mark.parametrize("ssmax", [False, True])
def test_a_prior_that_is_not_distance_only_is_not_routed_to_a_table(recorded_kernels, ssmax):
    called, tables = recorded_kernels
    flex_forward(tiny_model(pe="not_distance_only", ssmax=ssmax, bam_train_loc=True))
    # (..., True, None): its token features are gathered by query, so on a CPU its kernel has static shapes
    # too; no sink
    assert called == [(NotDistanceOnlyPrior.bias_fn, ssmax, True, None)] and tables == []
    called.clear()
    flex_forward(tiny_model(pe="alibi", ssmax=ssmax, bam_train_loc=True))
    # the control above: the same formula, distance-only, is tabulated
    assert called == [(table_bias, ssmax, True, None)] and len(tables) == 1


@pytest.mark.slow
@pytest.mark.parametrize("pe,kw,expected", [
    ("alibi", {}, 1),                          # ALiBi: one prior shared by every layer
    ("bam", {"bam_per_layer": False}, 1),      # BAM shared: one table for all layers
    ("bam", {}, 3),                            # BAM per layer: one table per layer's prior
    ("kerple_log", {}, 3),
])
def test_a_table_is_built_once_per_forward_and_prior_module(recorded_kernels, monkeypatch, pe, kw, expected):
    called, tables = recorded_kernels
    seen = []
    real_flex = model_module.ATTENTION["flex"]

    def recording_flex(q, k, v, ctx, prior, *rest):
        seen.append(prior[1][0])
        return real_flex(q, k, v, ctx, prior, *rest)

    monkeypatch.setitem(model_module.ATTENTION, "flex", recording_flex)
    model = tiny_model(pe=pe, ssmax=True, n_layer=3, bam_train_loc=True, **kw)
    flex_forward(model)
    assert len(tables) == expected and len(seen) == 3
    assert all(any(t is s for t in tables) for s in seen)  # every layer reads one of the tables built
    tables.clear()
    flex_forward(model, "formula")  # the formula path builds none
    assert tables == []
    assert [key[0] for key in called] == [table_bias, model.priors[0].bias_fn]


@pytest.mark.slow
def test_a_table_too_short_for_the_kernel_is_one_clear_error():
    """A table built for fewer tokens than the kernel runs would be read out of bounds on a GPU."""
    prior, _, pos, _, _ = dense_case("bam", False, T=40)
    q = torch.randn(1, 4, 40, 8)
    mask = model_module.make_block_mask(None, 40, "cpu")
    short = distance_table((prior.bias_fn, prior.tensors()), 4, 40, "cpu")  # the kernel runs 128 on a CPU
    ctx = AttnContext("flex", pos, pos, mask, None, None, uses_prior_tables=True)
    with pytest.raises(ValueError, match="prior table covers distances 0..39, the kernel runs 128 tokens"):
        with torch.no_grad():
            ATTENTION["flex"](q, q, q, ctx, (table_bias, (short,)), None)
