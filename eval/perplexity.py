"""
Perplexity by position (docs/paper.md §5): the loss in consecutive windows of a long held-out sequence, so that
what happens past the training context shows up window by window instead of vanishing in one average.

    python -m eval.perplexity runs/bam_ssmax_512                       # 64x the context, 512-token windows
    python -m eval.perplexity runs/bam_ssmax_512 runs/rope_512 --length 32K --window 1024 --num_seqs 16

Sequences come from the validation split (--data_dir, default the data_dir the checkpoint was trained
on). `--source concat` (default) is the official code's protocol: the validation stream with the
<|endoftext|> separators removed, cut into consecutive sequences of --length + 1 tokens; FineWeb documents
are mostly shorter than 1K tokens, so this measures whether a long context of *other* text derails the
model. `--source documents` uses only documents at least --length + 1 tokens long (each from its leading
<|endoftext|>), which tests the use of a long context of the *same* text but needs long documents (set
it up with long-document data, e.g. Wikipedia articles prepared with prepare_fineweb.py).

Only the hidden state of the last block is kept for the whole sequence (T x n_embd); the LM head runs
over it in chunks, so no T x vocab tensor exists. Outputs per run: perplexity.json and perplexity.png
in RUN/eval; with several runs also a comparison plot with one line per run (--compare).
"""

import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from data import EOT, read_shard, shard_paths
from eval.common import (add_model_args, autocast, EvalError, evaluated_name, finish, format_length,
                         is_out_of_memory, load_for_eval, model_device, OutOfMemory, output_dir, parse_eval_args,
                         parse_length, Parser, pick_dtype, plan_batch, progress_bar, results_name, run_cli,
                         save_figure, save_progress, SCHEMA_VERSION, set_length, settings_block, validation_tokens,
                         writable_folder)

SOURCES = ("concat", "documents")
HEAD_CHUNK = 1024  # positions per LM-head call: B x 1024 x vocab fp32 logits at a time


