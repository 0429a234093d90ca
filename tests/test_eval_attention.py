"""eval.attention: its numbers against attention weights written out densely over the whole T x T matrix
(for every encoding, with and without SSMax, with and without a window, with grouped-query attention), the
closed forms of uniform attention end to end, the paper's claims on models built to show them, and the
command on a checkpoint through eval.report."""

import json
import math
import os
from contextlib import nullcontext
from types import SimpleNamespace

import matplotlib.image
import numpy as np
import pytest
import torch

from bam import data
from bam.checkpoint import save_model
from bam.tokenizer import load_tokenizer
from eval import attention, report
from eval.options import EvalOptions
from eval.sweep import format_factor
from eval.tables import length_label
from model import ENCODINGS, Transformer
from tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.slow  # eval.attention end to end, its command and its report section

CONTEXT = 16  # the training context of the test models: distances from 16 on count as far


def model_of(pe, ssmax=False, window=0, seed=0, **kw):
    """A tiny model at its init (the claims below are about what an init shows), with grouped-query attention,
    BAM's shapes sampled (heads in all three groups) and large weights: the content score matters as much as
    the prior."""
    cfg = dict(vocab_size=512, n_kv_head=2, block_size=CONTEXT, attn_window=window, init_std=0.3, bam_init="sampled")
    torch.manual_seed(seed)
    return Transformer(tiny_config(pe, ssmax, **{**cfg, **kw})).eval()


def dense_probabilities(attn, x, ctx, prior_module, window=None, sink_share=None):
    """(B, H, T, T) attention probabilities in float64, written out from the formula (docs/paper.md §3):
    softmax over the keys j <= i inside the window of ((q_i.k_j / sqrt(d) + g_h(i - j)) * s_h * log n_i),
    n_i the number of keys query i sees; and the (B, T, n_embd) output of the layer they give. `window`: the
    layer's (ModelConfig.layer_kinds), attn_window if None. With a learned sink (attn_sink) its logit
    sink_h (* s_h log n_i) is one more term of the softmax, whose share goes in `sink_share` (a dict) under
    "p"; with gated attention each head's output is multiplied by sigmoid(x W_g)."""
    q, k, v = (t.double() for t in attn.project(x, ctx))
    H, T, d = q.shape[1], q.shape[2], q.shape[3]
    k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // v.shape[1], dim=1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    window = attn.cfg.attn_window if window is None else window
    visible = (j <= i) & ((i - j < window) if window else True)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if prior_module is not None:
        head = torch.arange(H).view(H, 1, 1)
        if prior_module.DISTANCE_ONLY:
            bias = prior_module.bias_fn((i - j).double(), head, *prior_module.tensors())
        else:  # FIRE, FoX: their per-token values (the formulas are tests/model/test_t5_fire_fox.py's)
            at = prior_module.token_features(x, torch.arange(T)[None])
            bias = prior_module.bias_fn((i - j).double(), head, tuple(t[..., :, None] for t in at),
                                        tuple(t[..., None, :] for t in at), *prior_module.tensors())
        scores = scores + bias.double()
    if attn.ssmax_scale is not None:
        n = (i + 1).clamp(max=window) if window else i + 1
        scores = scores * attn.ssmax_scale.double().view(H, 1, 1) * torch.log(n.double())
    scores = scores.masked_fill(~visible, float("-inf"))
    if attn.sink_logit is None:
        p = scores.softmax(dim=-1)
    else:
        sink = attn.sink_logit.double().view(H, 1, 1).expand(H, T, 1)
        if attn.ssmax_scale is not None:
            sink = sink * attn.ssmax_scale.double().view(H, 1, 1) * torch.log(n.double())
        p = torch.cat((scores, sink.expand(scores.shape[0], H, T, 1)), dim=-1).softmax(dim=-1)
        sink_share["p"], p = p[..., -1], p[..., :-1]
    y = p @ v
    if attn.wg is not None:
        y = y * torch.sigmoid(x.double() @ attn.wg.weight.double().T).view(x.shape[0], T, H, d).transpose(1, 2)
    return p, attn.wo(y.transpose(1, 2).reshape(x.shape[0], T, -1).float())


