"""training: the compiled bf16 step of the paper's 121M model, BAM + SSMax then RoPE (the throughput target
compares them): tokens/s, MFU, peak memory, compile time, whether the loss falls, the BlockMask's cost next to
the step; the same forward+backward under torch.cuda.set_sync_debug_mode("error")."""

import dataclasses
import statistics
from contextlib import contextmanager

import torch

import model as model_module
from bench.gpu_check.common import build_optimizer, documents_batch, quick_subset, variant_name
from bench.gpu_check.report import Case, Section, Skip, now
from model import PE_CHOICES, Transformer

TOKENS_RATIO = "training tokens/s, BAM+SSMax / RoPE"
MFU = "MFU of BAM+SSMax training"


def variants():
    """BAM + SSMax, then RoPE (the throughput target compares them), then NoPE and the rest (opt-in)."""
    first = [("bam", True), ("rope", False), ("nope", False)]
    return first + [(pe, ssmax) for ssmax in (False, True) for pe in PE_CHOICES if (pe, ssmax) not in first]


def shapes(s):
    """(model config, train config, batch size, warm-up steps, timed steps) of this run."""
    cfg = s.base
    if s.quick:
        # RAdam's first five steps are plain momentum steps: at the paper's lr the tiny model's loss would
        # not move within ten steps.
        return (dataclasses.replace(cfg.model, n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=64),
                dataclasses.replace(cfg.train, lr=10 * cfg.train.lr), 4, 2, 8)
    return cfg.model, cfg.train, cfg.data.batch_size, 4, 20


def plan(s):
    model_cfg, train_cfg, batch_size, warmup, timed = shapes(s)
    results = {}
    cases = []
    for i, (pe, ssmax) in enumerate(quick_subset(s, variants())):
        name = variant_name(pe, ssmax)
        run = Trainer(s, dataclasses.replace(model_cfg, pe=pe, ssmax=ssmax, attn_impl="auto"), train_cfg,
                      batch_size, warmup, timed)
        targets = {"bam+ssmax": (MFU,), "rope": (TOKENS_RATIO,)}.get(name, ())
        # The first case compiles the 121M model cold (inductor and Triton, flex's forward and backward kernels
        # included); the next ones reuse what inductor cached of it.
        expected = 20 if s.quick else (100 if i == 0 else 40)
        cases.append(Case(f"train {name}", expected, lambda run=run, name=name: train_case(s, run, name, results),
                          targets=targets, opt_in=i >= 2))
        if s.cuda:  # set_sync_debug_mode is CUDA's; before the next variant lets this one go
            cases.append(Case(f"no device sync in fwd+bwd: {name}", 2, lambda name=name: no_sync(s, name),
                              opt_in=i >= 1))
    return cases


# The last variant trained, kept for its sync check until the next one starts or the section ends.
HELD = {}


def release():
    """Let the held variant go: its model, optimizer and compiled graphs (dynamo's cache would keep them)."""
    if HELD:
        HELD.pop("run").free()  # the plan's cases keep the Trainer itself
        HELD.clear()
        torch._dynamo.reset()


@contextmanager
def tf32(s):
    precision = torch.get_float32_matmul_precision()
    if s.cuda:
        torch.set_float32_matmul_precision("high")  # as train.py: TF32 for whatever stays in fp32
    try:
        yield
    finally:
        release()
        torch.set_float32_matmul_precision(precision)


