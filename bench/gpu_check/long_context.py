"""long_context: the evaluators' forward (predict_spans) of the 121M model at lengths as eval.passkey sweeps them,
4K to 256,000 tokens (64K and 128K on request): time, memory and the compilations each length caused. Then
whether flex is still right that far: BAM + SSMax in table mode, one attention call (16 heads of 48), at ~64K and
~256K tokens with and without a document mask, flex's output for a few query rows (the last ones, a document's
first, one in the middle of a document) against the same rows computed densely in plain torch, in float64, from
the same inputs (a row against all keys is O(T) memory). Index arithmetic in compiled attention kernels has
overflowed int32 past ~46K tokens (B x Tq x Tk > 2^31: pytorch#146724, NeMo-Automodel PR#3802's mask-table
lookup), and tables captured by a score_mod have been read out of bounds on masked lanes (pytorch PR#188178):
the lengths are not multiples of flex's 128-token blocks, so the last block has masked lanes."""

import dataclasses
import math
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

from bench.attention import documents
from bench.gpu_check.common import BF16_FLOOR, FP32_TOL, dtype_name, fp32_reference_precision, rel_err
from bench.gpu_check.report import Case, Section, compile_counts, now
from eval.scoring import Sample, predict_spans
import model as model_module
from model import (ATTENTION, ENCODINGS, AttnContext, ModelConfig, Transformer, distance_table, flex_mask_length,
                   flex_mask_mod, make_block_mask, positions_in_documents, ssmax_log_n, table_bias)

SWEEP_RECOMPILES = "passkey sweep: graphs compiled after its second length"
SWEEP_LAST = "passkey forward at the sweep's last length (256,000 tokens)"
ROW_HEADS, ROW_HEAD_DIM = 16, 48  # the 121M model's attention


def plan(s):
    return sweep_cases(s) + rows_cases(s)


# ---------------------------------------------------------------------------------------------------
# The passkey sweep


def sweep_cases(s):
    """Flex is compiled for the first length and once more, with a dynamic length, for the second; a later
    length that compiles again costs every sweep that much."""
    m = s.base.model
    if s.quick:  # auto picks sdpa up to 2K tokens on CPU: no flex compilation in CI
        model_cfg = dataclasses.replace(m, n_layer=2, n_embd=32, n_head=2, vocab_size=512)
        lengths, opt_in = [256, 1000, 2000], ()
    else:
        model_cfg, lengths, opt_in = m, [4000, 16000, 64000, 128000, 256000], (64000, 128000)
    planned = [length for length in lengths if s.all or length not in opt_in]
    state = {}

    def case(length):
        if "model" not in state:
            torch.manual_seed(0)
            state["model"] = Transformer(dataclasses.replace(model_cfg, attn_impl="auto")).to(s.device).eval()
        model = state["model"]
        # token values do not change the cost; the last five tokens are the "answer"
        prompt = Sample(np.random.default_rng(length).integers(0, model_cfg.vocab_size - 1, length + 1),
                        [(length - 4, length + 1)])
        counts = compile_counts()
        with s.peak_memory() as mem:
            s.sync()
            t0 = now()
            predict_spans(model, [prompt], s.autocast(s.bf16 if s.cuda else torch.float32))
            s.sync()
            seconds = now() - t0
        detail = {"impl": model_module.attention_path(model, length, length, False), "tokens": length,
                  "seconds": seconds, "peak_mem_GiB": mem.bytes / 2**30, **compile_counts(since=counts)}
        if length == planned[-1]:
            state.clear()
            sweep_targets(s, planned, detail)
        return detail

    # the first two lengths compile (~12 s on a GPU); 256,000 tokens are ~1.3 PFLOP of attention (~8 s)
    return [Case(f"passkey forward {length:,} tokens",
                 1 if s.quick else (12 if i < 2 else 1 + 8 * (length / lengths[-1]) ** 2),
                 lambda length=length: case(length), opt_in=length in opt_in,
                 targets=(SWEEP_RECOMPILES, SWEEP_LAST) if length == lengths[-1] else ())
            for i, length in enumerate(lengths)]


