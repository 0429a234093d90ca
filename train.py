"""
Pretrain a language model with one positional encoding of model.ENCODINGS (model.pe; or one per layer,
model.layer_pattern), each optionally with SSMax, on token shards, on CPU, one GPU, or many through torchrun.

    python train.py                                    # configs/tiny.toml: a few minutes on CPU
    python train.py configs/paper/bam_ssmax_512.toml --train.max_steps=100 --log.out_dir=runs/try
    torchrun --standalone --nproc_per_node=8 train.py configs/paper/bam_ssmax_512.toml
    torchrun --standalone --nproc_per_node=8 train.py configs/paper/sizes/bam_ssmax_512_7b.toml   # sharded: FSDP
    python train.py configs/paper/sizes/bam_ssmax_512_7b.toml --dry_run --world_size=8,64      # memory per GPU
    python train.py configs/paper/bam_ssmax_512.toml --resume    # continue from the newest checkpoint
    python train.py configs/paper/rope_512.toml --train.init_from=runs/rope_512 --model.block_size=2048 \
        --model.rope_scaling=yarn --model.rope_factor=4 --log.out_dir=runs/rope_yarn_2048   # fine-tune longer

The run directory (log.out_dir) gets config.toml (the resolved config), metrics.jsonl (one JSON
object per logged step, including every head's prior parameters) and checkpoints/ (the last
train.keep_last step checkpoints, each enough to resume exactly, and best.pt, the weights with the
lowest validation loss; folders of shards instead under train.parallel = "fsdp", bam/parallel.py).
`python train.py --help` lists every config key and its default. The file reads top-down: main, build_run,
train_loop, train_step, then what they call.

Exit status: 0 when max_steps are done; 1 for a mistake the user can fix (one `error: ...` line),
including a diverged run (non-finite loss or a loss spike: the line says which checkpoint to resume
from and how); 143 after SIGTERM or SIGUSR1 (a preempted job: the current step is finished and
checkpointed, `--resume` continues exactly), and under torchrun when torchrun itself is gone (killed);
130 after Ctrl-C (the same; a second Ctrl-C quits at once). docs/training.md, "Preemption and recovery",
has the commands; bam/recovery.py the guards behind them.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from bam import sizing
from bam.checkpoint import (CheckpointError, RunDirInUse, best_path, check_checkpoint_tokenizer, checkpoint_dict,
                            checkpoint_dir, config_path, keep_last, load_init_weights, metrics_path, run_dir_lock,
                            save_atomic, step_checkpoints, step_path)
from bam.cli import Parser, UserError, os_reason, user_errors
from bam.config import ConfigError, check, describe, load_config, to_dict, to_toml
from bam.data import ShardError, ShardLoader, check_shard_tokens
from bam.outputs import check_apart, remove_temp_files, write_text
from bam.parallel import (clip_grad_norm, init_distributed, load_fsdp_checkpoint, load_whole_optimizer, micro_step,
                          prepare, prior_summary, rank_rng_state, save_fsdp_checkpoint, wrap)
from bam.recovery import (Diverged, LauncherWatch, Stopped, StopRequest, check_step, follow_moved_run_dir, interrupted,
                          load_resume_state, metrics_rows_until, rng_state, set_rng_state)
from bam.retrieval import passkey_answer_targets
from bam.sizing import check_training_fits
from bam.tokenizer import GPT2, GPT2_IDENTITY, check_vocab, load_tokenizer, tokenizer_identity
from model import Transformer

# Dense bf16 tensor-core peaks per GPU in TFLOPs, matched against the CUDA device name in this order.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]


# ---------------------------------------------------------------------------------------------------
# The run, top-down: main builds it, the loop takes its steps.


def main(argv=None):
    args, overrides = parse_args(argv)
    if args.dry_run:
        return dry_run(args, overrides)
    procs = setup_processes()
    # Under torchrun, a rank whose launcher is killed stops (bam.recovery.LauncherWatch): at once during setup,
    # after the next step, with every other rank and a checkpoint, once training.
    launcher = LauncherWatch.arm() if procs.distributed else None
    run = None
    try:
        # Every rank exits on a user error; only rank 0 says why. The lock is released before that.
        with user_errors(speak=procs.master), ExitStack() as held:
            if launcher and launcher.gone():
                raise UserError("the launcher of this rank (torchrun) is gone before training started; nothing was "
                                "written: run the torchrun command again")
            run = build_run(args, overrides, procs, held)
            try:
                with StopRequest(speak=procs.master, launcher=launcher) as run.stop:
                    train_loop(run)
            except Stopped as stopped:
                finish(run, run.stop.exit_code)
                if procs.master:
                    held_by = step_path(run.cfg.log.out_dir, stopped.args[0], run.sharded)
                    print(f"stopped at step {stopped.args[0]} {run.stop.why()}; {held_by} holds it: continue with "
                          f"--resume", file=sys.stderr)
                raise SystemExit(run.stop.exit_code) from None
            except UserError as e:
                finish(run, exit_code=1, together=isinstance(e, Diverged))
                raise
            finish(run)
    except KeyboardInterrupt:
        interrupted(run.cfg.log.out_dir if run else None, procs.master)


def build_run(args, overrides, procs, held):
    """The run, ready to train; rank 0 holds the run directory's lock until `held` (an ExitStack) closes."""
    cfg = load_checked_config(args.config, overrides, procs.world_size, procs.master)
    t, device = cfg.train, procs.device
    bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    too_big = check_training_fits(cfg, procs.world_size, device, bf16)
    if too_big:
        raise UserError(too_big)
    if t.init_from and not (args.resume and step_checkpoints(cfg.log.out_dir)):  # a resume ignores init_from
        # A fresh run writes config.toml, metrics.jsonl and best.pt over those of a source it lies in or holds
        check_apart(t.init_from, cfg.log.out_dir, UserError, "train.init_from", "log.out_dir")
    train_loader, val_loader, val_batches = build_data(cfg, procs)
    if procs.master:
        lock_run_dir(cfg.log.out_dir, held)
    path, ckpt = load_resume_state(cfg, args.resume, procs.master)
    if ckpt:
        check_checkpoint_tokenizer(ckpt, cfg, path)
    init_weights = None if ckpt else load_init_weights(cfg, procs.master)
    init_distributed(procs, cfg.train.parallel)
    accum_steps = t.tokens_per_step // (cfg.data.batch_size * cfg.model.block_size * procs.world_size)
    run = TrainingRun(cfg, procs, bf16, accum_steps, train_loader, val_loader, val_batches,
                      *build_model(cfg, procs, bf16, ckpt, init_weights),
                      peak_flops=peak_flops(device, bf16, cfg.log.peak_tflops))
    if ckpt:
        restore(run, path, ckpt)
    run.model = wrap(run.raw_model, t, procs)
    if procs.master:
        with writes_to(cfg.log.out_dir):
            run.metrics = setup_run_dir(cfg, run.state, ckpt["step"] if ckpt else None)
        print_summary(run, resumed=ckpt is not None)
    return run


