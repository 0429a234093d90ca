"""
One command that proves the GPU path before a long run: the compiled bf16 training step of the paper's model
against its targets, train.py itself under torchrun (DDP, FSDP, FSDP + activation checkpointing, each
validated, checkpointed and resumed), a passkey sweep to 256,000 tokens, and FlexAttention's compiled forward
and backward against the eager reference for every encoding. It writes OUT/gpu_check.md and OUT/gpu_check.json.

    python -m bench.gpu_check --out runs/gpu_check                  # one GPU: the acceptance run, < 8 min
    python -m bench.gpu_check --device cpu --quick --out /tmp/gc    # every code path but CUDA's, tiny shapes
    python -m bench.gpu_check --out runs/gpu_check --sections correctness --budget_s 900   # a part, more time

GPU time is scarce, so the script cannot stop halfway: every case runs in its own try/except and a
failure is recorded under the case's name (its error in one line) before the next case starts; both files
are rewritten after every case, so a run killed at its time limit still leaves what it measured. The run
has a time budget (the sum of its sections' budgets unless --budget_s says otherwise), split over the
sections in proportion to SECTIONS; unused time passes on to the next section, a case that would not fit
in what is left is recorded as skipped rather than started, and a case that runs past its own limit
(twice its expected time, at least 30 s more, never past the end of the budget) is stopped and recorded as
failed. Every case records the dynamo compilations it caused: graphs compiled, recompiles (as
TORCH_LOGS=recompiles logs them) and graph breaks; train.py runs log theirs through TORCH_LOGS. The exit
status is 1 when any case failed.

Sections, in the order they run (the first four are the acceptance run, the default on a GPU):
  training      the paper's model (configs/paper/*_512.toml shapes) compiled, bf16 autocast, flex: BAM + SSMax
                first, then RoPE (the throughput target compares them), then the others while time is left:
                tokens/s, MFU, peak memory, compile time, whether the loss falls, the BlockMask's cost next to
                the step time; then the same forward+backward under torch.cuda.set_sync_debug_mode("error").
  train_run     train.py under `torchrun --nproc_per_node=1` on configs/paper/bam_ssmax_512.toml and the demo
                corpus (prepare_fineweb.py --source demo, made first unless --data_dir names shards): ~20
                steps with validation and a checkpoint, then --resume to 25; then FSDP and FSDP + activation
                checkpointing a few steps each, each resumed too. Reads each run's metrics.jsonl (losses,
                validation, tokens/s, MFU) and its log (recompiles, graph breaks, the recompile limit).
  long_context  a passkey-style forward (the evaluators' predict_spans) of the 121M model at 4K, 16K, 64K,
                128K and 256,000 tokens: time, memory and the compilations each length caused.
  correctness   the whole model under torch.compile against eager first, then flex (compiled kernel) against
                eager for every encoding of model.ENCODINGS x SSMax x document masking, forward and backward,
                the gradient of every parameter (prior and SSMax included), fp32 and bf16 autocast; the priors
                that read token features (FIRE, FoX) first; then two per-layer patterns (model.layer_pattern:
                RNoPE-SWA, BAM + SSMax global with a RoPE window) with document masking. On CPU flex has no backward (torch 2.13), so
                --quick compares flex forward against eager and sdpa forward+backward against eager.
  graphs        torch._dynamo.explain of the training forward (document masking, the device's attention
                path) for every encoding x SSMax: one graph, no graph break.
  attention     forward+backward of one attention call, 12-layer head shapes, bf16: RoPE, ALiBi, BAM+SSMax
                against NoPE on flash (sdpa) at T = 512, 1024, 4096.
  prior_tables  model.flex_prior: forward+backward of one attention call, bf16, with each prior read by formula
                in the kernel and gathered from its per-head table, against NoPE on flash at T = 512, 1024,
                4096; then the run-to-run spread of the prior's and SSMax's gradients over repeated backward
                passes on identical inputs (atomic adds in the kernel's backward make it nondeterministic).
  fsdp          train.parallel = "fsdp" in this process on a world of one rank: each Block compiled (flex on
                CUDA), sharded with the bf16 policy, 3 steps against bf16 autocast; a DCP save/load round trip.

--quick runs every section on tiny shapes with the CPU's attention path (sdpa; flex forward only where it
is compared), torch.compile's aot_eager backend (dynamo and AOT autograd trace forward and backward as
on the GPU; inductor's C++ code generation alone would take minutes on a small CPU) and train.py's runs
uncompiled on a 2-layer model over gloo. Its numbers mean nothing; it exists so that tests/test_gpu_check.py
keeps this script working between GPU runs.
"""

import argparse
import dataclasses
import gc
import glob
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from functools import partial

import numpy as np
import torch

import model as model_module
from bam import parallel
from bam.checkpoint import best_path, checkpoint_dir, load_checkpoint, metrics_path, step_checkpoints, step_path
from bam.cli import Parser
from bam.config import load_config
from bam.data import EOT, document_ids
from bam.outputs import remove_empty_folders, write_text
from bam.ranges import number
from bench.attention import attention_call
from bench.attention import measure as measure_attention
from bench.peak_memory import PeakMemory
from eval.scoring import Sample, predict_spans
from model import PE_CHOICES, Transformer
from train import PEAK_BF16_TFLOPS

# Section -> budget in seconds on one H100/H200. The four acceptance sections add up to 460 s: with ~20 s of
# start-up (imports, the CUDA context) the default run ends within 8 minutes, since no case runs past the
# end of the budget. Expected times, dominated by compilation (inductor and Triton for the model, Triton for
# each flex kernel; inductor's caches on disk make a second compilation of the same graph a few seconds):
#   training      ~45-55 s of inductor compilation per encoding for the 121M model, then 24 steps of 48 x 512
#                 tokens (~60 ms each at 40% MFU): BAM + SSMax and RoPE fit.
#   train_run     the demo corpus ~20 s; each torchrun start ~10 s (imports, NCCL); the DDP run ~60 s (the
#                 training graph from the training section's cache, the validation graph compiled anew, 20
#                 steps of 2 x 48 x 512 tokens); its resume ~30 s (caches); FSDP and FSDP + activation
#                 checkpointing ~60 s each (a Block compiled with flex inside, for training and validation),
#                 their resumes ~30 s: ~300 s in all, so the two FSDP resumes are the first cases skipped.
#   long_context  flex compiled for a static then a dynamic length (~15 s), 256,000 tokens ~5-10 s
#                 (~1.3 PFLOP of attention), the shorter ones ~1 s.
#   correctness   the whole 2-layer model compiled with flex inside (inductor, fwd+bwd) ~40 s per dtype, then
#                 ~10 s per flex case (a kernel per prior, SSMax, mask and dtype, forward and backward): what
#                 60 s allows. The whole grid (80 cases) takes ~15 min: --sections correctness --budget_s 900.
#   graphs        20 traces, no code generation: ~2 s each.
#   attention     a flex kernel per (encoding, T) with backward, ~5 s each, 9 of them; timing is milliseconds.
#   prior_tables  a flex kernel per (prior, formula) and one per SSMax setting for every table, with backward,
#                 ~5 s each and a recompile or two for the lengths; 8 repeated backward passes of one call.
#   fsdp          the 121M model's Block compiled once (inductor, flex inside: ~40 s), 3 steps, a DCP save/load.
SECTIONS = {"training": 110, "train_run": 250, "long_context": 45, "correctness": 55,
            "graphs": 40, "attention": 50, "prior_tables": 60, "fsdp": 60}
ACCEPTANCE = ("training", "train_run", "long_context", "correctness")  # the default on a GPU; --quick runs all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join(ROOT, "configs/paper/bam_ssmax_512.toml")  # the 121M model, the paper's training