def sweep_targets(s, lengths, last):
    """The targets, at the last length: its time, and the graphs compiled after the second length (its own
    counted in `last`, the earlier ones as recorded)."""
    s.report.target(SWEEP_LAST, f"{last['seconds']:.1f} s", "< 60 s at 256K, 121M model", last["seconds"] < 60)
    earlier = [c for c in s.report.cases if c["section"] == s.report.section and c["name"].startswith("passkey")]
    if len(earlier) == len(lengths) - 1 and all(c["status"] == "pass" for c in earlier):
        graphs = [c["compiled_graphs"] for c in earlier] + [last["compiled_graphs"]]
        s.report.target(SWEEP_RECOMPILES, f"{sum(graphs[2:])} (all lengths: {sum(graphs)})", "0",
                        sum(graphs[2:]) == 0)


# ---------------------------------------------------------------------------------------------------
# Flex's rows against dense rows at long lengths


def rows_cases(s):
    # GPU: past 46K and at 256K, each 100 tokens into a last, partial block of 128. CPU (--quick): whole blocks,
    # since a CPU pads flex's input to them (model.flex_mask_length) and the comparison reads no padding.
    lengths = (384, 640) if s.quick else (64_100, 256_100)
    cases = []
    for T in lengths:
        for docs in (False, True):
            for dtype in (s.bf16, torch.float32):
                # bf16: the paper's evaluation; the sweep compiled this kernel, a document mask compiles it again
                # (and builds its BlockMask compiled); fp32 compiles it once more
                expected = 1 if s.quick else (4 if T == lengths[0] and not docs else 3) + \
                    (12 if docs and T == lengths[0] else 0) + (10 if dtype == torch.float32 and T == lengths[0] else 0)
                cases.append(Case(f"flex rows vs dense at {T:,} tokens: bam+ssmax table{' docs' if docs else ''} "
                                  f"{dtype_name(dtype)}", expected, lambda T=T, docs=docs, dtype=dtype:
                                  rows_case(s, T, docs, dtype), opt_in=dtype == torch.float32))
    return cases


def rows_case(s, T, docs, dtype):
    device = s.device
    g = torch.Generator(device="cpu").manual_seed(T)
    H = ROW_HEADS if s.cuda else 4
    q, k, v = (torch.randn(1, H, T, ROW_HEAD_DIM, generator=g) for _ in range(3))
    q *= torch.linspace(0.2, 1.0, H)[:, None, None]  # some heads diffuse over many keys, others sharp on a few
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    doc_ids = documents(1, T, device) if docs else None
    prior, scale = gentle_bam(H, device)
    with fp32_reference_precision() if dtype == torch.float32 else nullcontext(), torch.no_grad():
        out = flex_table_attention(q, k, v, prior, scale, doc_ids)
        rows = query_rows(T, doc_ids)
        got = out[0, :, rows].double().cpu()
        ref = dense_rows(q, k, v, rows, prior, scale, doc_ids).cpu()
    errors = [rel_err(got[h], ref[h]) for h in range(H)]
    tol = FP32_TOL if dtype == torch.float32 else BF16_FLOOR
    worst = max(range(H), key=lambda h: errors[h])
    return {"ok": errors[worst] <= tol, "rows": ", ".join(f"{r:,}" for r in rows), "worst_rel_err": errors[worst],
            "worst_head": worst, "tol": tol, "heads": H}


