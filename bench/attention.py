"""
Attention cost per positional encoding and implementation, side by side in one run.

    python -m bench.attention                 # CPU: the issue's grid (a few minutes on 2 cores)
    python -m bench.attention --quick         # smaller grid
    python -m bench.attention --device cuda   # GPU, bf16; absolute times are only meaningful there

Part 1: forward+backward time (sdpa also as it runs inside a compiled model) and peak memory of one attention call with the paper's 12-layer head
shapes (16 heads of 48), for T = 512 ... 4096, as ratios against NoPE on `sdpa` (flash) at the same T.
FlexAttention has no backward on CPU, so there flex is timed forward-only (marked "fwd").
Part 2: forward-only peak memory of flex for T = 4K ... 64K: it must grow linearly (x2 per doubling).
Part 3: sliding-window attention (`attn_window`) on flex, forward only, for T = 8K ... 64K: time and
memory against full causal flex at the same T, for W = 128, 512, 2048. The window's BlockMask skips
every block outside the band, so time grows as T x W (not T^2) and memory must not grow with W.
Part 4: prior tables (model.flex_prior) on flex, forward only, for T = 1K, 4K, 16K: each distance-only prior
(and BAM with SSMax) read by formula per score and gathered from its per-head table, as time ratios against
NoPE on flex at the same T and mask (causal, documents, window), all in one run.
Peak memory on CPU is the resident-set high-water mark above the level before the call, sampled by a
thread every millisecond (torch keeps no CPU allocator statistics); on CUDA it is max_memory_allocated.
"""

import argparse
import dataclasses
import os
import statistics
import time

import torch

from bam.cli import Parser
from bam.ranges import number
from bench.peak_memory import PeakMemory, fixed_mmap_threshold
from model import (ATTENTION, ENCODINGS, PRIORS, AttnContext, ModelConfig, apply_rope, dense_mask, distance_table,
                   layer_prior, make_block_mask, positions_in_documents, ssmax_log_n, table_bias)

H, HD = 16, 48  # the paper's 12-layer model: 768 wide, 16 heads
# Every registered encoding that changes attention (NoPE as the baseline, those that rotate q and k, every
# additive prior), and every prior with SSMax; sinusoidal acts on the embeddings only, so it costs as NoPE.
VARIANTS = ["nope"] + [name for name, enc in ENCODINGS.items() if enc.rotation is not None] \
    + [f"{name}{ssmax}" for name in PRIORS for ssmax in ("", "+ssmax")]
# The sdpa path as it runs inside a torch.compile'd model (train.compile = true): inductor fuses the
# dense bias's elementwise passes.
COMPILED_SDPA = torch.compile(ATTENTION["sdpa"])
# Part 4: the priors flex may read from a table (AdditivePrior.DISTANCE_ONLY), and BAM with SSMax's table too.
TABLE_VARIANTS = [name for name, enc in PRIORS.items() if enc.DISTANCE_ONLY] + ["bam+ssmax"]
TABLE_MASKS = ("causal", "documents", "window")
TABLE_WINDOW = 512


def setup(encoding, T, device, dtype, requires_grad, window=0, batch=1):
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, H, T, HD, device=device, dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    pos = torch.arange(T, device=device)
    name, ssmax = encoding.removesuffix("+ssmax"), encoding.endswith("+ssmax")
    log_n = ssmax_log_n(pos[None], window) if ssmax else None
    cfg = ModelConfig(n_head=H, n_embd=H * HD, pe=name)
    prior = ENCODINGS[name](cfg).to(device) if name in PRIORS else None  # its tensors() are taken per call
    scale = torch.ones(H, device=device, requires_grad=True) if ssmax else None
    rotation = ENCODINGS[name].rotation
    rope = rotation(pos, cfg) if rotation is not None else None
    # A prior with token features (FIRE, FoX) computes them from the layer's input: one of the paper's width
    x = torch.randn(batch, T, H * HD, device=device) if prior is not None and not prior.DISTANCE_ONLY \
        else None
    return q, k, v, pos, log_n, prior, scale, rope, x