# Tolerances of the correctness section, as a normwise relative error: max |got - ref| / max |ref| per tensor.
# fp32 (TF32 off): both paths round every product at 2^-24 and differ only in the order of sums (flex's
# online softmax over 128-key blocks against one softmax over the row); a parameter's gradient adds up
# B x H x T^2 such terms: on CPU the worst is 3.4e-5 (BAM's location gradient). 1e-3 leaves a wide margin
# for that and still fails real defects, measured on the --quick model: a document boundary one token late
# is 0.29 in the logits and 3x in a prior gradient; SSMax counting one key too many is 1.2e-3 in the logits
# and 4.5x in the location's gradient.
FP32_TOL = 1e-3
# bf16 autocast: both paths are compared with the fp32 eager reference, as FlashAttention's own tests do.
# Flex may be at most BF16_FACTOR times as far from it as the eager path under the same autocast (which
# rounds the same matmuls but keeps its attention scores in fp32), or within BF16_FLOOR. bf16 keeps 8
# significant bits (0.4% a rounding), and a parameter gradient that sums many rounded terms with
# cancellation loses more: on CPU the eager bf16 path is itself ~16% off the fp32 reference for the BAM
# location's gradient (its terms change sign at the query), and one bf16 path can be 2x another there by
# chance. The defects this section exists for (a gradient missing or wrong through the tensors a
# score_mod captures, pytorch issues 158212 and 157677) are errors of order 100%.
BF16_FACTOR, BF16_FLOOR = 3.0, 5e-2


def now():
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------------
# The record: every case's outcome, written out after every case.


class CaseTimeout(Exception):
    pass