def gentle_bam(H, device):
    """BAM's prior (the formula and its tensors) with shapes from -0.5 (far keys preferred) to 1 (ALiBi-like)
    and SSMax scales off 1: at ALiBi's init every head would see only its last few hundred keys, and a wrong
    value far away would not show."""
    module = ENCODINGS["bam"](ModelConfig(n_head=H, n_embd=H * ROW_HEAD_DIM, pe="bam"))
    with torch.no_grad():
        module.shape.copy_(torch.linspace(-0.5, 1.0, H))
        module.log_scale.copy_(torch.linspace(math.log(0.02), math.log(0.3), H))
        module.loc.copy_(torch.linspace(-0.1, 0.1, H))
    module.to(device)
    return (module.bias_fn, module.tensors()), torch.linspace(0.6, 1.4, H, device=device)


def flex_table_attention(q, k, v, prior, scale, doc_ids):
    """model.py's flex path with the prior read from its distance table and SSMax's factor from its table, as
    Transformer runs it with flex_prior = "table". A document BlockMask is built without evaluating the T x T
    mask on a GPU (create_block_mask compiled), which model.make_block_mask would."""
    T, device = q.shape[2], q.device
    if flex_mask_length(T, device) != T:
        raise ValueError(f"{T} tokens: flex pads them on {device.type}; use a multiple of 128 here")
    pos = torch.arange(T, device=device)
    if doc_ids is None:
        mask, pos_in_doc = make_block_mask(None, T, device), pos[None]
    else:
        mask = create_block_mask(flex_mask_mod(0, doc_ids), 1, None, T, T, device=device,
                                 _compile=device.type == "cuda")
        pos_in_doc = positions_in_documents(doc_ids)
    ctx = AttnContext("flex", pos, pos, mask, ssmax_log_n(pos_in_doc), None, pos_in_doc=pos_in_doc,
                      uses_prior_tables=True)
    table = distance_table(prior, q.shape[1], T, device)
    return ATTENTION["flex"](q, k, v, ctx, (table_bias, (table,)), scale)


def query_rows(T, doc_ids):
    """The last two queries and one in the middle; with documents, the last document's first token and the
    middle of the document that holds position T / 2."""
    if doc_ids is None:
        return [T // 2, T - 2, T - 1]
    doc = doc_ids[0].cpu()
    middle_doc = (doc == doc[T // 2]).nonzero()[:, 0]
    last_start = int((doc == doc[-1]).nonzero()[0, 0])
    return sorted({int(middle_doc[len(middle_doc) // 2]), last_start, T - 2, T - 1})


def dense_rows(q, k, v, rows, prior, scale, doc_ids):
    """Attention of the query `rows` over every key, in float64 plain torch from the same inputs: softmax over
    the keys j <= i of i's document of (q_i.k_j / sqrt(d) + g_h(i - j)) * s_h log n_i, n_i the keys i sees;
    (H, rows, d). Only the prior's formula comes from model.py (its bias function)."""
    i = torch.tensor(rows, device=k.device)
    q, k, v = q[0, :, i].double(), k[0].double(), v[0].double()
    H, T, d = k.shape
    j = torch.arange(T, device=k.device)
    doc = torch.zeros(T, dtype=torch.long, device=k.device) if doc_ids is None else doc_ids[0]
    same = doc[None, :] == doc[i][:, None]  # (rows, T)
    seen = same & (j[None, :] <= i[:, None])
    first = torch.where(same, j[None, :], T).min(dim=1).values  # the first token of i's document
    bias_fn, tensors = prior
    head = torch.arange(H, device=k.device)[:, None, None]
    bias = bias_fn((i[:, None] - j[None, :]).double(), head, *(t.detach().double() for t in tensors))
    factor = scale.double()[:, None, None] * torch.log((i - first + 1).double())[None, :, None]
    logits = (q @ k.transpose(1, 2) / math.sqrt(d) + bias) * factor
    return logits.masked_fill(~seen, -math.inf).softmax(dim=-1) @ v


SECTION = Section("long_context", plan, default=True,
                  what="the passkey forward of the 121M model from 4K to 256,000 tokens; flex's rows against dense "
                       "rows at ~64K and ~256K tokens, BAM + SSMax table, with and without documents")
