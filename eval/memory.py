"""Memory, the constraint that shapes the evaluators: estimate what a forward needs, compare it with what
is free right now, recognise running out.

A forward pass at 256K tokens must stay O(T): the model never builds a T x T matrix on its fused path, and
asks the LM head only for the positions that are scored (`last_k`), so a prompt at any length costs a few
activations of T x n_embd per layer. Before each length the evaluators estimate that cost and compare it
with the memory free, so a length that cannot fit stops the sweep with one clear line instead of taking
the machine down, and what was measured up to there is already on disk.
"""

from contextlib import contextmanager

import torch

from bam.sizing import available_bytes  # noqa: F401  (the evaluators' and training's one measure)
from model import Transformer, attention_path

# Peak bytes of one no-grad forward per token and per unit of n_embd (fp32 activations, FlexAttention),
# measured with bench/eval_memory.py (docs/benchmarks.md) and rounded up: a handful of (T, n_embd)-sized
# tensors live at once (residual, norm, q/k/v and their contiguous copies, the SwiGLU halves at 2 x n_embd).
ACTIVATION_BYTES = 48
SAFETY = 0.85  # of the memory free now: leave room for the allocator's slack and other processes


class OutOfMemory(Exception):
    """A length that does not fit in the memory available; the sweep stops and keeps its results."""


def forward_bytes(model, batch, length, scored):
    """Bytes a teacher-forced forward of (batch, length) tokens needs beyond the weights, scoring the last
    `scored` positions: linear in length on the fused path, plus the T x T bias where the model's `auto`
    choice (or an explicit sdpa/eager) materialises one."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 16 * batch * length  # hand-made test models: the token ids and little else
    tokens = batch * length
    need = ACTIVATION_BYTES * tokens * max(cfg.n_embd, getattr(cfg, "hidden_dim", 0) // 2)
    need += 8 * batch * scored * cfg.vocab_size  # fp32 logits and their argmax/softmax temporaries
    need += 16 * tokens  # token ids, positions, SSMax's log n
    with torch.no_grad():  # the model's own policy, so the two cannot disagree
        impl = attention_path(model, length, length, False) if isinstance(model, Transformer) else "flex"
    if impl == "flex":
        need += 8 * (length // 128 + 1) ** 2  # the causal BlockMask's block indices
    ssmax = any(block.attn.ssmax_scale is not None for block in getattr(model, "blocks", ()))  # in some layer
    dense = impl == "eager" or (impl == "sdpa" and (len(getattr(model, "priors", ())) > 0 or ssmax))
    if dense:
        need += 3 * 4 * batch * cfg.n_head * length * length  # bias, masked bias, probabilities (fp32)
    return need


def plan_batch(model, want, length, scored, device, extra_per_sequence=0):
    """The largest batch <= want whose forward (plus `extra_per_sequence` bytes of the evaluator's own per
    sequence) fits now; OutOfMemory if not even one sequence does."""
    def need(batch):
        return forward_bytes(model, batch, length, scored) + batch * extra_per_sequence

    avail = available_bytes(device)
    batch = max(1, want)
    while batch > 1 and need(batch) > SAFETY * avail:
        batch //= 2
    if need(batch) > SAFETY * avail:
        raise OutOfMemory(f"length {length:,} needs about {need(batch) / 2**30:.1f} GiB for one sequence but "
                          f"{avail / 2**30:.1f} GiB is free on {device}")
    return batch


def generation_bytes(model, batch, prompt, new_tokens):
    """Bytes model.generate needs for `batch` sequences of `prompt` tokens plus `new_tokens`: the KV cache
    it preallocates (keys and values of every layer, in the weights' dtype; a windowed cache keeps only the
    window), plus the prompt's forward."""
    cfg = model.config
    weight = next(model.parameters())
    kept = sum(min(prompt + new_tokens, kind.window) if kind.window else prompt + new_tokens
               for kind in cfg.layer_kinds)  # positions, over the layers (each its own window)
    cache = 2 * batch * cfg.kv_heads * cfg.head_dim * kept * weight.element_size()
    return cache + forward_bytes(model, batch, prompt, 1)


def check_fits(need, device, what):
    """OutOfMemory `what needs about X GiB but Y GiB is free on DEVICE` unless `need` bytes fit now: asked
    before anything of that size is built, so an impossible size is one line, not an allocator's error."""
    avail = available_bytes(device)
    if need > SAFETY * avail:
        raise OutOfMemory(f"{what} needs about {need / 2**30:,.1f} GiB but {avail / 2**30:.1f} GiB is free on {device}")


def is_out_of_memory(exc):
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


@contextmanager
def stop_when_out_of_memory(what, device):
    """Running out of memory inside (the allocator's error, whatever raised it) becomes OutOfMemory,
    which ends a sweep and keeps its results; every other error passes through."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        raise OutOfMemory(f"out of memory {what} on {device} ({str(e).splitlines()[0][:120]})") from None