class Report:
    def __init__(self, out_dir, env, budget_s, sections):
        self.out_dir, self.env = out_dir, env
        self.cases, self.targets, self.sections = [], [], {}
        self.start, self.budget_s = now(), budget_s
        self.planned = sum(SECTIONS[name] for name in sections)  # what budget_s is split in proportion to
        self.deadline = self.case_end = None

    @property
    def end(self):
        return None if self.budget_s is None else self.start + self.budget_s

    def begin_section(self, name, budget):
        # Deadlines add up from the start, so time a section leaves unused passes on to the next one.
        spent_before = sum(SECTIONS[s] for s in self.sections)
        scale = None if self.end is None else self.budget_s / self.planned
        self.deadline = None if scale is None else self.start + (spent_before + budget) * scale
        self.sections[name] = {"started_s": round(now() - self.start, 1), "budget_s": budget}
        self.section = name
        print(f"\n== {name}", flush=True)

    def end_section(self):
        self.sections[self.section]["seconds"] = round(now() - self.start - self.sections[self.section]["started_s"], 1)
        self.write()

    def fits(self, expected_s):
        return self.deadline is None or now() + expected_s <= self.deadline

    def seconds_left(self):
        """What the running case has left before it is stopped (None: no limit)."""
        return None if self.case_end is None else max(0.0, self.case_end - now())

    def run(self, name, fn, expected_s=0.0):
        """Run one case: fn() returns a dict of numbers, with "ok": False where the case failed its check.
        Any exception fails this case only, and so does running past the case's time limit."""
        if not self.fits(expected_s):
            self.add(name, "skipped", {"reason": f"time budget (expects ~{expected_s:.0f} s)"})
            return
        t0 = now()
        if self.end is not None:
            self.case_end = min(t0 + max(2 * expected_s, expected_s + 30), self.end)
        counts = compile_counts()
        try:
            with time_limit(self.seconds_left()):
                detail = fn()
            status = "pass" if detail.pop("ok", True) else "fail"
        except Exception as exc:  # the point of the script: record it and go on
            traceback.print_exc()
            detail, status = {"error": one_line(exc)}, "fail"
        finally:
            self.case_end = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        detail["seconds"] = round(now() - t0, 2)
        for key, value in compile_counts(since=counts).items():
            detail.setdefault(key, value)
        self.add(name, status, detail)

    def add(self, name, status, detail):
        self.cases.append({"section": self.section, "name": name, "status": status, **detail})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in detail.items())
        print(f"{status.upper():7} {name}: {shown}", flush=True)
        self.write()

    def target(self, name, value, goal, met):
        self.targets.append({"target": name, "measured": value, "goal": goal, "met": met})

    def write(self):
        failed = [c["name"] for c in self.cases if c["status"] == "fail"]
        obj = {"env": self.env, "elapsed_s": round(now() - self.start, 1), "sections": self.sections,
               "failed": failed, "cases": self.cases, "targets": self.targets}
        write_text(os.path.join(self.out_dir, "gpu_check.json"), json.dumps(obj, indent=1, default=str))
        write_text(os.path.join(self.out_dir, "gpu_check.md"), self.markdown(obj))

    def markdown(self, obj):
        env = obj["env"]
        lines = [f"# gpu_check: {env['device_name']}", "",
                 f"torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, "
                 f"{'quick (tiny shapes, numbers meaningless)' if env['quick'] else 'full'}; "
                 f"bf16 peak used for MFU: {env['peak_tflops'] or 'unknown'} TFLOP/s; "
                 f"{obj['elapsed_s']} s so far; {len(obj['failed'])} case(s) failed.", ""]
        if env.get("notes"):
            lines += [f"- {note}" for note in env["notes"]] + [""]
        if self.targets:
            lines += ["## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
            for t in self.targets:
                met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
                lines.append(f"| {t['target']} | {_fmt(t['measured'])} | {t['goal']} | {met} |")
            lines.append("")
        for section, info in obj["sections"].items():
            cases = [c for c in obj["cases"] if c["section"] == section]
            keys = []
            for c in cases:
                keys += [k for k in c if k not in ("section", "name", "status") and k not in keys]
            lines += [f"## {section} ({info.get('seconds', '…')} s of a {info['budget_s']} s budget)", "",
                      "| case | status | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
            for c in cases:
                status = c["status"] if c["status"] != "fail" else "**FAIL**"
                cells = [_fmt(c.get(k, "")) for k in keys]
                lines.append(f"| {c['name']} | {status} | " + " | ".join(cells) + " |")
            lines.append("")
        return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v).replace("|", "/").replace("\n", " ")


def one_line(exc):
    """An exception as one line: its type and the first line of its message (dynamo's run on for pages)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")


@contextmanager
def time_limit(seconds):
    """Raise CaseTimeout in this (the main) thread once `seconds` have passed; None: no limit. A compilation
    or a kernel is interrupted where it returns to Python, which is where torch spends its waiting."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise CaseTimeout(f"stopped at its time limit of {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RecompileCounter(logging.Handler):
    """Counts dynamo's recompile messages (the TORCH_LOGS=recompiles artifact), one per recompilation."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += 1


RECOMPILES = RecompileCounter()


def compile_counts(since=None):
    """Dynamo's compilations so far in this process: graphs compiled (recompilations included), recompiles,
    graph breaks; with `since` (an earlier call's result), those in between."""
    from torch._dynamo.utils import counters
    counts = {"compiled_graphs": counters["stats"]["unique_graphs"], "recompiles": RECOMPILES.count,
              "graph_breaks": sum(counters["graph_break"].values())}
    if since is None:
        return counts
    return {key: max(0, value - since[key]) for key, value in counts.items()}


@contextmanager
def counting_recompiles():
    """Dynamo logs a recompile (with its reason, on stderr) only while the recompiles artifact is on: it is
    turned on here unless TORCH_LOGS sets the logs (then it should name recompiles for the count), and
    counted."""
    try:
        from torch._dynamo.guards import recompiles_log as log
    except ImportError:  # a torch whose dynamo moved it: the count stays 0, which the report's notes say
        yield False
        return
    own = "TORCH_LOGS" not in os.environ
    if own:
        torch._logging.set_logs(recompiles=True)
    log.addHandler(RECOMPILES)
    try:
        yield True
    finally:
        log.removeHandler(RECOMPILES)
        if own:
            torch._logging.set_logs()




# ---------------------------------------------------------------------------------------------------
# Shared helpers


class Setup:
    """What every section needs to know about this run."""

    def __init__(self, args):
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.compile_backend = args.compile_backend or ("inductor" if self.cuda else "aot_eager")
        self.bf16 = torch.bfloat16 if (not self.cuda or torch.cuda.is_bf16_supported()) else None
        self.base = load_config(BASE_CONFIG)
        name = torch.cuda.get_device_name(self.device) if self.cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
        self.device_name = name
        self.peak_tflops = next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None) if self.cuda else None
        self.data_dir = args.data_dir

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self, dtype):
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def peak_memory(self):
        return PeakMemory(self.device)


def documents_batch(batch_size, seq_len, vocab_size, device, seed, used_tokens=None):
    """Random tokens packed into documents of uneven length, separated by EOT, as the loader gives them:
    (inputs, targets, doc_ids). Boundaries fall anywhere, not on flex's 128-token blocks. Drawn from the
    first `used_tokens` ids only, the loss has something to learn quickly (from ln(vocab) towards
    ln(used_tokens)); token values do not change the cost of a step."""
    g = torch.Generator().manual_seed(seed)
    eot = EOT if vocab_size > EOT else vocab_size - 1
    x = torch.randint(0, min(eot, used_tokens or eot), (batch_size, seq_len + 1), generator=g)
    for row in x:
        n_docs = int(torch.randint(1, 5, (1,), generator=g))
        row[torch.randint(1, seq_len, (n_docs,), generator=g)] = eot
    x[:, 0] = eot
    inputs, targets = x[:, :-1], x[:, 1:]
    return inputs.to(device), targets.to(device), document_ids(inputs, eot).to(device)


def quick_subset(s, variants, n=2):
    """--quick runs the first n variants of a list (distinct, in order): the code path of the loop, not its grid."""
    variants = list(dict.fromkeys(variants))
    return variants[:n] if s.quick else variants


def variant_name(pe, ssmax, settings=None):
    """"rope", "bam+ssmax", "rope,rope_fraction=0.5" (an encoding's checked_settings): one word in a case's name."""
    name = ",".join([pe] + [f"{k}={v}" for k, v in (settings or {}).items()])
    return f"{name}+ssmax" if ssmax else name


def rel_err(got, ref):
    """Normwise relative error: max |got - ref| / max |ref| (0 where both are 0)."""
    got, ref = got.detach().double(), ref.detach().double()
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------
# graphs: the compiled training forward must be one graph


def check_graphs(s, report):
    m = s.base.model
    cfg = dict(vocab_size=m.vocab_size if s.cuda else 512, n_layer=2, n_head=4, n_embd=128 if s.cuda else 32,
               block_size=256 if s.cuda else 64)
    for pe, ssmax in quick_subset(s, [("bam", True), ("rope", False)] +
                                  [(pe, ssmax) for pe in PE_CHOICES for ssmax in (False, True)]):
        def case(pe=pe, ssmax=ssmax):
            model = Transformer(dataclasses.replace(m, pe=pe, ssmax=ssmax, **cfg)).to(s.device)
            x, y, doc_ids = documents_batch(2, cfg["block_size"], cfg["vocab_size"], s.device, 0)
            impl = model_module.attention_path(model, x.shape[1], x.shape[1], True)
            torch._dynamo.reset()  # explain counts graphs of this trace only
            explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
            reasons = "; ".join(str(r.reason)[:150] for r in explained.break_reasons)
            return {"ok": explained.graph_count == 1 and explained.graph_break_count == 0, "impl": impl,
                    "graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
                    "break_reasons": reasons or "-"}
        report.run(f"forward with doc_ids: {variant_name(pe, ssmax)}", case, expected_s=3)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------
# correctness: flex (and the compiled model) against the eager reference


# ModelConfig's switches that change every layer's attention whatever the encoding (learned sinks, which change
# the flex kernel, and gated attention): the correctness grid runs each encoding once more with all of them on.
ATTENTION_SWITCHES = ("attn_sink", "attn_gate")


def correctness_model(s, pe, ssmax, seed=0, settings=None, switches=(), **kw):
    """A small model with the real head width (48) and every prior/SSMax/sink parameter moved off its init,
    so that no case passes because of a special value (ALiBi's shape exactly 1, SSMax's scale exactly 1, a
    sink at 0). `settings`: more ModelConfig fields (one of the encoding's checked_settings); `switches`: the
    ATTENTION_SWITCHES turned on."""
    dims = dict(vocab_size=512, n_layer=2, n_head=4, n_embd=192) if s.cuda else \
        dict(vocab_size=97, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = Transformer(model_module.ModelConfig(pe=pe, ssmax=ssmax, bam_train_loc=True, block_size=384, **dims,
                                                 **(settings or {}), **dict.fromkeys(switches, True), **kw))
    with torch.no_grad():
        for p in model.prior_parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.to(s.device)


def correctness_batch(s, docs):
    T = 384 if s.cuda else 160  # three (or two) flex blocks of 128, the last one partial on CPU
    x, y, doc_ids = documents_batch(2, T, 512 if s.cuda else 97, s.device, seed=1)
    return x, y, (doc_ids if docs else None)


def forward_backward(model, impl, batch, amp, backward):
    """Logits, loss and every parameter's gradient of one pass with attention implementation `impl`."""
    x, y, doc_ids = batch
    model.config.attn_impl = impl
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward), amp:
        logits, loss = model(x, y, doc_ids=doc_ids)
    out = {"logits": logits.float(), "loss": loss.float()}
    if backward:
        loss.backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                out[f"grad {name}"] = p.grad.float().clone() if p.grad is not None else None
    return out


def compare(got, ref, eager_low=None):
    """Every tensor of `got` against the fp32 reference `ref`: within FP32_TOL, or in bf16 (`eager_low`, the
    eager path under the same autocast) within BF16_FACTOR times the eager path's own error or BF16_FLOOR. Reports the
    tensor that comes closest to (or furthest past) its tolerance."""
    worst, missing = None, []
    for name, value in got.items():
        if value is None or ref.get(name) is None or (eager_low is not None and eager_low.get(name) is None):
            missing.append(name)
            continue
        err = rel_err(value, ref[name])
        allowed = FP32_TOL if eager_low is None else max(BF16_FACTOR * rel_err(eager_low[name], ref[name]), BF16_FLOOR)
        if worst is None or not err / allowed <= worst[0]:
            worst = (err / allowed, name, err, allowed)
    detail = {"ok": not missing and worst is not None and worst[0] <= 1, "tensors": len(got)}
    if worst is not None:
        detail.update(worst_rel_err=worst[2], tol=worst[3], worst_tensor=worst[1])
    if missing:
        detail["missing_grad"] = ", ".join(missing)
    return detail


def correctness_order(pe):
    """Where an encoding's cases come in the grid: the priors that read token features (flex differentiates
    through tensors indexed at the query and at the key: the hardest backward, FIRE and FoX) first, then the
    other additive priors, then the encodings without a score_mod. From the registry, never by name."""
    encoding = model_module.ENCODINGS[pe]
    additive = issubclass(encoding, model_module.AdditivePrior)
    return (not additive) + (additive and encoding.DISTANCE_ONLY)


# Per-layer patterns (model.layer_pattern) on the 2-layer correctness model: RNoPE-SWA, and BAM + SSMax global
# with a RoPE window, each layer with its own window, prior and SSMax; the window cuts through flex's blocks
LAYER_PATTERNS = {"rnope-swa": dict(pe="rope", ssmax=False, layer_pattern="rope@100 nope@full"),
                  "bam+ssmax-global": dict(pe="bam", ssmax=False, layer_pattern="rope@100 bam+ssmax@full")}


def path_against_eager(s, model, impl, docs, dtype, backward):
    """One correctness case: `impl` against the eager reference in fp32 (and eager at `dtype`, the bar)."""
    batch = correctness_batch(s, docs)
    ref = forward_backward(model, "eager", batch, nullcontext(), backward)
    got = forward_backward(model, impl, batch, s.autocast(dtype), backward)
    low = forward_backward(model, "eager", batch, s.autocast(dtype), backward) if dtype != torch.float32 else None
    return {"pass": "fwd+bwd" if backward else "fwd only (no flex backward on CPU)", **compare(got, ref, low)}


def check_correctness(s, report):
    precision = torch.get_float32_matmul_precision()
    # The fp32 reference and the fp32 flex kernel without TF32 (inductor's flex template follows this setting).
    torch.set_float32_matmul_precision("highest")
    try:
        dtypes = [torch.float32] + ([s.bf16] if s.bf16 else [])
        # The whole model under torch.compile first, as train.compile = true runs it (flex inside on CUDA).
        for dtype in dtypes[:1] if s.quick else dtypes:
            def compiled_case(dtype=dtype):
                model = correctness_model(s, "bam", True)
                impl = "flex" if s.cuda else "sdpa"
                batch = correctness_batch(s, True)
                ref = forward_backward(model, "eager", batch, nullcontext(), True)
                low = forward_backward(model, "eager", batch, s.autocast(dtype), True) if dtype != torch.float32 else None
                compiled = torch.compile(model, backend=s.compile_backend)
                x, y, doc_ids = batch
                model.config.attn_impl = impl
                model.zero_grad(set_to_none=True)
                with s.autocast(dtype):
                    logits, loss = compiled(x, y, doc_ids=doc_ids)
                loss.backward()
                got = {"logits": logits.float(), "loss": loss.float()}
                got.update({f"grad {n}": (p.grad.float() if p.grad is not None else None)
                            for n, p in model.named_parameters() if p.requires_grad})
                return {"pass": f"fwd+bwd, {s.compile_backend}", **compare(got, ref, low)}
            report.run(f"torch.compile(model) {'flex' if s.cuda else 'sdpa'} bam+ssmax docs {str(dtype)[6:]}",
                       compiled_case, expected_s=10 if s.quick else 40)

        # Document masking first (the training configuration): under a tight budget it is the last skipped.
        # --quick: document masking on only; tests/test_model.py covers the rest. Every encoding, and each of
        # its checked_settings (partial RoPE), from the registry; every encoding also runs with the
        # ATTENTION_SWITCHES on (with SSMax and documents, the richest case), after its plain cases.
        grid = [(pe, ssmax, docs, dtype, settings, ()) for pe, settings in model_module.CHECKED_SETTINGS
                for ssmax in (True, False) for docs in ((True,) if s.quick else (True, False)) for dtype in dtypes]
        grid += [(pe, True, True, dtype, {}, ATTENTION_SWITCHES) for pe in model_module.ENCODINGS for dtype in dtypes]
        grid.sort(key=lambda c: (not c[2], correctness_order(c[0]), not c[1], bool(c[5])))
        for pe, ssmax, docs, dtype, settings, switches in grid:
            impls = [("flex", True)] if s.cuda else [("sdpa", True)]
            if not s.cuda and (pe, ssmax, docs, dtype, settings, switches) == ("bam", True, True, torch.float32,
                                                                              {}, ()):
                # CPU flex compiles C++ for ~30 s a variant and has no backward: one case, the richest one
                impls.append(("flex", False))
            for impl, backward in impls:
                def case(pe=pe, ssmax=ssmax, docs=docs, dtype=dtype, impl=impl, backward=backward,
                         settings=settings, switches=switches):
                    model = correctness_model(s, pe, ssmax, settings=settings, switches=switches)
                    return path_against_eager(s, model, impl, docs, dtype, backward)
                name = f"{impl} {variant_name(pe, ssmax, settings)}{' docs' if docs else ''} {str(dtype)[6:]}" + \
                    "".join(f" {switch}" for switch in switches)
                # a flex kernel per variant: ~10 s of Triton with its backward, ~30 s of C++ for a CPU's forward
                report.run(name, case, expected_s=1 if impl != "flex" else 10 if s.cuda else 30)
        # then the per-layer patterns, with document masking: the device's path (sdpa on a CPU) against eager
        impl = "flex" if s.cuda else "sdpa"
        for (pattern, kw), dtype in ((p, d) for p in LAYER_PATTERNS.items() for d in dtypes):
            def pattern_case(kw=kw, dtype=dtype):
                return path_against_eager(s, correctness_model(s, **kw), impl, True, dtype, True)
            report.run(f"{impl} pattern {pattern} docs {str(dtype)[6:]}", pattern_case,
                       expected_s=20 if s.cuda else 1)  # two flex kernels a pattern, each with its backward
    finally:
        torch.set_float32_matmul_precision(precision)


# ---------------------------------------------------------------------------------------------------
# training: the compiled bf16 step of the 121M model


def training_variants():
    """BAM + SSMax, then RoPE (the throughput target compares them), then NoPE and the rest."""
    first = [("bam", True), ("rope", False), ("nope", False)]
    return first + [(pe, ssmax) for ssmax in (False, True) for pe in PE_CHOICES if (pe, ssmax) not in first]


def build_optimizer(model, train_cfg, device):
    """As train.py: the prior and SSMax parameters in their own group with their own learning rate."""
    groups = model.optim_groups(train_cfg.weight_decay)
    for group in groups:
        group["lr"] = (train_cfg.prior_lr or train_cfg.lr) if group["name"] == "prior" else train_cfg.lr
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, betas=train_cfg.betas, eps=train_cfg.eps, fused=True)
    return torch.optim.RAdam(groups, betas=train_cfg.betas, eps=train_cfg.eps, decoupled_weight_decay=True)


