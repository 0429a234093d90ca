"""
How much memory a training run needs on each rank, before any is allocated: `python train.py CONFIG
--dry_run --world_size=8,64` prints it for DDP and FSDP, so a model size, a batch and a number of GPUs can be
chosen before a cluster is. The model is built on the meta device (shapes only), one layer of it (the layers are
alike: Sizes.of multiplies); nothing is trained.

Per rank, for P parameters on W ranks (bytes; fp32 weights, as train.py keeps them):

    DDP   weights 4P, gradients 4P, AdamW/RAdam's two moments 8P; buffers: DDP's gradient buckets (4P)
          and, with bf16 autocast, the bf16 copies of the weights autocast keeps for the backward (2P)
    FSDP  the same divided by W (shards); buffers: the bf16 (or fp32) weights of the groups gathered at once:
          two Blocks (the one computing and the one prefetched) or, with reshard_after_forward = false, every
          Block from its forward to its backward, plus norm + lm_head and the embedding; with
          fsdp_grad_sync = "step" and accumulation, the whole model's fp32 gradients (4P) on every rank

Activations of one micro-batch of N = batch_size x block_size tokens, in the compute dtype (b = 2 bytes in bf16),
as the GPU runs them (FlexAttention or flash: O(T) memory per head; the CPU's dense-bias path is not this):

    per Block    N (9 C + 2 C_kv + 4 F) b + 4 N H: its input, what each RMSNorm keeps (input, normalised, output:
                 eager PyTorch's; CUDA's fused kernel and torch.compile keep less), q, k, v, the attention
                 output and its copy for wo, SwiGLU's two projections, the gate and their product, and the
                 attention's log-sum-exp (C = n_embd, C_kv = key/value width, F = SwiGLU width)
    the head     2 N C b, and the log-softmax of the logits, 4 N V bytes (V = vocab_size); its backward needs
                 two more N x V fp32 tensors at once, the largest transient of the step
    no AC        L x per Block + the head
    full AC      L x N C b (each Block keeps only its input) + the head, and one Block's activations again while
                 its backward recomputes it

bench/train_memory.py checks these against the peak that torch's MemTracker measures on CPU (docs/benchmarks.md).
"""

import dataclasses

import torch

from model import ENCODINGS, Transformer

GiB = 2**30


@dataclasses.dataclass
class Sizes:
    """Parameter counts of a model, by FSDP group."""

    total: int
    blocks: int
    largest_block: int
    embedding: int
    head: int  # norm + lm_head
    priors: int  # the root group

    @classmethod
    def of(cls, model_config):
        """Counted on a model of one layer, built on the meta device (shapes only: a 7B model costs nothing
        here): every Block is Block(config) and every prior module encoding(config), the same shapes in each
        layer, so each is counted once and multiplied by its number of copies. Planning 100,000 layers then
        takes as long as planning one (building them all took 10 ms a layer)."""
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        if model_config.layer_pattern:  # layers of several kinds: counted at the real depth
            return cls.counted(_on_meta(model_config), count)
        model = _on_meta(dataclasses.replace(model_config, n_layer=1))
        block = count(model.blocks[0])
        copies = ENCODINGS[model_config.pe].copies(model_config)  # prior modules at the real depth (per layer, or one)
        priors = copies * count(model.priors[0]) if copies else 0
        rest = count(model) - block - sum(count(p) for p in model.priors)  # embedding, final norm, head
        head = count(model.norm) + (0 if model_config.tie_embeddings else count(model.lm_head))  # tied: the embedding's
        return cls(total=rest + model_config.n_layer * block + priors, blocks=model_config.n_layer * block,
                   largest_block=block, embedding=count(model.tok_emb), head=head, priors=priors)

    @classmethod
    def counted(cls, model, count):
        """The Sizes of a built model, layer by layer (a layer_pattern's Blocks differ: SSMax's scales)."""
        blocks = [count(block) for block in model.blocks]
        priors = sum(count(p) for p in model.priors)
        head = count(model.norm) + (0 if model.config.tie_embeddings else count(model.lm_head))
        return cls(total=count(model), blocks=sum(blocks), largest_block=max(blocks), embedding=count(model.tok_emb),
                   head=head, priors=priors)


def _on_meta(model_config):
    """The model built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(model_config)


def available_bytes(device):
    """Bytes that can be allocated on `device` now: the GPU's free memory (plus what torch caches), or the
    host's available memory within the container's cgroup limit."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    # In a container /proc/meminfo shows the host; the cgroup limit is what will kill us.
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit = f.read().strip()
                if limit != "max" and int(limit) < 1 << 60:
                    avail = min(avail, int(limit) - int(g.read()))
        except (OSError, ValueError):
            continue
        break
    return avail


def check_training_fits(cfg, world_size, device, bf16):
    """A one-line reason when the run's weights, gradients and optimizer state alone (static_bytes, per rank)
    cannot fit in the memory free on `device` now, "" when they can: asked before the model is built, so a
    mistyped size (model.n_embd = 1_000_000) is one line, not the allocator's error. Activations, which
    depend on the implementation more, are left to the --dry_run plan."""
    t = cfg.train
    need = sum(static_bytes(Sizes.of(cfg.model), t.parallel, world_size, bf16, t.reshard_after_forward).values())
    free = available_bytes(device)
    if need <= free:
        return ""
    return (f"the model's weights, gradients and optimizer state need about {need / GiB:,.1f} GiB per rank but "
            f"{free / GiB:,.1f} GiB is free on {device}; `train.py CONFIG --dry_run` shows the plan")


