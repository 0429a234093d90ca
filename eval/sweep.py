"""Lengths and the loop over them: how lengths are written ("4096", "16K", "2x"), the command-line options
of a length sweep, and the sweep itself, which saves after every length and stops cleanly when a length
does not fit in memory or retrieval has been at zero for a while."""

import re
import sys

import numpy as np
from tqdm import tqdm

from bam.ranges import number
from eval import EvalError
from eval.memory import OutOfMemory, check_fits, forward_bytes

DEFAULT_FACTORS = "0.5x,1x,2x,4x,8x,16x,32x,64x"  # 256 ... 32,768 for a 512 context: the paper's table


def parse_length(text, block_size):
    """Token counts ("4096", "16K" = 16,384, "1M") or multiples of the training context ("2x")."""
    spec = text.strip().lower().replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]|x)?", spec)
    if not m:
        raise EvalError(f"cannot read the length {text!r}; use token counts (4096, 16K = 16384, 1M) or "
                        f"multiples of the training context (0.5x, 2x, 500x)")
    n = float(m[1]) * {None: 1, "k": 1024, "m": 1024 ** 2, "x": block_size}[m[2]]
    if n < 1:
        raise EvalError(f"length {text!r} is less than one token")
    return int(round(n))


def parse_lengths(spec, block_size, max_factor=None):
    """Explicit lengths plus, with max_factor, the training context times 1, 2, 4, ... up to max_factor."""
    lengths = {parse_length(t, block_size) for t in (spec or "").split(",") if t.strip()}
    if max_factor is not None:
        if max_factor < 1:
            raise EvalError(f"--max_factor must be at least 1, got {max_factor}")
        factor = 1
        while factor < max_factor:
            lengths.add(block_size * factor)
            factor *= 2
        lengths.add(int(round(block_size * max_factor)))
    if not lengths:
        raise EvalError("no lengths to evaluate: give --lengths and/or --max_factor")
    return sorted(lengths)


# A prompt of a sweep is held as int64 tokens about three times over (its haystack, the prompt, the batch
# stacked for the forward) before the forward's own memory (eval.memory.forward_bytes).
PROMPT_COPIES = 3


def check_length_fits(model, length, samples, device):
    """OutOfMemory unless `samples` prompts of `length` tokens and the forward over one of them fit in the
    memory free now: asked before the prompts are built, so 10^12 tokens are one line, not numpy's error."""
    need = forward_bytes(model, 1, length, 1) + PROMPT_COPIES * 8 * samples * length
    check_fits(need, device, f"length {length:,} ({samples} prompts)")


def check_lengths(model, lengths, samples, device, shorter="shorter --lengths or a smaller --max_factor"):
    """Before anything is written: an EvalError when not even the shortest length fits, so that a sweep
    that could measure nothing creates nothing. Longer lengths that do not fit stop the sweep there."""
    try:
        check_length_fits(model, min(lengths), samples, device)
    except OutOfMemory as e:
        raise EvalError(f"{e}; nothing to evaluate: use {shorter}") from None


def format_length(n):
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def format_factor(factor):
    """A multiple of the training context as the tables and plots print it (followed by "x"): three significant
    digits, never an exponent (0.5, 2, 1.95, 1,024 rather than 1.02e+03), thousands separated as in
    format_length."""
    if factor >= 100:
        return f"{factor:,.0f}"  # three significant digits or more, as below
    return np.format_float_positional(factor, precision=3, unique=True, fractional=False, trim="-")


def sweep_lengths(lengths, max_factor, block_size):
    """A sweep's lengths in tokens: a list as given, else a --lengths string (with --max_factor's powers
    of two), else DEFAULT_FACTORS when neither is given."""
    if lengths is not None and not isinstance(lengths, str):
        return lengths
    spec = DEFAULT_FACTORS if lengths is None and not max_factor else lengths
    return parse_lengths(spec, block_size or 1, max_factor)


def add_length_arguments(parser, stop_after_zero=True):
    """--lengths and --max_factor (and --stop_after_zero for a sweep that scores retrieval);
    `length_arguments` reads them back."""
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated lengths in tokens (4096, 16K, 1M) or x training context (2x); "
                             f"default {DEFAULT_FACTORS} unless --max_factor is given")
    parser.add_argument("--max_factor", type=number(float, ">= 1"), default=None,
                        help="add the training context x 1, 2, 4, ... up to this factor (the paper: 500)")
    if stop_after_zero:
        parser.add_argument("--stop_after_zero", type=number(int, ">= 0"), default=2,
                            help="stop after this many lengths in a row at 0%% (0 = never)")


def length_arguments(args):
    """The keyword arguments of an evaluate_* function that `add_length_arguments` parsed."""
    names = ("lengths", "max_factor", "stop_after_zero")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def progress_bar(total, desc):
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True, leave=False,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


def sweep(lengths, measure, results, output, *, work_per_length, stop_after_zero=0, progress=True):
    """The length loop, in the order of `lengths`. `measure(length, bar)` evaluates one length (advancing
    the progress bar by `work_per_length`) and returns its rows, appended to results["results"], and the best score
    among them (None when nothing could be scored). After every length the output's JSON is rewritten, so
    what was measured survives an interruption; a length that does not fit in memory (OutOfMemory) stops
    the sweep and keeps the earlier lengths, as do `stop_after_zero` lengths in a row whose best score is
    0. Ends with output.finish (the final JSON, the plot, the table) and returns the results, with why
    the sweep stopped early (`stopped`) or that it finished (`complete`)."""
    schema = results["schema"]
    bar = progress_bar(len(lengths) * work_per_length, schema) if progress else None
    zero_streak = 0
    try:
        for length in lengths:
            if bar is not None:
                bar.set_postfix(length=format_length(length))
            try:
                rows, best = measure(length, bar)
            except OutOfMemory as e:  # rows of a half-measured length are dropped with it
                results["stopped"] = {"length": length, "reason": str(e)}
                kept = f" in {output.json_path}" if output.json_path else ""
                print(f"{schema}: stopped: {e}; results so far are kept{kept}", file=sys.stderr)
                break
            results["results"] += rows
            output.save(results)
            zero_streak = zero_streak + 1 if best == 0 else 0
            results["stopped"] = zero_stop(zero_streak, stop_after_zero, lengths, length)
            if results["stopped"]:
                break
        else:
            results["complete"] = True
    finally:
        if bar is not None:
            bar.close()
    return output.finish(results)


def zero_stop(zero_streak, stop_after_zero, lengths, length):
    """The `stopped` entry once `stop_after_zero` lengths in a row scored 0% (None to go on)."""
    if stop_after_zero and zero_streak >= stop_after_zero and length != lengths[-1]:
        return {"length": lengths[lengths.index(length) + 1],
                "reason": f"{zero_streak} lengths in a row at 0% (--stop_after_zero)"}
    return None