def train_loop(run):
    """`step` counts finished optimizer updates; a row for step s describes update s."""
    t, log = run.cfg.train, run.cfg.log
    if run.val_batches and run.state.step == 0:  # the untrained model's validation loss
        row = {"step": 0, "tokens": 0, "prior": rounded(prior_summary(run.raw_model))}
        validate(run, row)
        run.metrics.record(row)
    train_time, interval_tokens, postfix = 0.0, 0, {}
    with tqdm(total=t.max_steps, initial=run.state.step, unit="step", disable=not run.procs.master,
              dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0) as bar:
        for step in range(run.state.step + 1, t.max_steps + 1):
            t0 = time.perf_counter()
            loss, grad_norm, lr_scale, stop = train_step(run, step)
            train_time += time.perf_counter() - t0
            interval_tokens += t.tokens_per_step
            bar.update(1)
            val_due = bool(run.val_batches) and (step % t.val_every == 0 or step == t.max_steps)
            if step % log.log_every == 0 or step == t.max_steps or val_due:
                show(bar, postfix, log_step(run, loss, grad_norm, lr_scale, interval_tokens / train_time, val_due))
                train_time, interval_tokens = 0.0, 0
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.max_steps or stop:
                save_checkpoint(run)
            if stop and step < t.max_steps:
                raise Stopped(step)


