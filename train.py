"""
Pretrain a language model with one positional encoding (NoPE, RoPE, ALiBi, sinusoidal, BAM;
each optionally with SSMax) on token shards, on CPU, one GPU, or many through torchrun.

    python train.py                                    # configs/tiny.toml: a few minutes on CPU
    python train.py configs/paper/bam_ssmax_512.toml --train.max_steps=100 --log.out_dir=runs/try
    torchrun --standalone --nproc_per_node=8 train.py configs/paper/bam_ssmax_512.toml
    python train.py configs/paper/bam_ssmax_512.toml --resume    # continue from the newest checkpoint

The run directory (log.out_dir) gets config.toml (the resolved config), metrics.jsonl (one JSON
object per logged step, including every head's prior parameters) and checkpoints/ (the last
train.keep_last step checkpoints, each enough to resume exactly, and best.pt, the weights with the
lowest validation loss). `python train.py --help` lists every config key and its default.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from config import ConfigError, check, describe, load_config, to_dict, to_toml
from data import EOT, ShardLoader, get_tokenizer
from model import Transformer
from retrieval import passkey_answer_targets

# Dense bf16 tensor-core peaks per GPU in TFLOPs, matched against the CUDA device name in this order.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]

# Settings that may differ between a checkpoint and the run that resumes from it; any other
# difference would make the resumed run a different experiment (or not load at all).
CHANGEABLE_ON_RESUME = {
    "model": {"attn_impl"},
    # The loader's state is a position in tokens, valid for any batch size and number of ranks.
    "data": {"data_dir", "batch_size"},
    "train": {"max_steps", "lr", "prior_lr", "grad_clip", "val_every", "val_tokens", "ckpt_every",
              "keep_last", "compile", "dtype", "seed"},
    "log": {"out_dir", "log_every", "wandb", "wandb_project", "run_name", "peak_tflops"},
}


def fail(message, master=True):
    # One line and a non-zero exit for anything the user can fix; every rank exits, one speaks.
    if master:
        print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def lr_multiplier(step, train):
    """Learning-rate factor for the update with 0-based index `step`: linear warmup, then decay
    to train.min_lr_frac. A plain function of the step, so resuming needs nothing but the step."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.decay == "constant":
        return 1.0
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps))
    remaining = 0.5 * (1 + math.cos(math.pi * progress)) if train.decay == "cosine" else 1 - progress
    return train.min_lr_frac + (1 - train.min_lr_frac) * remaining


def peak_flops(device, bf16, override_tflops):
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda" or not bf16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def save_atomic(obj, path):
    """Temp file in the same directory, fsync, rename, fsync the directory: a crash at any moment
    leaves the previous file or the complete new one under `path`, never a torn one."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def step_checkpoints(ckpt_dir):
    # Zero-padded step numbers sort by name; temp files (.pt.tmp) never match.
    return sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))


def rng_state():
    # Plain lists and tensors only, so that checkpoints load with torch.load(weights_only=True).
    _, key, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [key.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_conflicts(saved, current):
    """Settings that differ from the checkpoint's, split into (not allowed, allowed)."""
    forbidden, allowed = [], []
    for section, table in current.items():
        for key, value in table.items():
            if key not in saved.get(section, {}):
                continue  # a setting newer than the checkpoint: its default is what the run had
            old = saved[section][key]
            if isinstance(value, tuple):
                old = tuple(old)
            if old != value:
                change = f"{section}.{key}: {old!r} -> {value!r}"
                (allowed if key in CHANGEABLE_ON_RESUME.get(section, ()) else forbidden).append(change)
    return forbidden, allowed


def next_batch(loader, loss_on, device):
    """(x, y, doc_ids) on `device`, with y's ignored targets set to -1 as `data.loss_on` says."""
    x, y, doc_ids = loader.next_batch()
    if loss_on == "passkey_answers":
        y = passkey_answer_targets(x, y, get_tokenizer())
    return tuple(v.to(device, non_blocking=True) for v in (x, y, doc_ids))


def loss_of(model, batch, doc_mask, loss_on):
    x, y, doc_ids = batch
    return model(x, y, doc_ids=doc_ids if doc_mask else None, sparse_targets=loss_on != "all")[1]


def targets_in(batch, loss_on) -> int:
    """How many targets a batch's mean loss averages over (1 for "all": every batch has the same)."""
    return 1 if loss_on == "all" else int((batch[1] != -1).sum())