def check_training(s, report):
    cfg = s.base
    train_cfg = cfg.train
    if s.quick:
        model_cfg = dataclasses.replace(cfg.model, n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=64)
        batch_size, warmup, timed = 4, 2, 8
        # RAdam's first five steps are plain momentum steps: at the paper's lr the tiny model's loss would
        # not move within ten steps.
        train_cfg = dataclasses.replace(train_cfg, lr=10 * train_cfg.lr)
    else:
        model_cfg, batch_size, warmup, timed = cfg.model, cfg.data.batch_size, 4, 20
    T = model_cfg.block_size
    dtype = s.bf16 if s.cuda else torch.float32  # CPU quick: fp32, as CPU training runs
    if s.cuda:
        torch.set_float32_matmul_precision("high")  # as train.py: TF32 for whatever stays in fp32
    # A fixed set of batches, cycled, drawn from a part of the vocabulary: the loss must fall clearly below
    # its first value within a few dozen steps (uniform random tokens would leave it at ln(vocab)).
    batches = [documents_batch(batch_size, T, model_cfg.vocab_size, s.device, seed, used_tokens=model_cfg.vocab_size // 8)
               for seed in range(4)]
    results = {}
    for pe, ssmax in quick_subset(s, training_variants()):
        name = variant_name(pe, ssmax)
        state = {}

        def train_case(pe=pe, ssmax=ssmax, name=name, state=state):
            torch.manual_seed(0)
            model = Transformer(dataclasses.replace(model_cfg, pe=pe, ssmax=ssmax, attn_impl="auto")).to(s.device)
            optimizer = build_optimizer(model, train_cfg, s.device)
            compiled = torch.compile(model, backend=s.compile_backend)
            impl = model_module.attention_path(model, T, T, True)

            def step(batch):
                x, y, doc_ids = batch
                with s.autocast(dtype):
                    _, loss = compiled(x, y, doc_ids=doc_ids)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return loss.detach()

            losses, times = [], []
            if s.cuda:
                torch.cuda.reset_peak_memory_stats(s.device)
            with s.peak_memory() as mem:
                for i in range(warmup + timed):
                    s.sync()
                    t0 = now()
                    losses.append(step(batches[i % len(batches)]))
                    s.sync()
                    times.append(now() - t0)
            losses = torch.stack(losses).float().cpu()  # one read at the end: no sync inside the timed steps
            step_s = statistics.median(times[warmup:])
            tokens_per_s = batch_size * T / step_s
            mfu = model.flops_per_token(T) * tokens_per_s / (s.peak_tflops * 1e12) if s.peak_tflops else None
            first, last = float(losses[0]), float(losses[-len(batches):].mean())
            falls = bool(torch.isfinite(losses).all()) and last < first - 0.1
            # The BlockMask of one batch (document masking), built as _context builds it, next to the step.
            x, _, doc_ids = batches[0]
            mask_times = []
            for _ in range(5):
                s.sync()
                t0 = now()
                model_module.make_block_mask(doc_ids, T, s.device)
                s.sync()
                mask_times.append(now() - t0)
            state.update(model=model, compiled=compiled, batch=batches[0], dtype=dtype)
            results[name] = {"tokens_per_s": tokens_per_s, "mfu": mfu}
            return {"ok": falls, "impl": impl, "batch": f"{batch_size}x{T}", "tokens_per_s": round(tokens_per_s),
                    "step_ms": step_s * 1e3, "mfu": mfu if mfu is None else round(mfu, 3),
                    "peak_mem_GiB": mem.bytes / 2**30, "compile_s": round(times[0] - step_s, 1),
                    "loss_first": first, "loss_last": last, "loss_falls": falls,
                    "block_mask_ms": statistics.median(mask_times) * 1e3,
                    "block_mask_share": statistics.median(mask_times) / step_s}

        report.run(f"train {name}", train_case, expected_s=20 if s.quick else 50)
        if state and s.cuda:  # set_sync_debug_mode is CUDA's
            report.run(f"no device sync in fwd+bwd: {name}", lambda state=state: no_sync(s, state), expected_s=2)
        state.clear()
        torch._dynamo.reset()  # dynamo's cache would keep this variant's model (and its memory) alive

    # Targets are the GPU's: on CPU they are shown with their numbers but not judged.
    if "rope" in results and "bam+ssmax" in results:
        ratio = results["bam+ssmax"]["tokens_per_s"] / results["rope"]["tokens_per_s"]
        report.target("training tokens/s, BAM+SSMax / RoPE", round(ratio, 3), ">= 0.85", ratio >= 0.85 if s.cuda else None)
    if "bam+ssmax" in results:
        mfu = results["bam+ssmax"]["mfu"]
        report.target("MFU of BAM+SSMax training", mfu, ">= 0.40", None if mfu is None else mfu >= 0.40)


def no_sync(s, state):
    """The compiled forward+backward once more, with CUDA raising on any device-to-host synchronisation."""
    x, y, doc_ids = state["batch"]
    s.sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with s.autocast(state["dtype"]):
            _, loss = state["compiled"](x, y, doc_ids=doc_ids)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    state["model"].zero_grad(set_to_none=True)
    return {"result": "no sync"}


# ---------------------------------------------------------------------------------------------------
# train_run: train.py itself, as a user starts it, under torchrun on one GPU


# (run, extra config overrides, steps, steps after --resume, val_every) on a GPU: the DDP run as long as the
# issue asks, FSDP and FSDP + activation checkpointing a few steps each (their cost is compilation).
TRAIN_RUNS = [("ddp", [], 20, 25, 10),
              ("fsdp", ["--train.parallel=fsdp"], 4, 6, 2),
              ("fsdp_ac", ["--train.parallel=fsdp", "--train.activation_checkpointing=full"], 4, 6, 2)]
# On one rank, two micro-batches of the paper's 48 x 512 per step (gradient accumulation runs) instead of 24;
# validation over two batches of the demo corpus's 50,000-token validation shard.
GPU_RUN = ["--train.tokens_per_step=49152", "--train.val_tokens=49152"]
# --quick: a 2-layer model, uncompiled (inductor's C++ build would take minutes on a small CPU), two steps
# resumed to three; the demo corpus cut to 40,000 tokens.
QUICK_RUN = ["--model.n_layer=2", "--model.n_embd=64", "--model.n_head=4", "--model.block_size=64",
             "--data.batch_size=2", "--train.tokens_per_step=256", "--train.val_tokens=256", "--train.compile=false"]
# What a rank's log says once per event with TORCH_LOGS=dynamo,recompiles,graph_breaks (child_env).
LOG_COUNTS = {"compiled_graphs": "Step 2: calling compiler function", "recompiles": "Recompiling function",
              "graph_breaks": "Graph break in user code", "recompile_limit_hit": "torch._dynamo hit config."}


def child_env(s):
    """The environment of train.py's ranks: this run's GPU alone (train.py takes GPU LOCAL_RANK), none on the
    CPU (it would take any it sees), and dynamo's compilations, recompiles and graph breaks logged to be
    counted."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [name for name in env.get("TORCH_LOGS", "").split(",") if name]
    env["TORCH_LOGS"] = ",".join(dict.fromkeys(logs + ["dynamo", "recompiles", "graph_breaks"]))
    if s.cuda:
        index = s.device.index if s.device.index is not None else torch.cuda.current_device()
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_logged(report, argv, log_path, env):
    """Run a command with its output in log_path, stopped (its whole process group) at the case's time limit.
    Returns (exit status, output)."""
    left = report.seconds_left()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            # a few seconds before the case's own limit, so that the processes are gone when it is recorded
            proc.wait(timeout=None if left is None else max(1.0, left - 5))
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    with open(log_path, errors="replace") as log:
        return proc.returncode, log.read()


def failure_line(output):
    """What a failed command said: train.py's last `error: ...` line, else the last exception line (not
    torchrun's ChildFailedError about it), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or exceptions or lines or ["(no output)"])[-1][:300]


EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*\.)?\w*(Error|Exception|Unsupported|Interrupt|LimitHit)\w*: ")


