"""
Peak memory (and time) of one passkey forward pass against the prompt length: it must grow linearly.

    python -m bench.eval_memory                 # CPU: tiny 2K ... 64K, 12-layer 4K ... 16K (~15 min, 2 cores)
    python -m bench.eval_memory --quick         # CPU: tiny 4K ... 32K, 12-layer 4K and 12K (~5 min)
    python -m bench.eval_memory --device cuda --shapes 121m --lengths 16K,64K,256K   # GPU, bf16 autocast

Each measurement runs in a fresh process (random weights; a real passkey prompt from eval.passkey, scored
with the evaluator's own predict_spans), so one length's freed memory cannot hide the next one's peak.
The process first runs two short prompts and builds two large block masks, so that compiling
FlexAttention and its block mask is not counted, then measures one forward at the target length.
Peak memory on CPU is the resident-set high-water mark above the level just before the forward, sampled
every millisecond by a thread (torch keeps no CPU allocator statistics); glibc's mmap threshold is fixed
so that freed blocks leave the resident set. On CUDA it is max_memory_allocated above the weights.
`estimate` is eval.memory.forward_bytes, the number the evaluators' memory guard compares with free memory;
it must stay above `peak`.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from bam.cli import Parser
from bench.peak_memory import PeakMemory, fixed_mmap_threshold, this_command
from eval.loading import autocast, pick_dtype
from eval.memory import forward_bytes
from eval.passkey import PasskeyPrompts
from eval.scoring import predict_spans
from eval.sweep import parse_lengths
from model import ModelConfig, Transformer

SHAPES = {  # configs/tiny.toml's model and the paper's 12-layer model, both BAM + SSMax
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, block_size=128),
    "121m": dict(n_layer=12, n_embd=768, n_head=16, block_size=512),
}
DEFAULT_LENGTHS = {"tiny": "2K,4K,8K,16K,32K,64K", "121m": "4K,8K,12K,16K"}
QUICK_LENGTHS = {"tiny": "4K,8K,16K,32K", "121m": "4K,12K"}


def measure(shape, length, device_name, impl):
    """Runs in the child process: one passkey forward at `length`, returns a dict of numbers."""
    torch.manual_seed(0)
    device = torch.device(device_name)
    model = Transformer(ModelConfig(pe="bam", ssmax=True, attn_impl=impl, **SHAPES[shape])).to(device).eval()
    amp = autocast(device, pick_dtype("auto", device))
    prompts = PasskeyPrompts()
    for warm in (256, 384):  # compile flex for a static, then a dynamic length
        predict_spans(model, [prompts.build(warm, 0.5, 12345)], amp)
    sample = prompts.build(length, 0.5, 12345)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        predict_spans(model, [sample], amp)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    peak = mem.bytes
    scored = len(sample.tokens) - sample.spans[0][0]
    return {"shape": shape, "length": length, "peak": peak, "seconds": seconds,
            "estimate": forward_bytes(model, 1, length, scored), "n_embd": model.config.n_embd}


def main():
    ap = Parser(prog="python -m bench.eval_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default="tiny,121m")
    ap.add_argument("--lengths", default=None, help="for every shape (default: per shape, see above)")
    ap.add_argument("--impl", default="flex", help="attention implementation (default flex: the long-context path)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    fixed_mmap_threshold()  # re-executes this script: after its arguments are known to be good
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.device, args.impl)))
        return


    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    print(f"# passkey forward: peak memory vs length, {args.impl} attention, torch {torch.__version__}, {where}\n")
    print("| shape | length | peak MiB | x previous | bytes / (token x n_embd) | estimate MiB | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        spec = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)[shape]
        previous = None
        for length in parse_lengths(spec, SHAPES[shape]["block_size"]):
            cmd = [sys.executable, *this_command(), "--device", args.device, "--impl", args.impl,
                   "--child", shape, str(length)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                reason = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
                print(f"| {shape} | {length:,} | failed: {reason} | | | | |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            ratio = f"{r['peak'] / previous:.2f}" if previous else "—"
            per = r["peak"] / (r["length"] * r["n_embd"])
            print(f"| {shape} | {length:,} | {r['peak'] / 2**20:,.0f} | {ratio} | {per:.1f} | "
                  f"{r['estimate'] / 2**20:,.0f} | {r['seconds']:.1f} |", flush=True)
            previous = r["peak"]


if __name__ == "__main__":
    main()
