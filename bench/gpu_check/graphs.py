"""graphs: torch._dynamo.explain of the training forward (document masking, the device's attention path) for
every encoding x SSMax: one graph, no graph break."""

import dataclasses

import torch

from bench.gpu_check.common import documents_batch, quick_subset, variant_name
from bench.gpu_check.report import Case, Section
import model as model_module
from model import PE_CHOICES, Transformer


def plan(s):
    variants = quick_subset(s, [("bam", True), ("rope", False)] + [(pe, ssmax) for pe in PE_CHOICES
                                                                    for ssmax in (False, True)])
    # 20 traces, no code generation: ~2 s each
    return [Case(f"forward with doc_ids: {variant_name(pe, ssmax)}", 3,
                 lambda pe=pe, ssmax=ssmax: explain(s, pe, ssmax)) for pe, ssmax in variants]


def explain(s, pe, ssmax):
    m = s.base.model
    cfg = dict(vocab_size=m.vocab_size if s.cuda else 512, n_layer=2, n_head=4, n_embd=128 if s.cuda else 32,
               block_size=256 if s.cuda else 64)
    model = Transformer(dataclasses.replace(m, pe=pe, ssmax=ssmax, **cfg)).to(s.device)
    x, y, doc_ids = documents_batch(2, cfg["block_size"], cfg["vocab_size"], s.device, 0)
    impl = model_module.attention_path(model, x.shape[1], x.shape[1], True)
    torch._dynamo.reset()  # explain counts graphs of this trace only
    explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
    reasons = "; ".join(str(r.reason)[:150] for r in explained.break_reasons)
    return {"ok": explained.graph_count == 1 and explained.graph_break_count == 0, "impl": impl,
            "graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "break_reasons": reasons or "-"}


SECTION = Section("graphs", plan, default=False,
                  what="torch._dynamo.explain of the training forward with doc_ids, every encoding x SSMax: one graph")