def metrics_summary(run_dir, since, skip):
    """The numbers of metrics.jsonl for the steps after `since`: losses, validation losses, tokens/s and MFU
    (medians over the steps after the first `skip` of them, whose intervals hold the compilation). Returns them
    and every row."""
    with open(metrics_path(run_dir)) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "loss" in r and r["step"] > since]
    timed = [r for r in steps if r["step"] > since + skip] or steps
    out = {"last_step": rows[-1]["step"] if rows else None,
           "loss_first": steps[0]["loss"] if steps else None, "loss_last": steps[-1]["loss"] if steps else None,
           "val_losses": {r["step"]: round(r["val_loss"], 4) for r in rows if "val_loss" in r},
           "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed)) if timed else None,
           "finite": all(math.isfinite(r.get(key, 0.0)) for r in rows for key in ("loss", "val_loss"))}
    if timed and all("mfu" in r for r in timed):
        out["mfu"] = round(statistics.median(r["mfu"] for r in timed), 3)
    return out, rows


def check_train_run(s, report):
    """train.py under `torchrun --standalone --nproc_per_node=1` on configs/paper/bam_ssmax_512.toml and the
    demo corpus, as a user runs it: train.parallel's three paths, each validated at step 0 and every val_every
    steps, checkpointed, then resumed. On the CPU (--quick) torchrun's rank runs on gloo."""
    root = os.path.join(report.out_dir, "train_run")
    data_dir = s.data_dir or os.path.join(root, "demo_data")
    env = child_env(s)
    for name, *_ in TRAIN_RUNS:  # checkpoints of an earlier call: train.py would refuse to start over them
        remove_checkpoints(os.path.join(root, name))
    os.makedirs(root, exist_ok=True)
    done = {}

    def corpus_case():
        if s.data_dir:
            shards = glob.glob(os.path.join(s.data_dir, "*_train_*.bin"))
            if not shards:
                raise FileNotFoundError(f"--data_dir {s.data_dir} holds no *_train_*.bin shards")
            done["data"] = True
            return {"data_dir": s.data_dir, "train_shards": len(shards)}
        cut = ["--max_tokens", "40000", "--shard_size", "8000", "--workers", "1"] if s.quick else []
        argv = [sys.executable, "prepare_fineweb.py", "--source", "demo", "--out_dir", data_dir, *cut]
        code, output = run_logged(report, argv, os.path.join(root, "demo_corpus.log"), env)
        if code != 0:
            raise RuntimeError(f"prepare_fineweb.py exited with {code}: {failure_line(output)}")
        done["data"] = True
        return {"data_dir": data_dir, "train_shards": len(glob.glob(os.path.join(data_dir, "*_train_*.bin"))),
                "made": output.strip().splitlines()[-1][:200]}
    report.run("demo corpus (prepare_fineweb.py --source demo)", corpus_case, expected_s=15 if s.quick else 25)

    def train_case(name, extra, steps, val_every, resumed_from=None):
        run_dir = os.path.join(root, name)
        before = metrics_summary(run_dir, 0, 0)[1] if resumed_from is not None else None
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                "train.py", BASE_CONFIG, f"--data.data_dir={data_dir}", f"--log.out_dir={run_dir}",
                f"--train.max_steps={steps}", f"--train.val_every={val_every}", "--log.log_every=1",
                "--train.keep_last=2", *(QUICK_RUN if s.quick else GPU_RUN), *extra,
                *([] if resumed_from is None else ["--resume"])]
        log = os.path.join(root, f"{name}{'' if resumed_from is None else '_resume'}.log")
        code, output = run_logged(report, argv, log, env)
        if code != 0:
            raise RuntimeError(f"train.py exited with {code}: {failure_line(output)}")
        since = resumed_from or 0
        skip = 0 if s.quick else (1 if resumed_from else 3)
        summary, rows = metrics_summary(run_dir, since, skip)
        checkpoint = os.path.exists(step_path(run_dir, steps, "--train.parallel=fsdp" in extra))
        detail = {"steps": summary.pop("last_step"), **summary, "checkpoint": checkpoint,
                  **{key: output.count(text) for key, text in LOG_COUNTS.items()}}
        ok = detail["steps"] == steps and checkpoint and summary["finite"] and steps in summary["val_losses"]
        if resumed_from is None:
            ok = ok and 0 in summary["val_losses"]  # the untrained model's validation, traced before step 1
            done[name] = ok
        else:
            detail["resumed"] = f"resuming at step {resumed_from}" in output
            detail["rows_kept"] = rows[:len(before)] == before  # the rows up to the checkpoint, as they were
            ok = ok and detail["resumed"] and detail["rows_kept"]
        return {"ok": ok, **detail}

    runs = [(name, extra, 2, 3, 1) if s.quick else (name, extra, steps, resume_to, val_every)
            for name, extra, steps, resume_to, val_every in TRAIN_RUNS]
    # DDP and its resume, then the two FSDP runs, then their resumes: under a tight budget those go first.
    # --quick leaves them out (the same code as the DDP resume; tests/test_fsdp.py resumes FSDP on the CPU).
    order = [(runs[0], False), (runs[0], True)] + [(run, False) for run in runs[1:]]
    for run, resumed in order + ([] if s.quick else [(run, True) for run in runs[1:]]):
        name, extra, steps, resume_to, val_every = run
        what = f"--resume to {resume_to}" if resumed else f"{steps} steps, validation, checkpoint"
        title = f"torchrun train.py {name.replace('_ac', ' + activation checkpointing')}: {what}"
        missing = "no demo corpus" if "data" not in done else \
            "no run to resume" if resumed and name not in done else None
        if missing:  # what it needs failed (or did not fit), as recorded above
            report.add(title, "skipped", {"reason": missing})
            continue
        case = partial(train_case, name, extra, resume_to, val_every, resumed_from=steps) if resumed else \
            partial(train_case, name, extra, steps, val_every)
        report.run(title, case, expected_s=20 if s.quick else (30 if resumed else 60))
    for name, *_ in TRAIN_RUNS:  # a GPU run's checkpoints are GBs; its log and metrics.jsonl stay
        remove_checkpoints(os.path.join(root, name))