def loss_weights(batches, loss_on, device, ddp, world_size):
    """Weights of the micro-batches' mean losses that make the step's gradient the mean over every
    target of the step on every rank (DDP then averages over ranks): n_i * world_size / N. That is
    1 / accum_steps when every token is a target; passkey answers differ in number per micro-batch,
    and one without any weighs nothing instead of pulling the mean towards 0."""
    if loss_on == "all":
        return [1 / len(batches)] * len(batches)  # no count to exchange: they are all equal
    counts = [targets_in(b, loss_on) for b in batches]
    total = torch.tensor(float(sum(counts)), device=device)
    if ddp:
        dist.all_reduce(total)
    return [n * world_size / max(total.item(), 1.0) for n in counts]


@torch.no_grad()
def evaluate(model, loader, batches, autocast, device, doc_mask, loss_on, ddp):
    # The same slice every time (reset), so val losses of one run compare across steps.
    model.eval()
    loader.reset()
    loss_sum, count = torch.zeros((), device=device), 0  # sum of (mean loss x its targets), targets
    for _ in range(batches):
        batch = next_batch(loader, loss_on, device)
        with autocast:
            loss = loss_of(model, batch, doc_mask, loss_on)
        n = targets_in(batch, loss_on)
        loss_sum += loss.float() * n
        count += n
    total = torch.stack([loss_sum, torch.tensor(float(count), device=device)])
    if ddp:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp_min(1)).item()