def documents(batch, T, device):
    """(batch, T) ids of four documents of uneven length per row, no boundary on a 128-token block."""
    starts = torch.zeros(T, dtype=torch.long)
    starts[[int(T * f) + 1 for f in (0.23, 0.5, 0.81)]] = 1
    return starts.cumsum(0).expand(batch, -1).to(device)


def attention_call(encoding, impl, T, device, dtype, backward, window=0, batch=1, docs=False, flex_prior=None):
    """One attention call as a layer of the model makes it, as a function that runs it; its `prior_parameters`
    are what the backward writes the prior's and SSMax's gradients into. With flex_prior = "table" the prior's
    table is built inside the call, as Transformer builds it once per forward (SSMax's is built by the flex
    kernel call); a dense path given "table" reads it through table_bias like any bias function. None: as the
    model runs it (ModelConfig's default on flex, the formula on the dense paths)."""
    q, k, v, pos, log_n, prior, scale, rope, x = setup(encoding, T, device, dtype, backward, window, batch)
    doc_ids = documents(batch, T, device) if docs else None
    if docs and log_n is not None:
        log_n = ssmax_log_n(positions_in_documents(doc_ids), window)
    if impl == "flex":
        mask = make_block_mask(doc_ids, T, device, window)
    elif impl.startswith("sdpa") and prior is None and scale is None and not window and not docs:
        mask = None  # causal and nothing else: the flash kernel, as the model runs it (Transformer._mask)
    else:
        mask = dense_mask(pos, pos, window, doc_ids)
    attend = ATTENTION[impl] if impl != "sdpa+compile" else COMPILED_SDPA
    pos_in_doc = pos[None] if doc_ids is None else positions_in_documents(doc_ids)
    ctx = AttnContext(impl.split("+")[0], pos, pos, mask, log_n, rope, pos_in_doc=pos_in_doc)
    if flex_prior is None:
        flex_prior = ModelConfig.flex_prior if impl == "flex" else "formula"
    tabulated = flex_prior == "table"

    @torch.set_grad_enabled(backward)
    def run():
        qq, kk = (apply_rope(q, *rope), apply_rope(k, *rope)) if rope is not None else (q, k)
        # the prior's token features are part of its cost: computed (and differentiated) in every call
        call_prior, features = layer_prior(prior, x, ctx)
        call_ctx = ctx
        if tabulated and features is None:  # a prior with token features is never tabulated (model.py)
            length = mask.seq_lengths[0] if impl == "flex" else T  # flex's padded length on a CPU
            table = None if prior is None else distance_table(call_prior, H, length, device)
            call_prior = None if prior is None else (table_bias, (table,))
            call_ctx = dataclasses.replace(ctx, uses_prior_tables=True)
        y = attend(qq, kk, v, call_ctx, call_prior, scale, features)
        if backward:
            y.float().sum().backward()
        return y

    run.prior_parameters = [p for p in (prior.parameters() if prior is not None else ()) if p.requires_grad] \
        + ([scale] if scale is not None else [])
    return run