def remove_checkpoints(run_dir):
    """The checkpoints train.py wrote into RUN/checkpoints (step_* and best, files or sharded folders), then that
    folder if nothing else is left in it. Only these: RUN may be a folder of the user's that --out happened to
    name, and whatever else it holds is not gpu_check's to remove."""
    for path in step_checkpoints(run_dir) + [best_path(run_dir, sharded) for sharded in (False, True)]:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    remove_empty_folders(checkpoint_dir(run_dir), up_to=checkpoint_dir(run_dir))


# ---------------------------------------------------------------------------------------------------
# long_context: a passkey sweep, a forward of growing length up to 256,000 tokens


def check_long_context(s, report):
    """The evaluators' forward (predict_spans) at lengths as eval.passkey sweeps them, from 4K to 256,000
    tokens: time, memory and the compilations each length caused. Flex is compiled for the first length and
    once more, with a dynamic length, for the second; a later length that compiles again costs every sweep
    that much."""
    m = s.base.model
    if s.quick:  # auto picks sdpa up to 2K tokens on CPU: no flex compilation in CI
        model_cfg = dataclasses.replace(m, n_layer=2, n_embd=32, n_head=2, vocab_size=512)
        lengths = [256, 1000, 2000]
    else:
        model_cfg, lengths = m, [4000, 16000, 64000, 128000, 256000]
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(model_cfg, attn_impl="auto")).to(s.device).eval()
    amp = s.autocast(s.bf16 if s.cuda else torch.float32)
    rng = np.random.default_rng(0)

    def sample(length):  # token values do not change the cost; the last five tokens are the "answer"
        return Sample(rng.integers(0, model_cfg.vocab_size - 1, length + 1), [(length - 4, length + 1)])

    results = {}
    for i, length in enumerate(lengths):
        def case(length=length):
            prompt = sample(length)
            with s.peak_memory() as mem:
                s.sync()
                t0 = now()
                predict_spans(model, [prompt], amp)
                s.sync()
                seconds = now() - t0
            results[length] = seconds
            return {"impl": model_module.attention_path(model, length, length, False), "tokens": length,
                    "seconds": seconds, "peak_mem_GiB": mem.bytes / 2**30}
        # the first two lengths compile (~15 s on a GPU); 256,000 tokens are ~1.3 PFLOP of attention
        expected = 1 if s.quick else (15 if i < 2 else max(1, 10 * (length / lengths[-1]) ** 2))
        report.run(f"passkey forward {length:,} tokens", case, expected_s=expected)
    sweep = [c for c in report.cases if c["section"] == report.section]
    if len(sweep) == len(lengths) and all(c["status"] == "pass" for c in sweep):
        graphs = [c["compiled_graphs"] for c in sweep]
        report.target(f"passkey sweep {lengths[0]:,} ... {lengths[-1]:,} tokens: graphs compiled after the "
                      f"second length (all: {sum(graphs)})", sum(graphs[2:]), "0",
                      sum(graphs[2:]) == 0 if s.cuda else None)
    if lengths[-1] in results:
        report.target(f"{lengths[-1]:,}-token passkey forward", f"{results[lengths[-1]]:.1f} s",
                      "< 60 s at 256K, 121M model", results[lengths[-1]] < 60 if s.cuda else None)