class Trainer:
    """One variant's compiled training step on a fixed set of batches, cycled, drawn from a part of the
    vocabulary: the loss must fall clearly below its first value within a few dozen steps (uniform random
    tokens would leave it at ln(vocab))."""

    def __init__(self, s, model_cfg, train_cfg, batch_size, warmup, timed):
        self.s, self.model_cfg, self.train_cfg = s, model_cfg, train_cfg
        self.batch_size, self.warmup, self.timed = batch_size, warmup, timed
        self.dtype = s.bf16 if s.cuda else torch.float32  # CPU quick: fp32, as CPU training runs

    def build(self):
        s = self.s
        T, vocab = self.model_cfg.block_size, self.model_cfg.vocab_size
        self.batches = [documents_batch(self.batch_size, T, vocab, s.device, seed, used_tokens=vocab // 8)
                        for seed in range(4)]
        torch.manual_seed(0)
        self.model = Transformer(self.model_cfg).to(s.device)
        self.optimizer = build_optimizer(self.model, self.train_cfg, s.device)
        self.compiled = torch.compile(self.model, backend=s.compile_backend)

    def free(self):
        self.batches = self.model = self.optimizer = self.compiled = None

    def step(self, batch):
        x, y, doc_ids = batch
        with self.s.autocast(self.dtype):
            _, loss = self.compiled(x, y, doc_ids=doc_ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed_steps(self):
        """(losses, seconds of each step, peak memory in bytes); the first step holds the compilation."""
        s, losses, times = self.s, [], []
        if s.cuda:
            torch.cuda.reset_peak_memory_stats(s.device)
        with s.peak_memory() as mem:
            for i in range(self.warmup + self.timed):
                s.sync()
                t0 = now()
                losses.append(self.step(self.batches[i % len(self.batches)]))
                s.sync()
                times.append(now() - t0)
        return torch.stack(losses).float().cpu(), times, mem.bytes  # one read at the end: no sync in the steps

    def block_mask_seconds(self):
        """The BlockMask of one batch (document masking), built as the model's forward builds it."""
        s, (_, _, doc_ids) = self.s, self.batches[0]
        times = []
        for _ in range(5):
            s.sync()
            t0 = now()
            model_module.make_block_mask(doc_ids, doc_ids.shape[1], s.device)
            s.sync()
            times.append(now() - t0)
        return statistics.median(times)


def train_case(s, run, name, results):
    release()
    HELD.update(run=run, name=name)
    run.build()
    losses, times, peak = run.timed_steps()
    step_s = statistics.median(times[run.warmup:])
    T = run.model_cfg.block_size
    tokens_per_s = run.batch_size * T / step_s
    mfu = run.model.flops_per_token(T) * tokens_per_s / (s.peak_tflops * 1e12) if s.peak_tflops else None
    first, last = float(losses[0]), float(losses[-len(run.batches):].mean())
    falls = bool(torch.isfinite(losses).all()) and last < first - 0.1
    mask_s = run.block_mask_seconds()
    HELD["trained"] = True
    results[name] = {"tokens_per_s": tokens_per_s, "mfu": mfu}
    record_targets(s, name, results)
    return {"ok": falls, "impl": model_module.attention_path(run.model, T, T, True), "batch": f"{run.batch_size}x{T}",
            "tokens_per_s": round(tokens_per_s), "step_ms": step_s * 1e3, "mfu": mfu if mfu is None else round(mfu, 3),
            "peak_mem_GiB": peak / 2**30, "compile_s": round(times[0] - step_s, 1), "loss_first": first,
            "loss_last": last, "loss_falls": falls, "block_mask_ms": mask_s * 1e3, "block_mask_share": mask_s / step_s}


def record_targets(s, name, results):
    if name == "bam+ssmax":
        mfu = results[name]["mfu"]
        s.report.target(MFU, mfu, ">= 0.40", None if mfu is None else mfu >= 0.40)
    if name == "rope" and "bam+ssmax" in results:
        ratio = results["bam+ssmax"]["tokens_per_s"] / results["rope"]["tokens_per_s"]
        s.report.target(TOKENS_RATIO, round(ratio, 3), ">= 0.85", ratio >= 0.85)


def no_sync(s, name):
    """The compiled forward+backward once more, with CUDA raising on any device-to-host synchronisation."""
    if HELD.get("name") != name or not HELD.get("trained"):
        raise Skip("its training case did not finish")
    run = HELD["run"]
    x, y, doc_ids = run.batches[0]
    s.sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with s.autocast(run.dtype):
            _, loss = run.compiled(x, y, doc_ids=doc_ids)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    run.model.zero_grad(set_to_none=True)
    return {"result": "no sync"}


SECTION = Section("training", plan, default=True, around=tf32,
                  what="the 121M model compiled, bf16, flex: BAM + SSMax, then RoPE: tokens/s, MFU, peak memory")
