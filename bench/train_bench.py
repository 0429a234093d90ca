"""
Training throughput of every positional encoding (with and without SSMax) on the tiny model of
configs/tiny.toml, as ratios against NoPE measured side by side in one process.

    python -m bench.train_bench                  # CPU: about 2 minutes on 2 cores
    python -m bench.train_bench --batch_size 1 --seq_len 1024   # where attention, not the vocabulary, costs
    python -m bench.train_bench --config configs/repro/base.toml --targets_per_row 3 --optimizer adamw
                                                 # configs/repro's step: loss on 3 tokens a row, fused AdamW

One step is what train.py does per micro-batch: forward, backward, gradient clipping, RAdam step,
with document masking on (as in training). Variants take turns one step at a time for `rounds`
rounds, so load from other jobs that comes and goes hits all of them alike. On a CPU the clock is
the process's CPU time with one thread (`--threads 1`, the default): on a shared machine that
barely moves when other jobs compete for the cores, where wall time swings by 2-3x. The table
gives the best step of each variant (the least disturbed) and the median as a check on noise.
On a GPU the same script runs with bf16 autocast and wall time; only numbers from a named GPU are
worth quoting in absolute terms.
"""

import dataclasses
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from bam.cli import Parser
from bam.config import load_config
from bam.data import EOT, document_ids
from bam.ranges import number
from model import ENCODINGS, Transformer


def synthetic_batch(batch_size, seq_len, vocab_size, device):
    # Token values do not change the cost; documents do (they turn on the masked attention path),
    # so every row holds a few documents of uneven length, as packed training data does.
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size - 1, (batch_size, seq_len + 1), generator=g)
    x[:, torch.randint(0, seq_len, (max(1, seq_len // 200),), generator=g)] = EOT
    x[:, 0] = EOT
    inputs, targets = x[:, :-1], x[:, 1:]
    return inputs.to(device), targets.to(device), document_ids(inputs).to(device)


def make_step(model_cfg, train_cfg, batch, device, autocast, doc_mask, optimizer_name="radam"):
    torch.manual_seed(0)
    model = Transformer(model_cfg).to(device)
    groups = model.optim_groups(train_cfg.weight_decay)
    for group in groups:
        group["lr"] = (train_cfg.prior_lr or train_cfg.lr) if group["name"] == "prior" else train_cfg.lr
    if optimizer_name == "adamw":  # as train.py: the fused kernel, on the GPU and the CPU
        optimizer = torch.optim.AdamW(groups, betas=train_cfg.betas, fused=True)
    else:
        optimizer = torch.optim.RAdam(groups, betas=train_cfg.betas, decoupled_weight_decay=True)
    x, y, doc_ids = batch
    sparse = bool((y == -1).any())  # as train.py with data.loss_on = "passkey_answers"

    def step():
        with autocast:
            _, loss = model(x, y, doc_ids=doc_ids if doc_mask else None, sparse_targets=sparse)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main():
    parser = Parser(prog="python -m bench.train_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.toml", help="model and batch come from here")
    parser.add_argument("--batch_size", type=number(int, ">= 1"), default=None, help="default: the config's data.batch_size")
    parser.add_argument("--seq_len", type=number(int, ">= 1"), default=None, help="default: the config's model.block_size")
    parser.add_argument("--rounds", type=number(int, ">= 1, <= 100000"), default=10, help="timed steps per variant, taken in turns")
    parser.add_argument("--threads", type=number(int, ">= 1, <= 1024"), default=1, help="CPU threads for torch (CPU only)")
    parser.add_argument("--no_doc_mask", action="store_true", help="one document per row")
    parser.add_argument("--targets_per_row", type=number(int, ">= 0"), default=0,
                        help="count the loss at only this many positions a row (0 = all), as loss_on = "
                             "passkey_answers does; the output layer then runs only there")
    parser.add_argument("--optimizer", choices=("radam", "adamw"), default="radam")
    args = parser.parse_args()

    cfg = load_config(args.config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    batch_size, seq_len = args.batch_size or cfg.data.batch_size, args.seq_len or cfg.model.block_size
    batch = synthetic_batch(batch_size, seq_len, cfg.model.vocab_size, device)
    if args.targets_per_row:
        x, y, doc_ids = batch
        y = torch.full_like(y, -1).scatter(1, torch.arange(seq_len - args.targets_per_row - 1, seq_len - 1,
                                                           device=device).expand(batch_size, -1),
                                           y[:, -args.targets_per_row - 1:-1])
        batch = x, y, doc_ids
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    variants = [(pe, ssmax) for ssmax in (False, True) for pe in ENCODINGS]
    steps = {}
    for pe, ssmax in variants:
        model_cfg = dataclasses.replace(cfg.model, pe=pe, ssmax=ssmax, block_size=seq_len)
        steps[pe, ssmax] = make_step(model_cfg, cfg.train, batch, device, autocast, not args.no_doc_mask,
                                     args.optimizer)
        steps[pe, ssmax]()  # warm-up: first-call allocations, lazy inits
    times = {v: [] for v in variants}
    for round_ in range(args.rounds):
        # rotate the order so no variant always runs right after the same neighbour
        for v in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            sync()
            t0 = clock()
            steps[v]()
            sync()
            times[v].append(clock() - t0)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), timed in CPU time)"
    m = cfg.model
    print(f"{where}, torch {torch.__version__}, {'bf16 autocast' if bf16 else 'fp32'}; model of {args.config}: "
          f"{m.n_layer} layers x {m.n_embd}, {m.n_head} heads, vocab {m.vocab_size}; batch {batch_size} x {seq_len}, "
          f"document mask {'off' if args.no_doc_mask else 'on'}; loss at "
          f"{args.targets_per_row or 'all'} positions a row; {args.optimizer}; {args.rounds} steps per variant, "
          f"taken in turns\n")
    best, median = {v: min(ts) for v, ts in times.items()}, {v: statistics.median(ts) for v, ts in times.items()}
    print("| encoding | tokens/s (best step) | throughput vs NoPE (best) | vs NoPE (median) |")
    print("|---|---:|---:|---:|")
    for v in variants:
        name = f"{v[0]}{' + ssmax' if v[1] else ''}"
        print(f"| {name} | {batch_size * seq_len / best[v]:,.0f} | {best['nope', False] / best[v]:.2f} | "
              f"{median['nope', False] / median[v]:.2f} |")


if __name__ == "__main__":
    main()
