"""What the sections share: the run's Setup, batches of documents, the tolerances and the comparison of a path
with the eager reference, the small model those comparisons use."""

import os
import platform
from contextlib import contextmanager, nullcontext

import torch

import model as model_module
from bam.config import load_config
from bam.data import EOT, document_ids
from bench.peak_memory import PeakMemory
from model import Transformer
from train import PEAK_BF16_TFLOPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_CONFIG = os.path.join(ROOT, "configs/paper/bam_ssmax_512.toml")  # the 121M model, the paper's training
# Where `python -m bench.gpu_check.prepare` puts what the run needs, and where the run looks by default: an
# ignored folder (data/ is in .gitignore) that travels with the repository to a GPU machine.
PREPARED_DIR = os.path.join(ROOT, "data", "gpu_check")
DEMO_DATA = os.path.join(PREPARED_DIR, "demo")

# Tolerances of the comparisons with the eager reference, as a normwise relative error: max |got - ref| / max |ref|
# per tensor. fp32 (TF32 off): both paths round every product at 2^-24 and differ only in the order of sums
# (flex's online softmax over 128-key blocks against one softmax over the row); a parameter's gradient adds up
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
# chance. The defects these checks exist for (a gradient missing or wrong through the tensors a
# score_mod captures, pytorch issues 158212 and 157677) are errors of order 100%.
BF16_FACTOR, BF16_FLOOR = 3.0, 5e-2


class Setup:
    """What every section needs to know about this run. Nothing is asked of the device until probe(): --plan
    and the preflight run first."""

    def __init__(self, args):
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick, self.all = args.quick, args.all
        self.compile_backend = args.compile_backend or ("inductor" if self.cuda else "aot_eager")
        self.bf16 = torch.bfloat16
        self.base = load_config(BASE_CONFIG)
        self.device_name, self.peak_tflops = "(not probed)", None
        self.data_dir, self.work_dir = args.data_dir, args.work_dir
        self.report = None  # the run's Report, once it exists: the cases read their limits and record targets

    def probe(self):
        if self.cuda:
            self.device_name = torch.cuda.get_device_name(self.device)
            self.bf16 = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
            self.peak_tflops = next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in self.device_name), None)
        else:
            self.device_name = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def autocast(self, dtype):
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def peak_memory(self):
        return PeakMemory(self.device)


@contextmanager
def flex_kernels_traced_by(backend):
    """--quick on a CPU: the model's FlexAttention kernels compiled by `backend` (aot_eager: dynamo and AOT
    autograd trace them as on a GPU, and flex's own reference math runs them) instead of inductor's C++, which
    takes ~30 s a kernel on a small CPU. The same calls, the same comparisons; the GPU's kernels are Triton's
    either way. model.py builds its kernels with torch.compile into model._FLEX_KERNELS, which starts empty
    here so that every kernel of the run is built with `backend`."""
    kernels = getattr(model_module, "_FLEX_KERNELS", None)
    if kernels is None:
        raise RuntimeError("model._FLEX_KERNELS is gone: give bench/gpu_check/common.py the new home of the "
                           "compiled flex kernels")
    compile_, kept = torch.compile, dict(kernels)

    def compile_with_backend(fn=None, **options):
        return compile_(fn, **{**options, "backend": backend})
    kernels.clear()
    torch.compile = compile_with_backend
    try:
        yield
    finally:
        torch.compile = compile_
        kernels.clear()
        kernels.update(kept)


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


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def rel_err(got, ref):
    """Normwise relative error: max |got - ref| / max |ref| (0 where both are 0)."""
    got, ref = got.detach().double(), ref.detach().double()
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def build_optimizer(model, train_cfg, device):
    """As train.py: the prior and SSMax parameters in their own group with their own learning rate."""
    groups = model.optim_groups(train_cfg.weight_decay)
    for group in groups:
        group["lr"] = (train_cfg.prior_lr or train_cfg.lr) if group["name"] == "prior" else train_cfg.lr
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, betas=train_cfg.betas, eps=train_cfg.eps, fused=True)
    return torch.optim.RAdam(groups, betas=train_cfg.betas, eps=train_cfg.eps, decoupled_weight_decay=True)


# ---------------------------------------------------------------------------------------------------
# A path against the eager reference, on a small model with the real head width


# ModelConfig's switches that change every layer's attention whatever the encoding (learned sinks, which change
# the flex kernel, and gated attention).
ATTENTION_SWITCHES = ("attn_sink", "attn_gate")
# Per-layer patterns (model.layer_pattern) on the 2-layer model: RNoPE-SWA, and BAM + SSMax global with a RoPE
# window, each layer with its own window, prior and SSMax; the window cuts through flex's blocks.
LAYER_PATTERNS = {"rnope-swa": dict(pe="rope", ssmax=False, layer_pattern="rope@100 nope@full"),
                  "bam+ssmax-global": dict(pe="bam", ssmax=False, layer_pattern="rope@100 bam+ssmax@full")}


def correctness_model(s, pe, ssmax, seed=0, settings=None, switches=(), **kw):
    """A 2-layer model with the real head width (48: 4 heads of 192 on a GPU) and every prior/SSMax/sink
    parameter moved off its init, so that no case passes because of a special value (ALiBi's shape exactly 1,
    SSMax's scale exactly 1, a sink at 0). `settings`: more ModelConfig fields (one of the encoding's
    checked_settings); `switches`: the ATTENTION_SWITCHES turned on."""
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
        out.update(gradients(model))
    return out


def gradients(model):
    return {f"grad {name}": (p.grad.float().clone() if p.grad is not None else None)
            for name, p in model.named_parameters() if p.requires_grad}


def compare(got, ref, eager_low=None):
    """Every tensor of `got` against the fp32 reference `ref`: within FP32_TOL, or in bf16 (`eager_low`, the
    eager path under the same autocast) within BF16_FACTOR times the eager path's own error or BF16_FLOOR.
    Reports the tensor that comes closest to (or furthest past) its tolerance."""
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


def path_against_eager(s, model, impl, docs, dtype, backward):
    """One comparison: `impl` against the eager reference in fp32 (and eager at `dtype`, the bar)."""
    batch = correctness_batch(s, docs)
    ref = forward_backward(model, "eager", batch, nullcontext(), backward)
    got = forward_backward(model, impl, batch, s.autocast(dtype), backward)
    low = forward_backward(model, "eager", batch, s.autocast(dtype), backward) if dtype != torch.float32 else None
    return {"pass": "fwd+bwd" if backward else "fwd only (no flex backward on CPU)", **compare(got, ref, low)}


@contextmanager
def fp32_reference_precision():
    """The fp32 reference and the fp32 flex kernel without TF32 (inductor's flex template follows this setting)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


@contextmanager
def static_kernels(s):
    """Each shape compiles a kernel of its own: dynamo makes no dimension dynamic when a second shape comes, so a
    timed kernel is the one a run at that shape alone would compile."""
    # local PGO would mark as dynamic what an earlier process saw vary (the long-context sweep's lengths)
    settings = {name: False for name in ("automatic_dynamic_shapes", "automatic_dynamic_local_pgo")
                if hasattr(torch._dynamo.config, name)}
    with torch._dynamo.config.patch(**settings):
        yield