def train_step(run, step):
    """Optimizer update number `step` (1-based) over accum_steps micro-batches per rank. Returns (loss,
    grad norm, lr factor, whether a signal or a launcher gone asks every rank to stop now); a diverging step
    (check_step) stops the run before it is applied."""
    t, loss_on, procs = run.cfg.train, run.cfg.data.loss_on, run.procs
    lr_scale = lr_multiplier(step - 1, t)
    for group in run.optimizer.param_groups:
        group["lr"] = run.base_lr[group["name"]] * lr_scale
    batches = [next_batch(run.train_loader, loss_on, procs.device) for _ in range(run.accum_steps)]
    weights = loss_weights(batches, loss_on, procs.device, procs.distributed, procs.world_size)
    loss_sum = torch.zeros((), device=procs.device)
    for i, (batch, weight) in enumerate(zip(batches, weights)):
        # When the ranks exchange gradients (after the last micro-batch only, unless FSDP keeps them
        # sharded after each one): parallel.micro_step.
        with micro_step(run.model, t, procs, last=i == run.accum_steps - 1):
            with run.autocast:
                loss = loss_of(run.model, batch, run.cfg.data.doc_mask, loss_on)
            # Summed gradients of weighted mean losses (1 / accum_steps each when every token counts):
            # the mean over the whole step, the same as one big batch.
            (loss * weight).backward()
        loss_sum += loss.detach().float() * weight
    # The stop flags ride on the loss's all_reduce: a signal to any rank, or the end of any rank's launcher,
    # stops every rank after this step.
    reduced = torch.cat([loss_sum[None], torch.tensor(run.stop.flags(), device=procs.device)])
    if procs.distributed:
        dist.all_reduce(reduced)
        reduced[0] /= procs.world_size
    grad_norm = clip_grad_norm(run.model.parameters(), t.grad_clip or math.inf)  # of the whole model on every rank
    # One sync per step: it lets every rank agree to stop before a diverging update is applied.
    (loss_value, signalled, orphaned), grad_norm_value = reduced.tolist(), grad_norm.item()
    check_step(run, step, loss_value, grad_norm_value)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.step = step
    run.state.tokens_seen += t.tokens_per_step
    return loss_value, grad_norm_value, lr_scale, run.stop.agree(signalled, orphaned)


# ---------------------------------------------------------------------------------------------------
# What the loop calls: validation, the metrics row, checkpoints, the end of a run.


def validate(run, row):
    """Adds the validation loss to `row` (the metrics row of step row["step"]); a new best is saved (save_best)."""
    cfg, procs = run.cfg, run.procs
    row["val_loss"] = evaluate(run.model, run.val_loader, run.val_batches, run.autocast, procs.device,
                               cfg.data.doc_mask, cfg.data.loss_on, procs.distributed)
    save_best(run, row["step"], row["val_loss"])


def log_step(run, loss, grad_norm, lr_scale, tokens_per_s, val_due):
    """The metrics row of the step just taken (with the validation loss when one is due)."""
    row = {"step": run.state.step, "loss": loss, "lr": run.cfg.train.lr * lr_scale, "grad_norm": grad_norm,
           "tokens": run.state.tokens_seen, "tokens_per_s": tokens_per_s}
    if run.peak_flops:
        flops = run.raw_model.flops_per_token(run.cfg.model.block_size) * tokens_per_s
        row["mfu"] = flops / (run.peak_flops * run.procs.world_size)
    if val_due:
        validate(run, row)
    row["prior"] = rounded(prior_summary(run.raw_model))
    run.metrics.record(row)
    return row


def show(bar, postfix, row):
    # The last validation loss stays on the bar until the next one.
    postfix.update({"loss": f"{row['loss']:.3f}", "lr": f"{row['lr']:.2e}", "tok/s": f"{row['tokens_per_s']:,.0f}"})
    if "mfu" in row:
        postfix["mfu"] = f"{row['mfu']:.1%}"
    if "val_loss" in row:
        postfix["val"] = f"{row['val_loss']:.3f}"
    bar.set_postfix(postfix, refresh=False)