def metrics_of(p, positions, context, sink_p=None):
    """Entropy, mean distance and far mass of the rows `positions` of dense probabilities (B, H, T, T); the
    sink's share `sink_p` (B, H, T), where there is one, counts in the entropy as one more outcome."""
    rows = p[:, :, positions]
    distance = (torch.as_tensor(positions)[:, None] - torch.arange(p.shape[-1])[None, :]).double()
    log_p = torch.where(rows > 0, rows.log(), torch.zeros_like(rows))
    entropy = -(rows * log_p).sum(-1)
    if sink_p is not None:
        entropy = entropy - sink_p[:, :, positions] * sink_p[:, :, positions].log()
    return torch.stack([entropy, (rows * distance).sum(-1), (rows * (distance >= context)).sum(-1)])


SINKS_AND_GATES = [("bam", True, 0), ("nope", False, 24)]  # learned sinks and gated attention


@pytest.mark.parametrize("window", [0, 24], ids=["full", "window"])
@pytest.mark.parametrize("ssmax", [False, True], ids=["softmax", "ssmax"])
@pytest.mark.parametrize("pe", list(ENCODINGS))
def test_the_sampled_queries_match_the_dense_attention(pe, ssmax, window, monkeypatch):
    check_sampled_queries(model_of(pe, ssmax, window), monkeypatch)


@pytest.mark.parametrize("pattern", ["rope@24 bam+ssmax@full", "fox+ssmax alibi@24"])
def test_the_sampled_queries_match_the_dense_attention_of_each_layer_of_a_pattern(pattern, monkeypatch):
    """A layer_pattern: each layer scored with its own encoding, window and SSMax."""
    check_sampled_queries(model_of("rope", layer_pattern=pattern), monkeypatch)


@pytest.mark.parametrize("pe,ssmax,window", SINKS_AND_GATES)
def test_with_sinks_and_gates_the_sampled_queries_match_the_dense_attention(pe, ssmax, window, monkeypatch):
    """A sink takes part of each row (no key); the entropy counts it as one more outcome."""
    model = model_of(pe, ssmax, window, attn_sink=True, attn_gate=True)
    with torch.no_grad():  # sinks off their 0, each head its own
        for block in model.blocks:
            block.attn.sink_logit.copy_(torch.linspace(-2.0, 3.0, 4))
    check_sampled_queries(model, monkeypatch)


def check_sampled_queries(model, monkeypatch):
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    captured = {}
    hooks = []
    for layer, block in enumerate(model.blocks):
        hooks.append(block.attn.register_forward_pre_hook(lambda m, args, layer=layer: captured.update(
            {layer: args[:3]})))
        hooks.append(block.attn.register_forward_hook(lambda m, args, out, layer=layer: captured.update(
            {("out", layer): out})))
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()

    positions = np.arange(40)  # every row, the first token's (one key) included
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * 2 * 4 * 40 * 7)  # chunks of 7 queries: the chunking is used
    got = attention.score_prompts(model, tokens.numpy(), positions, CONTEXT, nullcontext())  # (3, L, B, H, Q)
    for layer, block in enumerate(model.blocks):
        sink_share = {}
        p, out = dense_probabilities(block.attn, *captured[layer], window=model.config.layer_kinds[layer].window,
                                     sink_share=sink_share)
        # the dense probabilities are the model's own attention: they give the layer's output
        torch.testing.assert_close(out, captured[("out", layer)], rtol=1e-4, atol=1e-5)
        want = metrics_of(p, positions, CONTEXT, sink_share.get("p"))
        torch.testing.assert_close(got[:, layer].double(), want, rtol=1e-4, atol=2e-4)
    assert (got[2] > 0.01).any(), "some mass past the context: the far share was exercised"


def test_the_sampled_scores_stay_fp32_under_bf16_autocast(monkeypatch):
    """A GPU evaluation runs under bf16 autocast, which would round q.k to 8 bits: from the same q and k (the
    projections themselves are the model's, bf16 under autocast) the statistics are those of fp32."""
    model = model_of("bam", ssmax=True)
    captured = {}
    hook = model.blocks[1].attn.register_forward_pre_hook(lambda m, args: captured.update(args=args[:3]))
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1)))
    hook.remove()
    attn = model.blocks[1].attn
    x, ctx, prior_module = captured["args"]
    projections = attn.project(x, ctx)
    monkeypatch.setattr(attn, "project", lambda x, ctx: projections)
    positions = np.arange(20, 40)
    plain = attention.attention_stats(attn, x, ctx, prior_module, positions, CONTEXT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = attention.attention_stats(attn, x, ctx, prior_module, positions, CONTEXT)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, plain)


