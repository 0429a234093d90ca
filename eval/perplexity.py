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

from bam.ranges import number
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval
from eval.memory import OutOfMemory, plan_batch, stop_when_out_of_memory
from eval.options import EvalOptions, add_model_arguments, add_output_arguments
from eval.prompts import SOURCES, validation_sequences
from eval.results import Output, evaluated_name, new_results, writable_folder
from eval.sweep import check_lengths, format_factor, format_length, parse_length, progress_bar
from eval.tables import DASH, length_label, table

HEAD_CHUNK = 1024  # positions per LM-head call: B x 1024 x vocab fp32 logits at a time


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


def evaluate_perplexity(source, *, options=None, length="64x", window=None, num_seqs=8, data_source="concat",
                        data_dir=None):
    """Per-window perplexity of one model (run dir, checkpoint or model object) over held-out sequences."""
    options = options or EvalOptions()
    batch_size = options.batch_size or 1
    if data_source not in SOURCES:
        raise EvalError(f"unknown --source {data_source!r}; allowed: {', '.join(SOURCES)}")
    if num_seqs < 1:
        raise EvalError("num_seqs must be at least 1")
    evaluated = load_for_eval(source, options)
    block_size = evaluated.block_size
    length = parse_length(length, block_size) if isinstance(length, str) else int(length)
    window = parse_length(window, block_size) if isinstance(window, str) else int(window or block_size)
    if window < 1 or window > length:
        raise EvalError(f"--window {window} must be between 1 and the length {length}")
    check_lengths(evaluated.model, [length], num_seqs, evaluated.device, "a shorter --length or fewer --num_seqs")  # before num_seqs x length tokens are read
    data_dir = data_dir or evaluated.info.get("data_dir")
    enc = evaluated.tokenizer()  # the run's: its separators, and its shards only
    sequences = validation_sequences(data_dir, length, num_seqs, data_source, enc.separators, enc.identity)
    model, per_length = evaluated.at_length(length)  # one length: one factor for "auto"
    if sequences.max() >= model.config.vocab_size:  # shards of another tokenizer: an IndexError mid-forward otherwise
        raise EvalError(f"the validation shards in {data_dir} hold token id {sequences.max()}, outside the model's "
                        f"vocabulary of {model.config.vocab_size}; they were made with another tokenizer")
    output = Output.of(EVALUATOR, source, options, "perplexity")
    n_windows = math.ceil(length / window)
    counts = np.array([min(window, length - w * window) for w in range(n_windows)], dtype=np.float64)
    totals = np.zeros(n_windows)
    settings = evaluated.settings(length=length, window=window, num_seqs=num_seqs, source=data_source,
                                  data_dir=data_dir, batch_size=batch_size, block_size=block_size, **per_length)
    results = new_results("perplexity", evaluated.info, settings, sequences=0, windows=[])
    bar = progress_bar(len(sequences), "perplexity") if options.progress else None
    t0 = time.perf_counter()
    try:
        batch = plan_batch(model, batch_size, length, HEAD_CHUNK, evaluated.device)
        for i in range(0, len(sequences), batch):
            chunk = torch.from_numpy(sequences[i:i + batch]).to(evaluated.device)
            with stop_when_out_of_memory(f"at length {length:,}", evaluated.device):
                totals += window_nll(model, chunk, window, evaluated.autocast()).sum(dim=0).numpy()
            results["sequences"] += len(chunk)
            loss = totals / (counts * results["sequences"])
            results["windows"] = [{"start": w * window, "end": min((w + 1) * window, length), "loss": float(loss[w]),
                                   "perplexity": float(math.exp(loss[w]))} for w in range(n_windows)]
            results["seconds"] = round(time.perf_counter() - t0, 3)
            output.save(results)
            if bar is not None:
                bar.update(len(chunk))
        results["complete"] = True
    except OutOfMemory as e:
        results["stopped"] = {"length": length, "reason": str(e)}
        kept = f"; {results['sequences']} sequences kept in {output.json_path}" if output.json_path else ""
        print(f"perplexity: stopped: {e}{kept}", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
    return output.finish(results)


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
        factor = format_factor(w["end"] / s["block_size"])
        lines.append(f"| {w['start']:,}-{w['end']:,} | {factor} | {w['perplexity']:.2f} |")
    if results["stopped"]:
        lines.append(f"\nstopped: {results['stopped']['reason']}")
    return "\n".join(lines)


def plot_perplexity(runs, path, title=None):
    """One line per run (its results): perplexity of each window against the window's end position."""
    from eval.plotting import plt, save_figure

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


def add_arguments(ap):
    ap.add_argument("sources", nargs="+", help="run directories or checkpoint files")
    ap.add_argument("--length", default="64x",
                    help="tokens per sequence, e.g. 32K or 64x the context (default %(default)s)")
    ap.add_argument("--window", default=None, help="tokens per window (default: the training context)")
    ap.add_argument("--num_seqs", type=number(int, ">= 1"), default=8, help="sequences to average over (default %(default)s)")
    ap.add_argument("--source", default="concat", choices=SOURCES, help="see above (default %(default)s)")
    ap.add_argument("--data_dir", default=None, help="folder with *_val_*.bin shards (default: the run's data_dir)")
    ap.add_argument("--batch_size", type=number(int, ">= 1"), default=1)
    ap.add_argument("--compare", default="perplexity_comparison.png",
                    help="with several runs: the plot with one line per run (default %(default)s)")
    ap.add_argument("--no_progress", action="store_true")
    add_model_arguments(ap, window_flag=False)  # --window is the perplexity window here; --attn_window the attention's
    add_output_arguments(ap)


def run(args, options):
    if args.out and len(args.sources) > 1:
        raise EvalError("--out takes one run; with several, each run's results go to its own eval/ folder")
    if len(args.sources) > 1:  # before the first run is evaluated, not after the last
        writable_folder(os.path.dirname(os.path.abspath(args.compare)), "--compare")
    runs = [evaluate_perplexity(source, options=options, length=args.length, window=args.window,
                                num_seqs=args.num_seqs, data_source=args.source, data_dir=args.data_dir)
            for source in args.sources]
    if len(runs) > 1:
        plot_perplexity(runs, args.compare, "perplexity by position, one line per run")
        print(f"wrote {args.compare}")


# ---------------------------------------------------------------------------------------------------
# eval.report


def add_report_arguments(ap):
    ap.add_argument("--ppl_at", default=None,
                    help="positions for the perplexity table, e.g. 512,4K,32K or 1x,8x (x = the smallest training "
                         "context among the runs; default: 1x, 2x, 4x, ... up to the longest evaluated)")


def section(runs, report_options):
    """Perplexity of the window ending at each position (report option ppl_at), one column per run."""
    present = [r.get("perplexity") for r in runs if r.get("perplexity")]
    base = min((r.block_size for r in runs if r.block_size), default=512)
    if report_options.get("ppl_at"):
        positions = [parse_length(t, base) for t in report_options["ppl_at"].split(",") if t.strip()]
    else:
        longest = max(res["settings"]["length"] for res in present)
        positions = [base * f for f in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if base * f <= max(longest, base)]
    s = present[0]["settings"]
    lines = [f"Perplexity of the {s['window']}-token window ending at each position ({s['source']} validation "
             f"sequences; {DASH}: not evaluated that far).", ""]

    def cell(run, position):
        value = perplexity_at(run.get("perplexity"), position - 1) if run.get("perplexity") else None
        return DASH if value is None else f"{value:.2f}"

    rows = [[length_label(p, runs)] + [cell(r, p) for r in runs] for p in positions]
    return lines + table(["position"] + [r.name for r in runs], rows)


def plot_runs(runs, path):
    present = [r.get("perplexity") for r in runs if r.get("perplexity")]
    plot_perplexity(present, path, "perplexity by position, one line per run")
    return True


EVALUATOR = Evaluator(
    name="perplexity", title="Perplexity by position", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=lambda results, path: plot_perplexity(
        [results], path), section=section, summary_plot=plot_runs, report_arguments=add_report_arguments,
    interrupted="perplexity: interrupted; the sequences finished so far are saved")
main = EVALUATOR.main

if __name__ == "__main__":
    EVALUATOR.cli()