def static_bytes(sizes, parallel, world_size, bf16, reshard_after_forward=True, grad_sync="micro_batch",
                 accum_steps=1):
    """{"weights", "grads", "optimizer", "buffers"}: bytes per rank that do not depend on the batch."""
    P = sizes.total
    if parallel == "ddp":
        return {"weights": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "buffers": 4 * P + (2 * P if bf16 else 0)}
    gathered = 2 if bf16 else 4
    blocks = sizes.blocks if not reshard_after_forward else 2 * sizes.largest_block
    buffers = gathered * (blocks + sizes.head + sizes.embedding)
    if grad_sync == "step" and accum_steps > 1:
        buffers += 4 * P
    return {"weights": 4 * P / world_size, "grads": 4 * P / world_size, "optimizer": 8 * P / world_size,
            "buffers": buffers}


def activation_bytes(model_config, tokens, bf16, checkpointing):
    """Peak bytes of one micro-batch's forward and backward over `tokens` tokens, with activation checkpointing
    "none" or "full" (per Block)."""
    m, N = model_config, tokens
    b = 2 if bf16 else 4
    C, C_kv, F, H, V, L = m.n_embd, m.kv_heads * m.head_dim, m.hidden_dim, m.n_head, m.vocab_size, m.n_layer
    block = N * (9 * C + 2 * C_kv + 4 * F) * b + 4 * N * H
    if m.qk_norm:  # the normalised q and k beside the projections, and an fp32 inverse RMS per row and head
        block += N * (C + C_kv) * b + 4 * N * (H + m.kv_heads)
    head = 2 * N * C * b + 4 * N * V
    head_backward = 2 * 4 * N * V
    if checkpointing == "none":
        return L * block + head + head_backward
    return L * N * C * b + head + max(head_backward, block)


def fitting_batch(tokens_per_step, block_size, world_size, batch_size):
    """data.batch_size if train.tokens_per_step splits into it on world_size ranks, else the largest that does
    below it (config.check's rule), or None."""
    fits = [b for b in range(batch_size, 0, -1) if tokens_per_step % (b * block_size * world_size) == 0]
    return fits[0] if fits else None


def dry_run(cfg, world_sizes):
    """The memory table of train.py --dry_run, as text: per rank, at each world size, for DDP and FSDP."""
    m, t, d = cfg.model, cfg.train, cfg.data
    sizes = Sizes.of(m)
    bf16 = t.dtype != "float32"  # "auto" is bf16 on the GPUs this is for
    lines = [
        f"{sizes.total / 1e9:.2f}B parameters ({sizes.total:,}): {m.n_layer} Blocks of "
        f"{sizes.largest_block / 1e6:.1f}M, "
        f"tok_emb {sizes.embedding / 1e6:.1f}M, norm + lm_head {sizes.head / 1e6:.1f}M, priors {sizes.priors:,} "
        f"({m.encoding_label}; {m.n_layer} x {m.n_embd} wide, {m.n_head} heads"
        f"{f', {m.n_kv_head} kv heads' if m.n_kv_head else ''}, SwiGLU {m.hidden_dim}, context {m.block_size})",
        f"{'bf16' if bf16 else 'fp32'} compute, fp32 weights and AdamW/RAdam moments; {t.tokens_per_step:,} tokens "
        f"per step; micro-batches of data.batch_size = {d.batch_size} sequences per rank, or the largest that "
        "splits the step on that many GPUs",
        "",
        "GiB per rank     GPUs  batch  accum   weights     grads optimizer   buffers    static  +acts(none)  "
        "+acts(full)"]
    for world in world_sizes:
        batch = fitting_batch(t.tokens_per_step, m.block_size, world, d.batch_size)
        if batch is None:
            lines.append(f"  {'':<12} {world:>6}  train.tokens_per_step = {t.tokens_per_step:,} does not split over "
                         f"{world} GPUs x {m.block_size} tokens")
            continue
        accum = t.tokens_per_step // (batch * m.block_size * world)
        acts = {ac: activation_bytes(m, batch * m.block_size, bf16, ac) for ac in ("none", "full")}
        for parallel in ("ddp", "fsdp"):
            s = static_bytes(sizes, parallel, world, bf16, t.reshard_after_forward, t.fsdp_grad_sync, accum)
            static = sum(s.values())
            lines.append(f"  {parallel:<12} {world:>6} {batch:>6} {accum:>6} {s['weights'] / GiB:>9.2f} "
                         f"{s['grads'] / GiB:>9.2f} {s['optimizer'] / GiB:>9.2f} {s['buffers'] / GiB:>9.2f} "
                         f"{static / GiB:>9.2f} {(static + acts['none']) / GiB:>12.2f} "
                         f"{(static + acts['full']) / GiB:>12.2f}")
    lines += ["", "batch, accum: sequences per micro-batch and accumulation steps per step on each rank. acts: one "
              "micro-batch's activations without and with activation checkpointing (full). FSDP buffers: the "
              f"gathered groups (reshard_after_forward = {str(t.reshard_after_forward).lower()}, fsdp_grad_sync = "
              f"{t.fsdp_grad_sync!r}). Estimates (bam/sizing.py); leave ~10% for the allocator and the CUDA context."]
    return "\n".join(lines)