def test_uniform_attention_gives_the_closed_forms(tmp_path):
    """With q = 0 and no positional signal every head spreads evenly over the keys it sees, so entropy,
    mean distance and far mass have closed forms; the whole command (passkey prompts) must give them."""
    model = model_of("nope", window=24, n_kv_head=0, vocab_size=50257)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.zero_()
    res = attention.evaluate_attention(model, options=EvalOptions(out=str(tmp_path), progress=False, verbose=False),
                                       prompts="passkey", lengths=[96, 160], samples=2, queries=5)
    for row in res["results"]:
        i = np.array(row["queries"])
        n = np.minimum(i + 1, 24)  # keys in the window
        far = np.maximum(0, n - CONTEXT) / n  # distances CONTEXT .. n - 1 of 0 .. n - 1
        for metric, value in (("entropy", np.log(n).mean()), ("mean_distance", ((n - 1) / 2).mean()),
                              ("far_mass", far.mean())):
            assert np.allclose(row[metric], value, rtol=1e-5, atol=1e-5), (metric, row[metric], value)
        assert row["uniform_entropy"] == pytest.approx(np.log(n).mean())
        assert list(i) == sorted(set(i)) and i[-1] == row["length"] - 1 and i[0] == row["length"] // 2
    saved = json.loads((tmp_path / "attention_passkey.json").read_text())
    assert saved["schema"] == "attention" and saved["complete"] and len(saved["results"]) == 2
    assert np.array(saved["results"][0]["entropy"]).shape == (2, 4)  # [layer][head]