def save_checkpoint(run):
    """Everything an exact resume needs, as step_XXXXXXXX.pt (under FSDP the folder step_XXXXXXXX, which every
    rank writes its shards into); only the newest train.keep_last stay, and never fewer than 2: the newest
    one's weights have not been trained on yet, so after a divergence (recovery.diverged) the one before it
    is the one to resume from."""
    s, run_dir = run.state, run.cfg.log.out_dir
    state = dict(step=s.step, tokens_seen=s.tokens_seen, best_val_loss=s.best_val_loss, config=to_dict(run.cfg),
                 tokenizer=run.train_loader.tokenizer.to_dict(), loader=run.train_loader.state_dict(),
                 rng=rng_state(run.procs.device), wandb_id=s.wandb_id, recent=s.recent)
    path = step_path(run_dir, s.step, run.sharded)
    with writes_to(path):
        if run.sharded:
            save_fsdp_checkpoint(run.raw_model, run.optimizer, state, path)
        elif run.procs.master:
            save_atomic(checkpoint_dict(run.raw_model, optimizer=run.optimizer.state_dict(), **state), path)
    if run.procs.master:
        keep_last(run_dir, max(2, run.cfg.train.keep_last))


def save_best(run, step, val_loss):
    """The weights as best.pt (under FSDP the folder best, which every rank writes its shards into) when `val_loss`
    is below the run's lowest so far, atomically as every checkpoint; a best of the other layout, left by a change
    of train.parallel, is removed."""
    if not val_loss < run.state.best_val_loss:
        return
    cfg, procs = run.cfg, run.procs
    run.state.best_val_loss = val_loss
    path, state = best_path(cfg.log.out_dir, run.sharded), dict(config=to_dict(cfg), step=step, val_loss=val_loss,
                                                                tokenizer=run.train_loader.tokenizer.to_dict())
    with writes_to(path):
        if run.sharded:  # every rank writes its shards of the weights
            save_fsdp_checkpoint(run.raw_model, None, state, path)
        elif procs.master:
            save_atomic(checkpoint_dict(run.raw_model, **state), path)
        other = best_path(cfg.log.out_dir, not run.sharded)  # from before a change of train.parallel
        if procs.master and os.path.exists(other):
            shutil.rmtree(other) if os.path.isdir(other) else os.remove(other)


@contextmanager
def writes_to(path):
    """A failed write (a full disk, a quota, a directory made read-only) as one line naming the path; the
    atomic writer has left the previous file as it was."""
    try:
        yield
    except OSError as e:
        in_checkpoints = os.path.basename(os.path.dirname(path)) == "checkpoints"
        kept = step_checkpoints(os.path.dirname(os.path.dirname(path))) if in_checkpoints else []
        raise UserError(f"cannot write {e.filename or path}: {os_reason(e)}"
                        + (f"; the previous checkpoint {kept[-1]} is intact" if kept else "")
                        + "; make room and rerun with --resume") from None


def finish(run, exit_code=0, together=True):
    """together: every rank got here (a finished, stopped or diverged run), not rank 0 alone (a failed write)."""
    if run.procs.master:
        if exit_code == 0:
            best = run.state.best_val_loss
            print(f"done: {run.cfg.train.max_steps:,} steps, {run.state.tokens_seen:,} tokens"
                  + (f", best val loss {best:.4f}" if math.isfinite(best) else "")
                  + f"; checkpoints in {checkpoint_dir(run.cfg.log.out_dir)}")
        run.metrics.close(exit_code)
    if dist.is_initialized() and (together or not run.procs.distributed):
        # Leave together: a rank that tears down gloo while rank 0 still writes the last checkpoint
        # can hang at exit. (FSDP without torchrun has a group of one rank: nothing to wait for.)
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# The run: what main builds once, and what every step reads and updates.


