"""prior_tables: model.flex_prior, formula against table. Forward+backward of one attention call as in the
attention section, each distance-only prior (BAM + SSMax first) by formula in the kernel and from its table,
against NoPE on flash at T = 512, 1024, 4096; then the run-to-run spread of BAM + SSMax's prior and SSMax
gradients over repeated backward passes on identical inputs (atomic adds in the kernel's backward make it
nondeterministic). On the GPU both modes run on flex, where they differ: per score the formula's gradient is
added into a few scalars per head, the table's into H x T entries (docs/benchmarks.md, "Prior tables on flex").
CPU quick has no flex backward and runs them on sdpa (the table through table_bias): the code path, not the
numbers. The acceptance run's flex_cost section judges which mode is faster at T = 1,024 (with --all)."""

import torch

from bench.attention import attention_call
from bench.attention import measure as measure_attention
from bench.gpu_check.common import quick_subset, rel_err, static_kernels
from bench.gpu_check.report import Case, Section

TOKENS_PER_CALL = 32768


def plan(s):
    lengths = [64, 128] if s.quick else [512, 1024, 4096]
    impl = "flex" if s.cuda else "sdpa"
    encodings = quick_subset(s, ["bam+ssmax", "bam", "alibi", "kerple_log", "kerple_power"])
    cases = []
    for T in lengths:
        times = {}
        cases.append(Case(f"nope sdpa T={T} (flash, the baseline)", 1 if s.quick else 2,
                          lambda T=T, times=times: timed(s, "nope", "sdpa", T, None, times)))
        # a flex kernel per (prior, mode) with its backward, ~5 s each
        cases += [Case(f"{encoding} {impl} {mode} T={T}", 1 if s.quick else 5,
                       lambda encoding=encoding, mode=mode, T=T, times=times: timed(s, encoding, impl, T, mode, times))
                  for encoding in encodings for mode in ("formula", "table")]
    T = lengths[1]
    cases += [Case(f"bam+ssmax {impl} {mode} T={T}: prior gradients over repeated backward passes",
                   1 if s.quick else 5, lambda mode=mode: gradient_spread(s, impl, T, mode))
              for mode in ("formula", "table")]
    return cases


def timed(s, encoding, impl, T, mode, times):
    dtype = s.bf16 if s.cuda else torch.float32
    batch = max(1, (16 if s.quick else TOKENS_PER_CALL) // T)  # the same tokens per call at every T
    run = attention_call(encoding, impl, T, s.device.type, dtype, True, batch=batch, flex_prior=mode)
    seconds, peak = measure_attention(run, s.device.type, 3 if s.quick else 10)
    times[encoding, mode] = seconds
    flash = times.get(("nope", None))
    formula = times.get((encoding, "formula")) if mode == "table" else None
    return {"impl": impl, "shape": f"{batch}x16x{T}x48", "ms": seconds * 1e3,
            "x_nope_flash": round(seconds / flash, 2) if flash else None,
            "table_x_formula": None if formula is None else round(seconds / formula, 3), "peak_mem_MiB": peak / 2**20}


def gradient_spread(s, impl, T, mode):
    """The same forward+backward repeated on identical inputs: how far the prior's and SSMax's gradients move
    between runs (max |g_r - g_0| / max |g_0| over the parameters), and how many runs equal the first bit for
    bit. Atomic adds in a GPU kernel's backward make the order of a gradient's sums, and so its last bits,
    change from run to run; on the CPU it is 0."""
    dtype = s.bf16 if s.cuda else torch.float32
    run = attention_call("bam+ssmax", impl, T, s.device.type, dtype, True, batch=max(1, 16 // T) if s.quick else 8,
                         flex_prior=mode)
    repeats = 3 if s.quick else 8
    params = run.prior_parameters
    grads = []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        run()
        s.sync()
        grads.append([p.grad.detach().float().clone() for p in params])
    spread = max(rel_err(g, g0) for later in grads[1:] for g, g0 in zip(later, grads[0]))
    identical = sum(all(torch.equal(g, g0) for g, g0 in zip(later, grads[0])) for later in grads[1:])
    return {"parameters": len(params), "repeats": repeats, "max_rel_spread": spread,
            "bitwise_equal_to_first": f"{identical}/{repeats - 1}"}


SECTION = Section("prior_tables", plan, default=False, around=static_kernels,
                  what="formula against table (model.flex_prior) per distance-only prior, fwd+bwd at T = 512, 1024, "
                       "4096; the spread of the prior's gradients over repeated backward passes")
