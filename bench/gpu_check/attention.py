"""attention: forward+backward of one attention call, the 12-layer model's heads (16 x 48), bf16, 32K tokens per
call: RoPE, ALiBi and BAM + SSMax against NoPE on flash (sdpa) at T = 512, 1024, 4096, each kernel compiled for
its static shape. The acceptance run's flex_cost section times T = 1,024 alone and judges it."""

import torch

from bench.attention import attention_call
from bench.attention import measure as measure_attention
from bench.gpu_check.common import static_kernels
from bench.gpu_check.report import Case, Section

TOKENS_PER_CALL = 32768


def plan(s):
    lengths = [64, 128] if s.quick else [512, 1024, 4096]
    # The GPU trains priors on flex; CPU quick uses sdpa throughout (flex has no backward there).
    rows = [("nope", "sdpa"), ("rope", "sdpa"), ("nope", "flex"), ("alibi", "flex"), ("bam+ssmax", "flex")]
    rows = list(dict.fromkeys((enc, impl if s.cuda else "sdpa") for enc, impl in rows))
    cases = []
    for T in lengths:
        base = {}
        # a flex kernel per (encoding, T) with its backward, ~5 s each; timing is milliseconds
        cases += [Case(f"{encoding} {impl} T={T}", 1 if s.quick else 5,
                       lambda encoding=encoding, impl=impl, T=T, base=base: timed(s, encoding, impl, T, base))
                  for encoding, impl in rows]
    return cases


def timed(s, encoding, impl, T, base):
    dtype = s.bf16 if s.cuda else torch.float32
    batch = max(1, (16 if s.quick else TOKENS_PER_CALL) // T)  # the same tokens per call at every T
    run = attention_call(encoding, impl, T, s.device.type, dtype, True, batch=batch)
    seconds, peak = measure_attention(run, s.device.type, 3 if s.quick else 10)
    if encoding == "nope" and impl == "sdpa":
        base["t"] = seconds
    ratio = seconds / base["t"] if "t" in base else None
    return {"impl": impl, "shape": f"{batch}x16x{T}x48", "ms": seconds * 1e3,
            "x_nope_flash": None if ratio is None else round(ratio, 2), "peak_mem_MiB": peak / 2**20}


SECTION = Section("attention", plan, default=False, around=static_kernels,
                  what="one attention call fwd+bwd, RoPE, ALiBi, BAM + SSMax against NoPE flash at T = 512, 1024, 4096")