@dataclasses.dataclass
class Processes:
    """Where this process runs. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; without them we are alone."""

    distributed: bool  # started by torchrun
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self):
        return self.rank == 0  # the one that writes files and prints


@dataclasses.dataclass
class TrainState:
    """What changes from step to step besides the weights, optimizer and loader; checkpoints carry it."""

    step: int = 0  # finished optimizer updates
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    wandb_id: str | None = None  # a resumed run continues the same wandb run
    recent: list = dataclasses.field(default_factory=list)  # [loss, grad norm] of the last steps: the spike guard's


class MetricsLog:
    """metrics.jsonl (always, so plots never need wandb) and wandb; rank 0 holds the files, the other
    ranks a log that writes nothing."""

    def __init__(self, file=None, wandb_run=None):
        self.file, self.wandb_run = file, wandb_run

    def record(self, row):
        if self.file is None:
            return
        with writes_to(self.file.name):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.wandb_run:
            import wandb

            # Numbers only: not the prior, nor a divergence's why.
            flat = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            flat.update({f"prior/{kind}": wandb.Histogram(np.ravel(values))
                         for kind, values in row.get("prior", {}).items()})
            self.wandb_run.log(flat, step=row["step"])

    def close(self, exit_code=0):
        if self.file is not None:
            self.file.close()
        if self.wandb_run:
            self.wandb_run.finish(exit_code=exit_code)


@dataclasses.dataclass
class TrainingRun:
    cfg: object
    procs: Processes
    bf16: bool
    accum_steps: int  # micro-batches per optimizer step on each rank
    train_loader: ShardLoader
    val_loader: ShardLoader | None
    val_batches: int
    raw_model: Transformer  # unwrapped: its state_dict has no DDP/compile prefixes (under FSDP its tensors are shards)
    optimizer: torch.optim.Optimizer
    base_lr: dict  # per param group name, before the schedule's factor
    model: torch.nn.Module = None  # what the steps run: raw_model compiled and/or DDP-wrapped (FSDP: raw_model)
    state: TrainState = dataclasses.field(default_factory=TrainState)
    metrics: MetricsLog = dataclasses.field(default_factory=MetricsLog)
    peak_flops: float | None = None  # of one device, for MFU
    stop: StopRequest = dataclasses.field(default_factory=lambda: StopRequest(speak=False))  # installed by main

    @property
    def sharded(self):
        return self.cfg.train.parallel == "fsdp"

    @property
    def autocast(self):
        # Under FSDP, bf16 is its mixed-precision policy (weights gathered in bf16) instead of autocast.
        bf16_autocast = self.bf16 and not self.sharded
        return torch.autocast(self.procs.device.type, dtype=torch.bfloat16) if bf16_autocast else nullcontext()


# ---------------------------------------------------------------------------------------------------
# Setup, in the order build_run runs it. Every check comes before anything is written.