def content_free(model):
    """The model's attention with the content score removed: the prior (and SSMax) alone decide."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.zero_()
    return model


def test_alibi_heads_turn_local_with_ssmax_and_bam_heads_of_shape_at_most_0_reach_far():
    tokens = np.random.default_rng(0).integers(0, 512, (1, 768))
    lengths = (128, 384, 768)

    def per_length(model):  # (length, metric, head) for the last query, layer 0
        return np.array([attention.score_prompts(model, tokens[:, :n], np.array([n - 1]), CONTEXT, nullcontext())
                         [:, 0, 0, :, 0].numpy() for n in lengths])

    alibi = per_length(content_free(model_of("alibi", n_kv_head=0)))
    alibi_ssmax = per_length(content_free(model_of("alibi", ssmax=True, n_kv_head=0)))
    # Fixed slopes: a head's reach grows with the prompt until its slope cuts it off (at about 1 / slope)
    assert (np.diff(alibi[:, 1], axis=0) >= -1e-4).all() and np.allclose(alibi[0, 1, :2], alibi[-1, 1, :2], rtol=1e-2)
    # SSMax multiplies the prior by s log n: the longer the prompt, the more local every head
    assert (alibi_ssmax[-1, 1] < alibi_ssmax[0, 1]).all() and (alibi_ssmax[-1, 1] < 0.5 * alibi[-1, 1]).all()

    bam = content_free(model_of("bam", n_kv_head=0, bam_per_layer=False))
    with torch.no_grad():
        bam.priors[0].shape.copy_(torch.tensor([-0.4, 0.0, 0.5, 1.0]))
        bam.priors[0].log_scale.copy_(torch.tensor([0.0, 0.0, 0.5, -1.0]))
    far = per_length(bam)[:, 2]  # far mass, (length, head)
    assert (far[-1, :2] > 0.9).all() and (far[-1, 2:] < 0.05).all()  # b <= 0 reaches past the context; b > 0 not
    assert (np.diff(far[:, :2], axis=0) > 0).all()


def test_ssmax_keeps_the_entropy_of_a_matching_query_flat():
    """A query that matches one key (a needle, and itself) among filler: a plain softmax spreads its mass as the
    filler grows, SSMax's s log n sharpens the logits as fast as the keys come."""
    def needle_model(ssmax):
        model = tiny_model(vocab_size=64, n_layer=1, n_head=1, n_embd=16, pe="nope", ssmax=ssmax,
                           block_size=CONTEXT).eval()
        with torch.no_grad():
            emb = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
            emb[:, 0] = 0.0
            emb[7] = torch.eye(16)[0]  # the needle: alone along the first axis
            model.tok_emb.weight.copy_(emb)
            model.blocks[0].attn.wq.weight.copy_(torch.eye(16))
            model.blocks[0].attn.wk.weight.copy_(torch.eye(16))  # needle . needle = 16 / sqrt(16) = 4, filler 0
        return model

    rng = np.random.default_rng(1)
    entropies = {}
    for ssmax in (False, True):
        for n in (128, 2048):
            tokens = rng.integers(8, 64, (1, n))
            tokens[0, n // 3] = tokens[0, -1] = 7
            stats = attention.score_prompts(needle_model(ssmax), tokens, np.array([n - 1]), CONTEXT, nullcontext())
            entropies[ssmax, n] = float(stats[0, 0, 0, 0, 0])
    assert entropies[False, 2048] > entropies[False, 128] + 1.5  # about log(16) more
    assert abs(entropies[True, 2048] - entropies[True, 128]) < 0.1 and entropies[True, 2048] < 1.0


def test_the_command_on_a_checkpoint_and_its_report_section(tmp_path, capsys):
    run = tmp_path / "bam"
    model = model_of("bam", ssmax=True, vocab_size=50257)
    save_model(model, str(run / "checkpoints" / "step_00000001.pt"))
    enc = load_tokenizer("gpt2")
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    data.write_shard(str(tmp_path / "data" / "x_val_000000.bin"), [data.EOT] + enc.encode_ordinary(text))
    assert attention.main([str(run), "--lengths", "32,4x,128", "--samples", "2", "--queries", "4", "--data_dir",
                           str(tmp_path / "data"), "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "| 128 | 8 |" in out and "attention.json" in out
    saved = json.loads((run / "eval" / "attention.json").read_text())
    assert saved["settings"]["prompts"] == "text" and [r["length"] for r in saved["results"]] == [32, 64, 128]
    assert len(saved["head_groups"]) == 2 and set(saved["head_groups"][0]) <= {"local", "retrieval", "aggressive"}
    image = matplotlib.image.imread(run / "eval" / "attention.png")
    assert image.shape[0] > 200 and image[..., :3].std() > 0.05

    assert report.main([str(run), "--out", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    section = text.split("## Attention by prompt length")[1].split("## Plots")[0]
    assert "**entropy (nats)**" in section and "| bam |" in section and "| uniform |" in section
    assert "![](report_attention.png)" in text and os.path.getsize(tmp_path / "report_attention.png") > 10_000


def test_factors_of_the_context_print_as_numbers_not_exponents():
    """A prompt 1,024 times the training context is "1,024" in the table (it was 1.02e+03), as lengths are
    written with thousands separated; small and fractional factors keep three significant digits."""
    def row(factor):
        return {"length": int(factor * CONTEXT), "factor": factor, "entropy": [[1.0]], "mean_distance": [[3.0]],
                "far_mass": [[0.5]], "uniform_entropy": 2.0, "seconds": 1.0}

    results = {"model": {"name": "bam"}, "settings": {"samples": 2, "prompts": "text", "queries": 4,
                                                      "block_size": CONTEXT},
               "results": [row(0.5), row(1.9375), row(1024.0), row(32768.0)], "stopped": None}
    table = attention.format_table(results)
    assert "| 8 | 0.5 |" in table and "| 31 | 1.94 |" in table
    assert "| 16,384 | 1,024 |" in table and "| 524,288 | 32,768 |" in table and "e+" not in table
    assert [format_factor(f) for f in (0.25, 1.0, 2.5, 64.0, 195.3125, 1000.0, 1024.0)] == \
        ["0.25", "1", "2.5", "64", "195", "1,000", "1,024"]
    runs = [SimpleNamespace(pretraining_context=CONTEXT)]
    assert length_label(1024 * CONTEXT, runs) == "16,384 (1,024x)"  # a report's column heading