def metrics_step(line):
    # A line cut short by a kill reads as past every checkpoint, so it is dropped on resume.
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def rounded(tree):
    # Six significant digits keep metrics.jsonl small with hundreds of prior parameters per row.
    if isinstance(tree, dict):
        return {k: rounded(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [rounded(v) for v in tree]
    return float(f"{tree:.6g}") if isinstance(tree, float) else tree


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Pretrain a language model. Override any config key with --section.key=value.",
        epilog="config keys and their defaults (the paper's 12-layer run):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("config", nargs="?", default="configs/tiny.toml", help="TOML file (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in log.out_dir (start fresh if there is none)")
    args, overrides = parser.parse_known_args(argv)

    # -------------------------------------------------------------------------------------------
    # Config and processes. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; without them we are alone.
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    master = rank == 0
    try:
        cfg = load_config(args.config, overrides)
        check(cfg, world_size)
    except ConfigError as e:
        fail(e, master)
    m, t, log = cfg.model, cfg.train, cfg.log
    batch_size, seq_len = cfg.data.batch_size, m.block_size
    accum_steps = t.tokens_per_step // (batch_size * seq_len * world_size)

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays in fp32
    else:
        device = torch.device("cpu")
    bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    # -------------------------------------------------------------------------------------------
    # Data, and the run directory's state, checked before anything is written.
    data_dir = cfg.data.data_dir
    if not glob.glob(os.path.join(data_dir, "*_train_*.bin")):
        fail(f"data.data_dir = {data_dir!r} holds no *_train_*.bin shards; make them with prepare_fineweb.py "
             f"(e.g. `python prepare_fineweb.py --source demo --out_dir {data_dir}`)", master)
    try:
        train_loader = ShardLoader(data_dir, "train", batch_size, seq_len, rank, world_size)
        val_loader = ShardLoader(data_dir, "val", batch_size, seq_len, rank, world_size) if t.val_every else None
    except (OSError, ValueError) as e:  # data.ShardError is a ValueError
        fail(f"cannot use the shards in {data_dir}: {e}", master)
    if cfg.data.loss_on != "all":  # a look at the first batch (a fresh loader: nothing is consumed)
        probe = ShardLoader(data_dir, "train", batch_size, seq_len, rank, world_size)
        if not (next_batch(probe, cfg.data.loss_on, "cpu")[1] != -1).any():
            fail(f"data.loss_on = {cfg.data.loss_on!r} but the first batch from {data_dir} has no passkey answer "
                 f"to train on; prepare the data with --retrieval_fraction (docs/repro.md)", master)
    # A short validation split is used whole rather than read around twice.
    val_batches = min(t.val_tokens // (batch_size * seq_len * world_size), val_loader.batches_per_epoch) if val_loader else 0

    if m.vocab_size <= EOT:
        fail(f"model.vocab_size = {m.vocab_size} cannot hold the GPT-2 tokens of the shards (up to {EOT}); use 50257 or more", master)

    ckpt_dir = os.path.join(log.out_dir, "checkpoints")
    existing = step_checkpoints(ckpt_dir)
    if existing and not args.resume:
        fail(f"{log.out_dir} already holds checkpoints (newest {os.path.basename(existing[-1])}); "
             "pass --resume to continue that run or choose another --log.out_dir", master)
    ckpt = None
    if args.resume and existing:
        ckpt = torch.load(existing[-1], map_location="cpu", weights_only=True)
        forbidden, changed = resume_conflicts(ckpt["config"], to_dict(cfg))
        if forbidden:
            fail(f"cannot resume {existing[-1]} with different settings ({'; '.join(forbidden)}); "
                 f"only these may change: {', '.join(f'{s}.{k}' for s, ks in CHANGEABLE_ON_RESUME.items() for k in sorted(ks))}",
                 master)
        if master and changed:
            print(f"resuming with changed settings: {'; '.join(changed)}")
    start_step = ckpt["step"] if ckpt else 0

    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)

    # -------------------------------------------------------------------------------------------
    # Model and optimizer. Every rank seeds alike so the initial weights agree (DDP also
    # broadcasts rank 0's at wrap time); the model has no dropout, so nothing else draws.
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    model = Transformer(m)
    if ckpt:
        model.load_state_dict(ckpt["model"])
    model.to(device)
    raw_model = model  # unwrapped: its state_dict has no DDP/compile prefixes

    groups = model.optim_groups(t.weight_decay)
    base_lr = {"decay": t.lr, "no_decay": t.lr, "prior": t.prior_lr or t.lr}
    for group in groups:
        group["lr"] = base_lr[group["name"]]
    if t.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, fused=device.type in ("cuda", "cpu"))
    else:
        # The paper's optimiser; decoupled weight decay is AdamW-style, as in the official code.
        optimizer = torch.optim.RAdam(groups, lr=t.lr, betas=t.betas, eps=t.eps, decoupled_weight_decay=True)
    if ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
        # A position in the token stream, the same for every rank: seeking there replaces replaying.
        train_loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])

    if t.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    # -------------------------------------------------------------------------------------------
    # Run directory, metrics, wandb: rank 0 only.
    metrics_path = os.path.join(log.out_dir, "metrics.jsonl")
    best_val_loss = ckpt["best_val_loss"] if ckpt else math.inf
    tokens_seen = ckpt["tokens_seen"] if ckpt else 0
    wandb_run, wandb_id = None, ckpt.get("wandb_id") if ckpt else None
    if master:
        os.makedirs(ckpt_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(ckpt_dir, "*.tmp")):
            os.remove(stale)  # a save that was interrupted; the rename never happened
        with open(os.path.join(log.out_dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
        # Rows past the checkpoint belong to steps that are about to be redone.
        rows = []
        if ckpt and os.path.exists(metrics_path):
            with open(metrics_path) as f:
                rows = [line for line in f if metrics_step(line) <= start_step]
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(metrics_path + ".tmp", metrics_path)
        metrics_file = open(metrics_path, "a")
        if log.wandb != "disabled":
            import wandb  # imported only when used: it is slow to import
            # A resumed run continues the same wandb run: its id travels in the checkpoint.
            wandb_run = wandb.init(project=log.wandb_project, name=log.run_name or os.path.basename(os.path.normpath(log.out_dir)),
                                   dir=log.out_dir, config=to_dict(cfg), mode=log.wandb, id=wandb_id,
                                   resume="allow" if wandb_id else None)
            wandb_id = wandb_run.id

    peak = peak_flops(device, bf16, log.peak_tflops)
    flops_per_token = raw_model.flops_per_token(seq_len)
    if master:
        print(f"model: {raw_model.num_params():,} parameters, pe={m.pe}{' + ssmax' if m.ssmax else ''}, "
              f"{m.n_layer} layers x {m.n_embd} wide, context {seq_len}")
        print(f"batch: {t.tokens_per_step:,} tokens per step = {batch_size} x {seq_len} x {world_size} ranks "
              f"x {accum_steps} accumulation steps; {t.max_steps:,} steps; device {device}, "
              f"{'bf16 autocast' if bf16 else 'fp32'}{', compiled' if t.compile else ''}")
        print(f"run dir: {log.out_dir}" + (f" (resuming at step {start_step})" if ckpt else ""))

    def record(row):
        if master:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            if wandb_run:
                flat = {k: v for k, v in row.items() if k != "prior"}
                flat.update({f"prior/{kind}": wandb.Histogram(np.ravel(values)) for kind, values in row.get("prior", {}).items()})
                wandb_run.log(flat, step=row["step"])

    def save_checkpoint(step):
        if master:
            save_atomic({
                "model_config": dataclasses.asdict(m), "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(), "step": step, "tokens_seen": tokens_seen,
                "best_val_loss": best_val_loss, "config": to_dict(cfg), "loader": train_loader.state_dict(),
                "rng": rng_state(), "wandb_id": wandb_id,
            }, os.path.join(ckpt_dir, f"step_{step:08d}.pt"))
            for old in step_checkpoints(ckpt_dir)[:-t.keep_last]:
                os.remove(old)

    def validate(step, row):
        nonlocal best_val_loss
        row["val_loss"] = evaluate(model, val_loader, val_batches, autocast, device, t.doc_mask, cfg.data.loss_on, ddp)
        if row["val_loss"] < best_val_loss:
            best_val_loss = row["val_loss"]
            if master:
                save_atomic({"model_config": dataclasses.asdict(m), "model": raw_model.state_dict(),
                             "config": to_dict(cfg), "step": step, "val_loss": best_val_loss},
                            os.path.join(ckpt_dir, "best.pt"))

    # -------------------------------------------------------------------------------------------
    # Training. `step` counts finished optimizer updates; a row for step s describes update s.
    if val_batches and start_step == 0:
        row = {"step": 0, "tokens": 0, "prior": rounded(raw_model.prior_summary())}
        validate(0, row)
        record(row)
    bar = tqdm(total=t.max_steps, initial=start_step, unit="step", disable=not master, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    train_time, interval_tokens, postfix = 0.0, 0, {}
    for step in range(start_step + 1, t.max_steps + 1):
        t0 = time.perf_counter()
        lr_scale = lr_multiplier(step - 1, t)
        for group in optimizer.param_groups:
            group["lr"] = base_lr[group["name"]] * lr_scale
        loss_sum = torch.zeros((), device=device)
        batches = [next_batch(train_loader, cfg.data.loss_on, device) for _ in range(accum_steps)]
        weights = loss_weights(batches, cfg.data.loss_on, device, ddp, world_size)
        for micro_step, (batch, weight) in enumerate(zip(batches, weights)):
            # Gradients are averaged across ranks only on the last micro-step; syncing on the
            # others would send the same bytes accum_steps times for nothing.
            sync = model.no_sync() if ddp and micro_step < accum_steps - 1 else nullcontext()
            with sync:
                with autocast:
                    loss = loss_of(model, batch, t.doc_mask, cfg.data.loss_on)
                # Summed gradients of weighted mean losses (1 / accum_steps each when every token
                # counts): the mean over the whole step, the same as one big batch.
                (loss * weight).backward()
            loss_sum += loss.detach().float() * weight
        if ddp:
            dist.all_reduce(loss_sum)
            loss_sum /= world_size
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf)
        # One sync per step: it lets every rank agree to stop before a non-finite update is applied.
        loss_value, grad_norm_value = loss_sum.item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
            bar.close()
            newest = step_checkpoints(ckpt_dir)
            if wandb_run:
                wandb_run.finish(exit_code=1)
            if ddp:
                dist.barrier()
                dist.destroy_process_group()
            fail(f"non-finite loss or gradient at step {step} (loss {loss_value}, grad norm {grad_norm_value}); "
                 f"stopped without applying it. The last good checkpoint is {newest[-1] if newest else '(none yet)'}; "
                 "lower train.lr or raise train.warmup_steps and rerun with --resume", master)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += t.tokens_per_step
        train_time += time.perf_counter() - t0
        interval_tokens += t.tokens_per_step
        bar.update(1)

        val_due = val_batches and (step % t.val_every == 0 or step == t.max_steps)
        if step % log.log_every == 0 or step == t.max_steps or val_due:
            tokens_per_s = interval_tokens / train_time
            row = {"step": step, "loss": loss_value, "lr": t.lr * lr_scale, "grad_norm": grad_norm_value,
                   "tokens": tokens_seen, "tokens_per_s": tokens_per_s}
            if peak:
                row["mfu"] = flops_per_token * tokens_per_s / (peak * world_size)
            if val_due:
                validate(step, row)
            row["prior"] = rounded(raw_model.prior_summary())
            record(row)
            postfix.update({"loss": f"{loss_value:.3f}", "lr": f"{row['lr']:.2e}", "tok/s": f"{tokens_per_s:,.0f}"})
            if peak:
                postfix["mfu"] = f"{row['mfu']:.1%}"
            if val_due:
                postfix["val"] = f"{row['val_loss']:.3f}"
            bar.set_postfix(postfix, refresh=False)
            train_time, interval_tokens = 0.0, 0
        if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.max_steps:
            save_checkpoint(step)
    bar.close()

    if master:
        print(f"done: {t.max_steps:,} steps, {tokens_seen:,} tokens"
              + (f", best val loss {best_val_loss:.4f}" if math.isfinite(best_val_loss) else "")
              + f"; checkpoints in {ckpt_dir}")
        metrics_file.close()
        if wandb_run:
            wandb_run.finish()
    if ddp:
        # Leave together: a rank that tears down gloo while rank 0 still writes the last
        # checkpoint can hang at exit.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