def parse_args(argv):
    parser = Parser(
        prog="train.py", description="Pretrain a language model. Override any config key with --section.key=value.",
        epilog="config keys and their defaults (the paper's 12-layer run):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("config", nargs="?", default="configs/tiny.toml", help="TOML file (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in log.out_dir (start fresh if there is none)")
    parser.add_argument("--dry_run", action="store_true",
                        help="train nothing: print the parameters and the memory per rank (weights, gradients, "
                             "optimizer, activations per micro-batch with and without activation checkpointing) "
                             "under DDP and FSDP")
    parser.add_argument("--world_size", default="8,64", metavar="N[,N...]",
                        help="with --dry_run: the numbers of GPUs to size for (default: %(default)s)")
    return parser.parse_known_args(argv)


def dry_run(args, overrides):
    """train.py CONFIG --dry_run: the memory plan (bam/sizing.py), without data, processes or a run directory."""
    with user_errors():
        try:
            worlds = [int(n) for n in args.world_size.split(",")]
            assert worlds and min(worlds) > 0
        except (ValueError, AssertionError):
            raise UserError(f"--world_size={args.world_size}: give numbers of GPUs, like 8 or 8,64") from None
        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as e:
            raise UserError(e) from None
        print(f"{args.config}:")
        print(sizing.dry_run(cfg, worlds))


def setup_processes():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays in fp32
    else:
        device = torch.device("cpu")
    return Processes(distributed="RANK" in os.environ, rank=int(os.environ.get("RANK", 0)), local_rank=local_rank,
                     world_size=int(os.environ.get("WORLD_SIZE", 1)), device=device)


def load_checked_config(path, overrides, world_size, master):
    try:
        cfg = load_config(path, overrides)
        check(cfg, world_size)
    except ConfigError as e:
        raise UserError(e) from None
    identity = tokenizer_identity(cfg.data.tokenizer)
    if identity == GPT2_IDENTITY and cfg.model.vocab_size < identity.vocab_size:  # as GPT-2 runs always said
        raise UserError(f"model.vocab_size = {cfg.model.vocab_size} cannot hold the GPT-2 tokens of the shards "
                        f"(up to {identity.vocab_size - 1}); use {identity.vocab_size} or more")
    too_small = check_vocab(cfg.model.vocab_size, identity)
    if too_small:
        raise UserError(too_small)
    follow_moved_run_dir(cfg, path, overrides, master)
    return cfg


def build_data(cfg, procs):
    """(train loader, validation loader or None, validation batches per evaluation)."""
    d, t = cfg.data, cfg.train
    shape = (d.batch_size, cfg.model.block_size, procs.rank, procs.world_size, tokenizer_identity(d.tokenizer))
    if not glob.glob(os.path.join(d.data_dir, "*_train_*.bin")):
        raise UserError(f"data.data_dir = {d.data_dir!r} holds no *_train_*.bin shards; make them with "
                        f"prepare_fineweb.py (e.g. `python prepare_fineweb.py --source demo "
                        f"{'' if d.tokenizer == GPT2 else f'--tokenizer {d.tokenizer} '}--out_dir {d.data_dir}`)")
    try:
        # Token ids past the vocabulary would be an IndexError deep in the embedding at step 1: the validation
        # split and the first training shard are read whole here, every later batch as the loader reads it.
        train_loader = ShardLoader(d.data_dir, "train", *shape, vocab_size=cfg.model.vocab_size)
        val_loader = ShardLoader(d.data_dir, "val", *shape) if t.val_every else None
        check_shard_tokens(val_loader.paths if val_loader else [], cfg.model.vocab_size, tokenizer_name=d.tokenizer)
        check_shard_tokens(train_loader.paths[:1], cfg.model.vocab_size, tokenizer_name=d.tokenizer)
    except (OSError, ValueError) as e:  # data.ShardError is a ValueError
        raise UserError(f"cannot use the shards in {d.data_dir}: {e}") from None
    if d.loss_on != "all":  # a look at the first batch (a fresh loader: nothing is consumed)
        probe = ShardLoader(d.data_dir, "train", *shape)
        if not (next_batch(probe, d.loss_on, "cpu")[1] != -1).any():
            raise UserError(f"data.loss_on = {d.loss_on!r} but the first batch from {d.data_dir} has no passkey "
                            f"answer to train on; prepare the data with --retrieval_fraction (docs/repro.md)")
    if not val_loader:
        return train_loader, None, 0
    # A short validation split is used whole rather than read around twice.
    per_batch = d.batch_size * cfg.model.block_size * procs.world_size
    return train_loader, val_loader, min(t.val_tokens // per_batch, val_loader.batches_per_epoch)


def lock_run_dir(run_dir, held):
    """Rank 0 holds RUN/.lock until `held` closes: a second train.py on the same run directory is refused."""
    try:
        held.enter_context(run_dir_lock(run_dir))
    except RunDirInUse as e:
        raise UserError(e) from None
    except OSError as e:
        raise UserError(f"log.out_dir = {run_dir!r} cannot be created or written ({os_reason(e)}); "
                        "choose another --log.out_dir") from None


def build_model(cfg, procs, bf16, ckpt, init_weights=None):
    """(model, optimizer, base learning rate per param group), spread over the ranks as train.parallel says
    (parallel.prepare), with the checkpoint's weights and optimizer state when resuming, or with
    `init_weights` alone (train.init_from). A sharded checkpoint (no "model" in `ckpt`: its tensors are
    read into the shards later, by restore) leaves them freshly initialised."""
    t, device = cfg.train, procs.device
    # Every rank seeds alike so the initial weights agree: DDP broadcasts rank 0's at wrap time, but
    # fully_shard keeps each rank's own. The model has no dropout, so nothing else draws.
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    model = Transformer(cfg.model)
    weights = ckpt.get("model") if ckpt else init_weights
    if weights is not None and not ckpt:  # init_from: what the checkpoint lacks keeps this model's initialisation
        weights = {**model.state_dict(), **weights}
    if weights is not None:
        model.load_state_dict(weights)
    if t.parallel != "fsdp":
        model.to(device)  # fully_shard moves each group to the device as it shards it
    prepare(model, t, procs, bf16)
    groups = model.optim_groups(t.weight_decay)
    base_lr = {"decay": t.lr, "no_decay": t.lr, "prior": t.prior_lr or t.lr}
    for group in groups:
        group["lr"] = base_lr[group["name"]]
    if t.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, fused=device.type in ("cuda", "cpu"))
    else:
        # The paper's optimiser; decoupled weight decay is AdamW-style, as in the official code.
        optimizer = torch.optim.RAdam(groups, lr=t.lr, betas=t.betas, eps=t.eps, decoupled_weight_decay=True)
    if ckpt and "optimizer" in ckpt:
        if t.parallel == "fsdp":
            load_whole_optimizer(model, optimizer, ckpt["optimizer"])
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
            reshape_older_state(optimizer)
    return model, optimizer, base_lr


def reshape_older_state(optimizer):
    """An older checkpoint's optimizer state of a parameter that changed shape but not its numbers (FIRE's log c
    and log L, 0-d before they became shape (1,)) takes the parameter's shape, as the weights do (model.py's
    load hook); the step count keeps its own."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            reshaped = torch.is_tensor(value) and value.shape != param.shape and value.numel() == param.numel()
            if key != "step" and reshaped:
                state[key] = value.reshape(param.shape)


def restore(run, path, ckpt):
    """The rest of a checkpoint's state: a sharded checkpoint's tensors, where the data stands, the RNGs, the
    train state."""
    if "model" not in ckpt:  # a sharded checkpoint folder, read into this run's shards (resharded if need be)
        try:
            load_fsdp_checkpoint(run.raw_model, run.optimizer, path, ckpt)
        except CheckpointError as e:  # files that match DONE but do not read (bit rot): move it away
            raise UserError(f"{e}; move {path} away to resume from the checkpoint before it") from None
    # A position in the token stream, the same for every rank: seeking there replaces replaying.
    try:
        run.train_loader.load_state_dict(ckpt["loader"])
    except ValueError as e:  # the shards changed since the checkpoint
        raise UserError(f"cannot resume from step {ckpt['step']}: {e}") from None
    set_rng_state(rank_rng_state(ckpt, run.procs.rank), run.procs.device)
    run.state = TrainState(step=ckpt["step"], tokens_seen=ckpt["tokens_seen"], best_val_loss=ckpt["best_val_loss"],
                           wandb_id=ckpt.get("wandb_id"), recent=ckpt.get("recent", []))


def setup_run_dir(cfg, state, resumed_step):
    """config.toml, metrics.jsonl and wandb (rank 0 only): the MetricsLog that records the run."""
    run_dir, log = cfg.log.out_dir, cfg.log
    os.makedirs(checkpoint_dir(run_dir), exist_ok=True)
    remove_temp_files(checkpoint_dir(run_dir))  # saves that were interrupted; the rename never happened
    write_text(config_path(run_dir), to_toml(cfg))
    # Rows past the checkpoint belong to steps that are about to be redone.
    rows = []
    if resumed_step is not None and os.path.exists(metrics_path(run_dir)):
        rows = metrics_rows_until(metrics_path(run_dir), resumed_step)
    write_text(metrics_path(run_dir), "".join(rows))
    wandb_run = None
    if log.wandb != "disabled":
        import wandb  # imported only when used: it is slow to import

        name = log.run_name or os.path.basename(os.path.normpath(run_dir))
        wandb_run = wandb.init(project=log.wandb_project, name=name, dir=run_dir, config=to_dict(cfg),
                               mode=log.wandb, id=state.wandb_id, resume="allow" if state.wandb_id else None)
        state.wandb_id = wandb_run.id
    return MetricsLog(open(metrics_path(run_dir), "a"), wandb_run)


def print_summary(run, resumed):
    m, t, procs = run.cfg.model, run.cfg.train, run.procs
    print(f"model: {run.raw_model.num_params():,} parameters, {m.encoding_label}, "
          f"{m.n_layer} layers x {m.n_embd} wide, context {m.block_size}")
    precision = ("bf16 weights (FSDP policy)" if run.sharded else "bf16 autocast") if run.bf16 else "fp32"
    print(f"batch: {t.tokens_per_step:,} tokens per step = {run.cfg.data.batch_size} x {m.block_size} x "
          f"{procs.world_size} ranks x {run.accum_steps} accumulation steps; {t.max_steps:,} steps; device "
          f"{procs.device}, {t.parallel}, {precision}{', compiled' if t.compile else ''}"
          f"{', activation checkpointing' if t.activation_checkpointing != 'none' else ''}")
    print(f"run dir: {run.cfg.log.out_dir}" + (f" (resuming at step {run.state.step})" if resumed else ""))


# ---------------------------------------------------------------------------------------------------
# Batches, losses and the schedule.


def next_batch(loader, loss_on, device):
    """(x, y, doc_ids) on `device`, with y's ignored targets set to -1 as `data.loss_on` says; a token id outside
    the vocabulary (the training loader is given model.vocab_size) is a UserError, not an IndexError in the
    embedding."""
    try:
        x, y, doc_ids = loader.next_batch()
    except ShardError as e:
        raise UserError(e) from None
    if loss_on == "passkey_answers":
        y = passkey_answer_targets(x, y, load_tokenizer(loader.tokenizer.name))
    if torch.device(device).type == "cuda":
        # From page-locked memory the copy is queued behind the GPU's work and the host goes on; from pageable
        # memory the driver may first wait for the stream (the previous step's kernels) to stage it.
        return tuple(v.pin_memory().to(device, non_blocking=True) for v in (x, y, doc_ids))
    return tuple(v.to(device) for v in (x, y, doc_ids))


def loss_of(model, batch, doc_mask, loss_on):
    x, y, doc_ids = batch
    return model(x, y, doc_ids=doc_ids if doc_mask else None, sparse_targets=loss_on != "all")[1]


def targets_in(batch, loss_on) -> int:
    """How many targets a batch's mean loss averages over (1 for "all": every batch has the same)."""
    return 1 if loss_on == "all" else int((batch[1] != -1).sum())


def loss_weights(batches, loss_on, device, distributed, world_size):
    """Weights of the micro-batches' mean losses that make the step's gradient the mean over every
    target of the step on every rank (DDP then averages over ranks): n_i * world_size / N. That is
    1 / accum_steps when every token is a target; passkey answers differ in number per micro-batch,
    and one without any weighs nothing instead of pulling the mean towards 0."""
    if loss_on == "all":
        return [1 / len(batches)] * len(batches)  # no count to exchange: they are all equal
    counts = [targets_in(b, loss_on) for b in batches]
    total = torch.tensor(float(sum(counts)), device=device)
    if distributed:
        dist.all_reduce(total)
    return [n * world_size / max(total.item(), 1.0) for n in counts]


@torch.no_grad()
def evaluate(model, loader, batches, autocast, device, doc_mask, loss_on, distributed):
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
    if distributed:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp_min(1)).item()


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


def rounded(tree):
    # Six significant digits keep metrics.jsonl small with hundreds of prior parameters per row.
    if isinstance(tree, dict):
        return {k: rounded(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [rounded(v) for v in tree]
    return float(f"{tree:.6g}") if isinstance(tree, float) else tree


if __name__ == "__main__":
    main()
