"""correctness: the whole model under torch.compile against eager (fp32; bf16 on request), as train.compile = true
runs it, flex inside on a GPU. On request (--all), the grid: flex (its compiled kernel) against eager for every
encoding of model.ENCODINGS and each of its checked_settings x SSMax x document masking, forward and backward,
the gradient of every parameter (prior and SSMax included), fp32 and bf16 autocast; the priors that read token
features (FIRE, FoX) first; every encoding once more with learned sinks and gates; then the per-layer patterns.
The whole grid takes ~15 minutes of a GPU: --sections correctness --all. On a CPU flex has no backward: the
grid compares sdpa forward+backward with eager, and flex forward once."""

from contextlib import nullcontext

import torch

import model as model_module
from bench.gpu_check.common import (ATTENTION_SWITCHES, LAYER_PATTERNS, compare, correctness_batch, correctness_model,
                                    dtype_name, forward_backward, fp32_reference_precision, gradients,
                                    path_against_eager, variant_name)
from bench.gpu_check.report import Case, Section


def plan(s):
    dtypes = [torch.float32] + ([s.bf16] if s.bf16 else [])
    impl = "flex" if s.cuda else "sdpa"
    cases = [Case(f"torch.compile(model) {impl} bam+ssmax docs {dtype_name(dtype)}", 10 if s.quick else 40,
                  lambda dtype=dtype: compiled_model_case(s, dtype), opt_in=dtype != torch.float32)
             for dtype in dtypes]
    return cases + grid_cases(s, dtypes) + pattern_cases(s, dtypes)


def compiled_model_case(s, dtype):
    model = correctness_model(s, "bam", True)
    batch = correctness_batch(s, True)
    ref = forward_backward(model, "eager", batch, nullcontext(), True)
    low = forward_backward(model, "eager", batch, s.autocast(dtype), True) if dtype != torch.float32 else None
    compiled = torch.compile(model, backend=s.compile_backend)
    x, y, doc_ids = batch
    model.config.attn_impl = "flex" if s.cuda else "sdpa"
    model.zero_grad(set_to_none=True)
    with s.autocast(dtype):
        logits, loss = compiled(x, y, doc_ids=doc_ids)
    loss.backward()
    got = {"logits": logits.float(), "loss": loss.float(), **gradients(model)}
    return {"pass": f"fwd+bwd, {s.compile_backend}", **compare(got, ref, low)}


def order(pe):
    """Where an encoding's cases come in the grid: the priors that read token features (flex differentiates
    through tensors indexed at the query and at the key: the hardest backward, FIRE and FoX) first, then the
    other additive priors, then the encodings without a score_mod. From the registry, never by name."""
    encoding = model_module.ENCODINGS[pe]
    additive = issubclass(encoding, model_module.AdditivePrior)
    return (not additive) + (additive and encoding.DISTANCE_ONLY)


def grid_cases(s, dtypes):
    """Document masking first (the training configuration). --quick: document masking on only
    (tests/model/test_attention_paths.py covers the rest). Every encoding, and each of its checked_settings
    (partial RoPE), from the registry; every encoding also runs with the ATTENTION_SWITCHES on (with SSMax
    and documents, the richest case)."""
    grid = [(pe, ssmax, docs, dtype, settings, ()) for pe, settings in model_module.CHECKED_SETTINGS
            for ssmax in (True, False) for docs in ((True,) if s.quick else (True, False)) for dtype in dtypes]
    grid += [(pe, True, True, dtype, {}, ATTENTION_SWITCHES) for pe in model_module.ENCODINGS for dtype in dtypes]
    grid.sort(key=lambda c: (not c[2], order(c[0]), not c[1], bool(c[5])))
    cases = []
    for pe, ssmax, docs, dtype, settings, switches in grid:
        impls = [("flex", True)] if s.cuda else [("sdpa", True)]
        if not s.cuda and (pe, ssmax, docs, dtype, settings, switches) == ("bam", True, True, torch.float32, {}, ()):
            impls.append(("flex", False))  # a CPU's flex has no backward: one case, the richest one
        for impl, backward in impls:
            def case(pe=pe, ssmax=ssmax, docs=docs, dtype=dtype, impl=impl, backward=backward, settings=settings,
                     switches=switches):
                model = correctness_model(s, pe, ssmax, settings=settings, switches=switches)
                return path_against_eager(s, model, impl, docs, dtype, backward)
            name = f"{impl} {variant_name(pe, ssmax, settings)}{' docs' if docs else ''} {dtype_name(dtype)}" + \
                "".join(f" {switch}" for switch in switches)
            # a flex kernel per variant: ~10 s of Triton with its backward
            cases.append(Case(name, 1 if impl != "flex" or not s.cuda else 10, case, opt_in=True))
    return cases


def pattern_cases(s, dtypes):
    """The per-layer patterns, with document masking: the device's path (sdpa on a CPU) against eager."""
    impl = "flex" if s.cuda else "sdpa"

    def case(kw, dtype):
        return path_against_eager(s, correctness_model(s, **kw), impl, True, dtype, True)
    # two flex kernels a pattern, each with its backward
    return [Case(f"{impl} pattern {pattern} docs {dtype_name(dtype)}", 20 if s.cuda else 1,
                 lambda kw=kw, dtype=dtype: case(kw, dtype), opt_in=True)
            for pattern, kw in LAYER_PATTERNS.items() for dtype in dtypes]


SECTION = Section("correctness", plan, default=True, around=lambda s: fp32_reference_precision(),
                  what="the 2-layer model under torch.compile against eager, fwd+bwd, fp32 (the grid of every "
                       "encoding on request)")