def validation_sequences(data_dir, length, num_seqs, source="concat"):
    """(n, length + 1) int64 sequences of held-out tokens; n <= num_seqs when the split is short."""
    need = num_seqs * (length + 1)
    if source == "concat":
        # EOTs are about 1 in 700 tokens of FineWeb: read a little more than needed, then drop them
        tokens = validation_tokens(data_dir, max_tokens=int(need * 1.1) + 4096)
        tokens = tokens[tokens != EOT]
        n = min(num_seqs, len(tokens) // (length + 1))
        if n == 0:
            raise EvalError(f"the validation split in {data_dir} has {len(tokens):,} tokens without separators, "
                            f"fewer than one sequence of {length + 1:,}; use a shorter --length")
        return tokens[:n * (length + 1)].reshape(n, length + 1)
    sequences = []
    for path in shard_paths(data_dir, "val") if data_dir and os.path.isdir(data_dir) else []:
        tokens = read_shard(path)
        starts = np.flatnonzero(tokens == EOT)
        ends = np.append(starts[1:], len(tokens))
        for start in starts[ends - starts >= length + 1][:num_seqs - len(sequences)]:
            sequences.append(np.asarray(tokens[start:start + length + 1], dtype=np.int64))
        if len(sequences) == num_seqs:
            break
    if not sequences:
        validation_tokens(data_dir, max_tokens=1)  # the clearer error when there are no shards at all
        raise EvalError(f"no validation document in {data_dir} has {length + 1:,} tokens or more; use a "
                        f"shorter --length or --source concat")
    return np.stack(sequences)


def final_hidden(model, x, amp):
    """The last block's output at every position: the model is asked for logits at one position only, and
    a hook keeps the (B, T, n_embd) state before the final norm, which the caller turns into losses chunk
    by chunk. (A model.forward option that returns hidden states would make this hook unnecessary.)"""
    captured = {}
    hook = model.blocks[-1].register_forward_hook(lambda module, args, output: captured.update(h=output))
    try:
        with torch.no_grad(), amp:
            model(x, last_k=1)
    finally:
        hook.remove()
    return captured["h"]


def window_nll(model, batch, window, amp):
    """Summed negative log-likelihood per window, (B, n_windows), for token sequences (B, T + 1)."""
    x, y = batch[:, :-1], batch[:, 1:]
    h = final_hidden(model, x, amp)
    T = x.shape[1]
    nll = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    with torch.no_grad(), amp:
        for s in range(0, T, HEAD_CHUNK):
            logits = model.lm_head(model.norm(h[:, s:s + HEAD_CHUNK])).float()
            nll[:, s:s + HEAD_CHUNK] = F.cross_entropy(logits.flatten(0, 1), y[:, s:s + HEAD_CHUNK].flatten(),
                                                       reduction="none").view(x.shape[0], -1)
    n_windows = math.ceil(T / window)
    padded = F.pad(nll, (0, n_windows * window - T))  # a last partial window counts only its own tokens
    return padded.view(x.shape[0], n_windows, window).sum(dim=-1).double().cpu()


def evaluate_perplexity(source, *, length="64x", window=None, num_seqs=8, data_source="concat", data_dir=None,
                        batch_size=1, out=None, name=None, device="auto", dtype="auto", attn_impl=None,
                        model_overrides=None, progress=True, verbose=True):
    """Per-window perplexity of one model (run dir, checkpoint or model object) over held-out sequences."""
    if data_source not in SOURCES:
        raise EvalError(f"unknown --source {data_source!r}; allowed: {', '.join(SOURCES)}")
    if num_seqs < 1 or batch_size < 1:
        raise EvalError("num_seqs and batch_size must be at least 1")
    model, info = load_for_eval(source, device, attn_impl, model_overrides)
    block_size = info["config"]["block_size"]
    length = parse_length(length, block_size) if isinstance(length, str) else int(length)
    window = parse_length(window, block_size) if isinstance(window, str) else int(window or block_size)
    if window < 1 or window > length:
        raise EvalError(f"--window {window} must be between 1 and the length {length}")
    data_dir = data_dir or info.get("data_dir")
    sequences = validation_sequences(data_dir, length, num_seqs, data_source)
    if sequences.max() >= model.config.vocab_size:  # shards of another tokenizer: an IndexError mid-forward otherwise
        raise EvalError(f"the validation shards in {data_dir} hold token id {sequences.max()}, outside the model's "
                        f"vocabulary of {model.config.vocab_size}; they were made with another tokenizer")
    per_length = set_length(model, model_overrides, length, block_size)  # one length: one factor for "auto"
    name = name or results_name("perplexity", model_overrides)
    dev = model_device(model)
    amp_dtype = pick_dtype(dtype, dev)
    amp = autocast(dev, amp_dtype)
    folder = output_dir(source, out) if (out or isinstance(source, str)) else None
    json_path = os.path.join(writable_folder(folder), f"{name}.json") if folder else None
    saving = json_path
    n_windows = math.ceil(length / window)
    counts = np.array([min(window, length - w * window) for w in range(n_windows)], dtype=np.float64)
    totals = np.zeros(n_windows)
    results = {"schema": "perplexity", "schema_version": SCHEMA_VERSION, "model": info,
               "settings": settings_block(dev, amp_dtype, getattr(model.config, "attn_impl", None), length=length,
                                          window=window, num_seqs=num_seqs, source=data_source, data_dir=data_dir,
                                          batch_size=batch_size, block_size=block_size,
                                          model_overrides=model_overrides, **per_length),
               "sequences": 0, "windows": [], "stopped": None, "complete": False}
    bar = progress_bar(len(sequences), "perplexity") if progress else None
    t0 = time.perf_counter()
    try:
        batch = plan_batch(model, batch_size, length, HEAD_CHUNK, dev)
        for i in range(0, len(sequences), batch):
            chunk = torch.from_numpy(sequences[i:i + batch]).to(dev)
            try:
                totals += window_nll(model, chunk, window, amp).sum(dim=0).numpy()
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                raise OutOfMemory(f"out of memory at length {length:,} on {dev} "
                                  f"({str(e).splitlines()[0][:120]})") from None
            results["sequences"] += len(chunk)
            loss = totals / (counts * results["sequences"])
            results["windows"] = [{"start": w * window, "end": min((w + 1) * window, length), "loss": float(loss[w]),
                                   "perplexity": float(math.exp(loss[w]))} for w in range(n_windows)]
            results["seconds"] = round(time.perf_counter() - t0, 3)
            saving = save_progress(saving, results, "perplexity")
            if bar is not None:
                bar.update(len(chunk))
        results["complete"] = True
    except OutOfMemory as e:
        results["stopped"] = {"length": length, "reason": str(e)}
        kept = f"; {results['sequences']} sequences kept in {json_path}" if json_path else ""
        print(f"perplexity: stopped: {e}{kept}", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
    return finish(results, json_path, folder, name, lambda r, path: plot_perplexity([r], path), format_table, verbose)


def perplexity_at(results, position):
    """Perplexity of the window that contains `position` (a token index), or None past the evaluated length."""
    for w in results.get("windows", []):
        if w["start"] <= position < w["end"]:
            return w["perplexity"]
    return None


def format_table(results):
    s = results["settings"]
    lines = [f"perplexity by position: {evaluated_name(results)}, {results['sequences']} sequences of "
             f"{s['length']:,} tokens ({s['source']}), windows of {s['window']}", "",
             "| window | x context | perplexity |", "|---|---:|---:|"]
    windows = results["windows"]
    step = max(1, len(windows) // 16)  # a readable table; the JSON and the plot have every window
    shown = sorted(set(range(0, len(windows), step)) | {len(windows) - 1}) if windows else []
    for w in (windows[i] for i in shown):
        lines.append(f"| {w['start']:,}-{w['end']:,} | {w['end'] / s['block_size']:.3g} | {w['perplexity']:.2f} |")
    if results["stopped"]:
        lines.append(f"\nstopped: {results['stopped']['reason']}")
    return "\n".join(lines)


def plot_perplexity(runs, path, title=None):
    """One line per run: perplexity of each window against the window's end position."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = plt.get_cmap("tab10")
    for i, results in enumerate(runs):
        windows = results["windows"]
        if not windows:
            continue
        ends = [w["end"] for w in windows]
        ax.plot(ends, [w["perplexity"] for w in windows], marker="o", markersize=2.5, color=colors(i % 10),
                label=f"{evaluated_name(results)} ({results['sequences']} seqs)")
        ax.axvline(results["settings"]["block_size"], color=colors(i % 10), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: format_length(int(v)) if v >= 1 else f"{v:g}"))
    values = [w["perplexity"] for r in runs for w in r["windows"]]
    if values and max(values) > 3 * min(values):  # a blow-up past the context would flatten a linear axis
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("end of window (tokens); dotted: training context")
    ax.set_ylabel(f"perplexity per {runs[0]['settings']['window']}-token window" if runs else "perplexity")
    ax.set_title(title or "perplexity by position", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if any(r["windows"] for r in runs):
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv=None):
    ap = Parser(prog="eval.perplexity", description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("sources", nargs="+", help="run directories or checkpoint files")
    ap.add_argument("--length", default="64x",
                    help="tokens per sequence, e.g. 32K or 64x the context (default %(default)s)")
    ap.add_argument("--window", default=None, help="tokens per window (default: the training context)")
    ap.add_argument("--num_seqs", type=int, default=8, help="sequences to average over (default %(default)s)")
    ap.add_argument("--source", default="concat", choices=SOURCES, help="see above (default %(default)s)")
    ap.add_argument("--data_dir", default=None, help="folder with *_val_*.bin shards (default: the run's data_dir)")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--compare", default="perplexity_comparison.png",
                    help="with several runs: the plot with one line per run (default %(default)s)")
    ap.add_argument("--no_progress", action="store_true")
    add_model_args(ap, window_flag=False)  # --window is the perplexity window here; --attn_window the attention's
    args = parse_eval_args(ap, argv)
    if args.out and len(args.sources) > 1:
        raise EvalError("--out takes one run; with several, each run's results go to its own eval/ folder")
    if len(args.sources) > 1:  # before the first run is evaluated, not after the last
        writable_folder(os.path.dirname(os.path.abspath(args.compare)), "--compare")
    runs = []
    for source in args.sources:
        runs.append(evaluate_perplexity(source, length=args.length, window=args.window, num_seqs=args.num_seqs,
                                        data_source=args.source, data_dir=args.data_dir,
                                        batch_size=args.batch_size, out=args.out, device=args.device,
                                        dtype=args.dtype, attn_impl=args.attn_impl,
                                        model_overrides=args.model_overrides, progress=not args.no_progress))
    if len(runs) > 1:
        plot_perplexity(runs, args.compare, "perplexity by position, one line per run")
        print(f"wrote {args.compare}")
    return 0


if __name__ == "__main__":
    run_cli(main, interrupted="perplexity: interrupted; the sequences finished so far are saved")