# ---------------------------------------------------------------------------------------------------
# attention: one attention call per encoding against NoPE on flash


def check_attention(s, report):
    lengths = [64, 128] if s.quick else [512, 1024, 4096]
    dtype = s.bf16 if s.cuda else torch.float32
    # The GPU trains priors on flex; CPU quick uses sdpa throughout (flex has no backward there).
    rows = [("nope", "sdpa"), ("rope", "sdpa"), ("nope", "flex"), ("alibi", "flex"), ("bam+ssmax", "flex")]
    rows = list(dict.fromkeys((enc, impl if s.cuda else "sdpa") for enc, impl in rows))
    ratios = {}
    for T in lengths:
        batch = max(1, (16 if s.quick else 32768) // T)  # the same tokens per call at every T
        base = {}
        for encoding, impl in rows:
            def case(encoding=encoding, impl=impl, T=T, batch=batch):
                run = attention_call(encoding, impl, T, s.device.type, dtype, True, batch=batch)
                seconds, peak = measure_attention(run, s.device.type, 3 if s.quick else 10)
                if encoding == "nope" and impl == "sdpa":
                    base["t"] = seconds
                ratio = seconds / base["t"] if "t" in base else None
                ratios[encoding, impl, T] = ratio
                return {"impl": impl, "shape": f"{batch}x16x{T}x48", "ms": seconds * 1e3,
                        "x_nope_flash": None if ratio is None else round(ratio, 2), "peak_mem_MiB": peak / 2**20}
            report.run(f"{encoding} {impl} T={T}", case, expected_s=1 if s.quick else 5)
    ratio = ratios.get(("bam+ssmax", "flex" if s.cuda else "sdpa", 1024 if s.cuda else lengths[-1]))
    report.target("attention fwd+bwd at T=1024, BAM+SSMax flex / NoPE flash", ratio, "<= 1.3",
                  None if ratio is None or not s.cuda else ratio <= 1.3)


# ---------------------------------------------------------------------------------------------------
# prior_tables: formula against table (model.flex_prior), forward + backward, and how deterministic the
# prior's gradients are


def check_prior_tables(s, report):
    """On the GPU both modes run on flex, where they differ: per score the formula's gradient is added into a
    few scalars per head, the table's into H x T entries (docs/benchmarks.md, "Prior tables on flex"). CPU quick
    has no flex backward and runs them on sdpa (the table through table_bias): the code path, not the numbers."""
    lengths = [64, 128] if s.quick else [512, 1024, 4096]
    dtype = s.bf16 if s.cuda else torch.float32
    impl = "flex" if s.cuda else "sdpa"
    encodings = quick_subset(s, ["bam+ssmax", "bam", "alibi", "kerple_log", "kerple_power"])
    ratios = {}
    for T in lengths:
        batch = max(1, (16 if s.quick else 32768) // T)  # the same tokens per call at every T
        base = {}

        def flash_case(T=T, batch=batch, base=base):
            base["t"], peak = measure_attention(attention_call("nope", "sdpa", T, s.device.type, dtype, True,
                                                               batch=batch), s.device.type, 3 if s.quick else 10)
            return {"impl": "sdpa", "shape": f"{batch}x16x{T}x48", "ms": base["t"] * 1e3, "x_nope_flash": 1.0,
                    "peak_mem_MiB": peak / 2**20}
        report.run(f"nope sdpa T={T} (flash, the baseline)", flash_case, expected_s=1)
        for encoding in encodings:
            for mode in ("formula", "table"):
                def case(encoding=encoding, mode=mode, T=T, batch=batch, base=base):
                    run = attention_call(encoding, impl, T, s.device.type, dtype, True, batch=batch, flex_prior=mode)
                    seconds, peak = measure_attention(run, s.device.type, 3 if s.quick else 10)
                    ratios[encoding, mode, T] = seconds
                    versus = ratios.get((encoding, "formula", T)) if mode == "table" else None
                    return {"impl": impl, "shape": f"{batch}x16x{T}x48", "ms": seconds * 1e3,
                            "x_nope_flash": round(seconds / base["t"], 2) if "t" in base else None,
                            "table_x_formula": None if versus is None else round(seconds / versus, 3),
                            "peak_mem_MiB": peak / 2**20}
                report.run(f"{encoding} {impl} {mode} T={T}", case, expected_s=1 if s.quick else 5)

    T = lengths[1]
    for mode in ("formula", "table"):
        def spread_case(mode=mode, T=T):
            return gradient_spread(s, attention_call("bam+ssmax", impl, T, s.device.type, dtype, True,
                                                     batch=max(1, 16 // T) if s.quick else 8, flex_prior=mode),
                                   3 if s.quick else 8)
        report.run(f"bam+ssmax {impl} {mode} T={T}: prior gradients over repeated backward passes", spread_case,
                   expected_s=1 if s.quick else 5)
    # The default was chosen from the CPU's forward (docs/benchmarks.md, "Prior tables on flex"); the GPU's
    # forward + backward decides: the target is met when the default is the faster mode here.
    formula, table = (ratios.get(("bam+ssmax", mode, 1024)) for mode in ("formula", "table"))
    ratio = None if not (formula and table) else round(table / formula, 3)
    default = model_module.ModelConfig.flex_prior
    report.target("attention fwd+bwd at T=1024, BAM+SSMax table / formula (model.flex_prior)", ratio,
                  f"{'<=' if default == 'table' else '>='} 1.0: the default ({default!r}) is the faster",
                  None if ratio is None or not s.cuda else (ratio <= 1.0) == (default == "table"))


def gradient_spread(s, run, repeats):
    """The same forward+backward `repeats` times on identical inputs: how far the prior's and SSMax's gradients
    move between runs (max |g_r - g_0| / max |g_0| over the parameters), and how many runs equal the first bit
    for bit. Atomic adds in a GPU kernel's backward make the order of a gradient's sums, and so its last bits,
    change from run to run; on the CPU it is 0."""
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


# ---------------------------------------------------------------------------------------------------
# fsdp: train.parallel = "fsdp" on this one device, a world of one rank: the code path of many GPUs


def check_fsdp(s, report):
    """parallel.prepare as train.py runs it (each Block compiled, flex inside on CUDA, then fully_shard with
    the bf16 policy), BAM + SSMax with document masks, against the same model unsharded under bf16 autocast
    (the DDP path), and a torch.distributed.checkpoint save and load of its shards. The process group has one
    rank (NCCL on CUDA, gloo on CPU) and is taken down at the end."""
    import torch.distributed as dist

    procs = argparse.Namespace(device=s.device, distributed=False)
    parallel.init_distributed(procs, "fsdp")
    try:
        _fsdp_cases(s, report, parallel, load_checkpoint, step_path)
    finally:
        dist.destroy_process_group()


def _fsdp_cases(s, report, parallel, load_checkpoint, step_path):
    base = s.base
    if s.quick:
        model_cfg, batch_size = dataclasses.replace(base.model, n_layer=2, n_embd=64, n_head=4, vocab_size=512,
                                                    block_size=64), 2
    else:
        model_cfg, batch_size = base.model, 8
    model_cfg = dataclasses.replace(model_cfg, pe="bam", ssmax=True, attn_impl="auto")
    train_cfg = dataclasses.replace(base.train, parallel="fsdp", compile=True, optimizer="adamw", lr=1e-3)
    T = model_cfg.block_size
    batches = [documents_batch(batch_size, T, model_cfg.vocab_size, s.device, seed, used_tokens=64) for seed in range(3)]
    bf16 = s.bf16 is not None
    state = {}

    def steps(model, optimizer, autocast):
        losses = []
        for x, y, doc_ids in batches:
            with autocast:
                _, loss = model(x, y, doc_ids=doc_ids)
            loss.backward()
            parallel.clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    def sharded_model():
        torch.manual_seed(0)
        model = Transformer(model_cfg)
        parallel.prepare(model, train_cfg, argparse.Namespace(device=s.device), bf16, s.compile_backend)
        return model, build_optimizer(model, train_cfg, s.device)

    def policy_case():
        torch.manual_seed(0)
        reference = Transformer(model_cfg).to(s.device)
        ref_losses = steps(reference, build_optimizer(reference, train_cfg, s.device), s.autocast(s.bf16))
        model, optimizer = sharded_model()
        seen = []
        hook = model.blocks[0].attn.wq.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        losses = steps(model, optimizer, nullcontext())
        hook.remove()
        state.update(model=model, optimizer=optimizer)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
        drift = max(rel_err(weights[k], v) for k, v in reference.state_dict().items())
        # Adam moves every weight by ~lr a step whatever its gradient's size, so a weight whose bf16 gradient
        # differs in sign between the two paths ends lr-sized apart: the weights are shown, the losses judged.
        return {"ok": diff < 0.05 and seen[0] == (torch.bfloat16 if bf16 else torch.float32),
                "impl": model_module.attention_path(reference, T, T, True), "compiled": f"per Block, {s.compile_backend}",
                "weights_in_forward": str(seen[0]).removeprefix("torch."), "max_loss_diff": diff,
                "weights_rel_diff": drift, "losses": [round(v, 4) for v in losses]}
    report.run("fsdp (world 1) bam+ssmax docs, bf16 policy, compiled Blocks vs bf16 autocast", policy_case,
               expected_s=10 if s.quick else 60)

    def checkpoint_case():
        model, optimizer = state["model"], state["optimizer"]
        run_dir = os.path.join(report.out_dir, "fsdp_run")
        folder = step_path(run_dir, len(batches), sharded=True)
        parallel.save_fsdp_checkpoint(model, optimizer, {"step": len(batches)}, folder)
        fresh, fresh_optimizer = sharded_model()
        parallel.load_fsdp_checkpoint(fresh, fresh_optimizer, folder, load_checkpoint(folder, join_shards=False)[1])
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.state_dict().values(),
                                                                          fresh.state_dict().values()))
        whole = load_checkpoint(folder)[1]["model"]  # joined in this process, as the evaluators read it
        joined = all(torch.equal(whole[k], v.full_tensor().cpu()) for k, v in model.state_dict().items())
        next_loss = [steps(m, o, nullcontext())[0] for m, o in ((model, optimizer), (fresh, fresh_optimizer))]
        files = len(os.listdir(folder))
        remove_checkpoints(run_dir)  # what this case saved, and the folders it made for it once empty
        remove_empty_folders(run_dir, up_to=run_dir)
        return {"ok": same and joined and next_loss[0] == next_loss[1], "shards_equal": same, "joined_equal": joined,
                "next_step_loss": next_loss[0], "resumed_next_step_loss": next_loss[1],
                "files": files}
    report.run("fsdp DCP save + load (and joined into one process)", checkpoint_case, expected_s=5 if s.quick else 30)


SECTION_FUNCTIONS = {"training": check_training, "train_run": check_train_run,
                     "long_context": check_long_context, "correctness": check_correctness,
                     "graphs": check_graphs, "attention": check_attention, "prior_tables": check_prior_tables,
                     "fsdp": check_fsdp}


# ---------------------------------------------------------------------------------------------------


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    ap = Parser(prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder for gpu_check.md and gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --quick")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: every code path but CUDA's, for CI")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: the acceptance run, "
                         f"{','.join(ACCEPTANCE)}; all of them with --quick)")
    ap.add_argument("--budget_s", type=number(float, ">= 0"), default=None,
                    help=f"total time budget in seconds, split over the sections in proportion to their budgets "
                         f"(default: the sum of theirs, {sum(SECTIONS[name] for name in ACCEPTANCE)} for the "
                         f"acceptance run; none with --quick)")
    ap.add_argument("--data_dir", default=None,
                    help="train_run: token shards of the demo corpus made before (default: made under OUT)")
    ap.add_argument("--compile_backend", default=None,
                    help="torch.compile backend for the model (default: inductor on CUDA, aot_eager on CPU)")
    args = ap.parse_args(argv)
    args.argv = argv

    if args.sections is None:
        args.sections = ",".join(SECTIONS if args.quick else ACCEPTANCE)
    sections = [name for name in args.sections.split(",") if name]
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown or not sections:
        fail(f"--sections: unknown section(s) {', '.join(unknown) or '(none given)'}; allowed: {', '.join(SECTIONS)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        fail(f"--device {args.device!r} is not a device; use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: this machine has no CUDA GPU visible to torch (CPU: --device cpu --quick)")
    if device.type not in ("cuda", "cpu"):
        fail(f"--device {args.device}: only cuda and cpu are supported")
    if device.type == "cpu" and not args.quick:
        fail("the full check needs a CUDA GPU (121M-model training and 256K-token prompts); on CPU use --quick")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        fail(f"--out {args.out} exists and is not a folder")
    os.makedirs(args.out, exist_ok=True)

    threads = torch.get_num_threads()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # tiny shapes: a second thread only adds contention on a shared CI machine
    try:
        with counting_recompiles() as counting:
            return run_sections(args, sections, counting)
    finally:
        torch.set_num_threads(threads)


def run_sections(args, sections, counting_recompiles=True):
    s = Setup(args)
    planned = float(sum(SECTIONS[name] for name in sections))
    budget = args.budget_s if args.budget_s is not None else (None if args.quick else planned)
    env = {"device_name": s.device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "quick": args.quick, "peak_tflops": s.peak_tflops,
           "compile_backend": s.compile_backend, "budget_s": budget, "argv": sys.argv[1:] if args.argv is None else args.argv,
           "notes": []}
    if not s.cuda:
        env["notes"] += ["CPU: FlexAttention has no backward pass (torch 2.13), so correctness compares flex forward "
                         "with eager (one case: flex compiles C++ for half a minute per variant on a CPU) and sdpa "
                         "forward+backward with eager; the targets are the GPU's (n/a here).",
                         "CPU: no device-sync check (torch.cuda.set_sync_debug_mode is CUDA's); the graphs section "
                         "shows the forward traced without a graph break, which a host read of a tensor would cause."]
    if s.cuda and s.peak_tflops is None:
        env["notes"].append(f"no published bf16 peak known for {s.device_name!r} (train.PEAK_BF16_TFLOPS): no MFU")
    if not counting_recompiles:
        env["notes"].append("no torch._dynamo.guards.recompiles_log in this torch: in-process recompiles read 0")
    report = Report(args.out, env, budget, sections)
    print(f"gpu_check on {s.device_name}, torch {torch.__version__}; writing {args.out}/gpu_check.md", flush=True)
    for name in SECTIONS:
        if name not in sections:
            continue
        report.begin_section(name, SECTIONS[name])
        torch._dynamo.reset()  # each section compiles its own kernels; dynamo's recompile budget starts afresh
        try:
            SECTION_FUNCTIONS[name](s, report)
        except Exception as exc:  # a section's own set-up failed: record it, keep the other sections
            traceback.print_exc()
            report.add("(section)", "fail", {"error": one_line(exc)})
        report.end_section()
    report.write()
    failed = [c["name"] for c in report.cases if c["status"] == "fail"]
    print(f"\n{len(report.cases)} cases, {len(failed)} failed{': ' + '; '.join(failed) if failed else ''}; "
          f"{now() - report.start:.0f} s; {args.out}/gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