def timed(run, device):
    """Seconds of one call of `run` (on a GPU, from an idle stream to its end)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(run, device, repeats):
    run()  # warm-up (and compile, for flex)
    times = [timed(run, device) for _ in range(repeats)]
    with PeakMemory(device) as mem:
        run()
    return statistics.median(times), mem.bytes


def main():
    ap = Parser(prog="python -m bench.attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="T = 512, 1024 and 4K ... 16K only")
    ap.add_argument("--repeats", type=number(int, ">= 1, <= 1000"), default=3)
    ap.add_argument("--lengths", default=None, help="comma-separated T for part 1 (default 512 ... 4096); '' skips it")
    ap.add_argument("--long_lengths", default=None, help="comma-separated T for part 2; '' skips it")
    ap.add_argument("--encodings", default=",".join(VARIANTS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--window_lengths", default=None, help="comma-separated T for part 3; '' skips it")
    ap.add_argument("--windows", default="128,512,2048", help="comma-separated W for part 3 (default: %(default)s)")
    ap.add_argument("--table_lengths", default=None, help="comma-separated T for part 4 (default 1024,4096,16384); "
                                                          "'' skips it")
    ap.add_argument("--table_encodings", default=",".join(TABLE_VARIANTS),
                    help="comma-separated priors for part 4 (default: %(default)s)")
    ap.add_argument("--table_masks", default=",".join(TABLE_MASKS),
                    help=f"comma-separated masks for part 4 (default: %(default)s; window = {TABLE_WINDOW} tokens)")
    args = ap.parse_args()
    fixed_mmap_threshold()  # re-executes this script: after its arguments are known to be good
    encodings = args.encodings.split(",")
    if any(not w.strip().isdigit() or int(w) < 1 for w in args.windows.split(",") if w):
        ap.error(f"--windows takes positive integers, got {args.windows!r}")
    unknown = [e for e in encodings if e not in VARIANTS]
    if unknown:
        ap.error(f"unknown encoding(s) {', '.join(unknown)}; allowed: {', '.join(VARIANTS)}")
    unknown = [e for e in args.table_encodings.split(",") if e not in TABLE_VARIANTS]
    if unknown:
        ap.error(f"--table_encodings: unknown {', '.join(unknown)}; allowed: {', '.join(TABLE_VARIANTS)}")
    unknown = [m for m in args.table_masks.split(",") if m not in TABLE_MASKS]
    if unknown:
        ap.error(f"--table_masks: unknown {', '.join(unknown)}; allowed: {', '.join(TABLE_MASKS)}")
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"# attention, 1 x {H} heads x {HD}, {dtype}, torch {torch.__version__}, {where}\n")

    lengths = [512, 1024] if args.quick else [512, 1024, 2048, 4096]
    if args.lengths is not None:
        lengths = [int(t) for t in args.lengths.split(",") if t]
    impls = ["sdpa", "sdpa+compile", "flex", "eager"]
    if lengths:
        print("## forward + backward (flex forward only on CPU): time and peak memory, ratios vs nope/sdpa\n")
        print("| T | encoding | impl | pass | ms | x nope | peak MiB | x nope |")
        print("|---|---|---|---|---|---|---|---|")
    for T in lengths:
        base = None
        for encoding in encodings:
            for impl in impls:
                if (impl == "eager" and T > 4096) or (impl == "sdpa+compile" and encoding not in PRIORS and
                                                      not encoding.endswith("+ssmax")):
                    continue  # without a prior or SSMax, sdpa is one flash call already
                backward = not (impl == "flex" and device == "cpu")
                t, mem = measure(attention_call(encoding, impl, T, device, dtype, backward), device, args.repeats)
                if base is None:
                    base = (t, max(mem, 1))
                fb = "fwd+bwd" if backward else "fwd"
                print(f"| {T} | {encoding} | {impl} | {fb} | {t * 1e3:.1f} | {t / base[0]:.2f} | "
                      f"{mem / 2**20:.1f} | {mem / base[1]:.2f} |", flush=True)

    long_lengths = [4096, 8192, 16384] if args.quick else [4096, 8192, 16384, 32768, 65536]
    if args.long_lengths is not None:
        long_lengths = [int(t) for t in args.long_lengths.split(",") if t]
    if long_lengths:
        print("\n## forward only, long context: peak memory must grow linearly with T\n")
        print("| T | encoding | impl | ms | peak MiB | x previous T |")
        print("|---|---|---|---|---|---|")
    for encoding, impl in [("nope", "sdpa"), ("bam+ssmax", "flex")] if long_lengths else []:
        prev = None
        for T in long_lengths:
            with torch.no_grad():
                t, mem = measure(attention_call(encoding, impl, T, device, dtype, False), device, 1)
            growth = f"{mem / prev:.2f}" if prev else "-"
            prev = max(mem, 1)
            print(f"| {T} | {encoding} | {impl} | {t * 1e3:.1f} | {mem / 2**20:.1f} | {growth} |", flush=True)
    window_part(args, device, dtype)
    table_part(args, device, dtype)


def window_part(args, device, dtype):
    """Part 3: sliding window against full causal, both on flex, forward only, measured side by side."""
    lengths = [8192, 16384] if args.quick else [8192, 16384, 32768, 65536]
    if args.window_lengths is not None:
        lengths = [int(t) for t in args.window_lengths.split(",") if t]
    windows = [int(w) for w in args.windows.split(",") if w]
    if not lengths:
        return
    print("\n## forward only, sliding window vs full causal on flex (bam+ssmax)\n")
    print("| T | window | ms | x full causal | peak MiB | x full causal |")
    print("|---|---|---|---|---|---|")
    for T in lengths:
        with torch.no_grad():
            full_t, full_mem = measure(attention_call("bam+ssmax", "flex", T, device, dtype, False), device, 1)
            print(f"| {T} | full | {full_t * 1e3:.1f} | 1.00 | {full_mem / 2**20:.1f} | 1.00 |", flush=True)
            for W in windows:
                t, mem = measure(attention_call("bam+ssmax", "flex", T, device, dtype, False, W), device, 1)
                print(f"| {T} | {W} | {t * 1e3:.1f} | {t / full_t:.3f} | {mem / 2**20:.1f} | "
                      f"{mem / max(full_mem, 1):.2f} |", flush=True)


def table_part(args, device, dtype):
    """Part 4: formula against table on flex, forward only, each against NoPE flex under the same mask and T.
    The three calls (NoPE, formula, table) are timed in turn, `repeats` rounds, so that a change in the
    machine's load hits all three alike; each ratio is the median of the per-round ratios."""
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    if args.table_lengths is not None:
        lengths = [int(t) for t in args.table_lengths.split(",") if t]
    if not lengths:
        return
    print(f"\n## forward only, prior tables on flex: formula vs table, ratios vs nope/flex (window = {TABLE_WINDOW}, "
          f"medians of {args.repeats} rounds)\n")
    print("| T | mask | encoding | nope ms | formula ms | table ms | formula x nope | table x nope | table / formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in lengths:
        for mask in args.table_masks.split(","):
            shape = dict(window=TABLE_WINDOW if mask == "window" else 0, docs=mask == "documents")
            for encoding in args.table_encodings.split(","):
                with torch.no_grad():
                    runs = [attention_call("nope", "flex", T, device, dtype, False, **shape)] + [
                        attention_call(encoding, "flex", T, device, dtype, False, flex_prior=mode, **shape)
                        for mode in ("formula", "table")]
                    times = list(zip(*(interleaved(runs, device, args.repeats))))  # (nope, formula, table) per round
                nope, formula, table = (statistics.median(t[i] for t in times) for i in range(3))
                ratio = [statistics.median(t[i] / t[j] for t in times) for i, j in ((1, 0), (2, 0), (2, 1))]
                print(f"| {T} | {mask} | {encoding} | {nope * 1e3:.1f} | {formula * 1e3:.1f} | {table * 1e3:.1f} | "
                      f"{ratio[0]:.2f} | {ratio[1]:.2f} | {ratio[2]:.2f} |", flush=True)


def interleaved(runs, device, repeats):
    """Each run's time in `repeats` rounds that call every run once in turn (after one warm-up call each)."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, spent in zip(runs, times):
            spent.append(timed(run, device))
    return times


if __name__ == "__main__":
    main()
