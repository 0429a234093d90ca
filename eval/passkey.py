"""
Passkey retrieval (docs/paper.md §5): can the model find a 5-digit key hidden at some depth of a long prompt?

    python -m eval.passkey runs/bam_ssmax_512                          # 0.5x ... 64x the training context
    python -m eval.passkey runs/bam_ssmax_512 --max_factor 500 --samples 10 --depths beginning
    python -m eval.passkey runs/x/checkpoints/step_00020000.pt --lengths 256,1K,16K --given_tokens 1

The prompt is the paper's: task description, repeated garbage text with the information line inserted at
a depth, the final question. Every length is exact and counts the tokens the model reads: <|endoftext|>
(every training document starts with it; with a BOS/EOS tokenizer, its BOS) + prompt + all but the last
token of " {key}", every piece tokenised with the run's tokenizer. Scoring is teacher-forced: correct only
if the argmax at every key position is the key's token (whatever tokens the run's tokenizer makes of it).

With GPT-2's BPE a 5-digit key is 2 or 3 tokens (" 123" + "45"), not 5 digit tokens as with the paper's
tokenizer, so the paper's variant that gives the first digit becomes `--given_tokens 1`: the key's first
token is given (teacher-forced, not scored) and the rest must match; keys of a single token are redrawn.

Outputs (RUN/eval/ unless --out): passkey.json (settings, per length and depth bin, every sample),
passkey.png (length x depth accuracy), and a table on stdout. The file is rewritten after every length,
so an interruption, or a length that does not fit in memory, keeps everything measured before it.
"""

import math
import time

import numpy as np

from bam import ranges
from bam.ranges import number
from bam.retrieval import GARBAGE, INFO, MAX_DIGITS, QUESTION, TASK
from bam.tokenizer import GPT2, load_tokenizer
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval
from eval.options import EvalOptions, add_model_arguments, add_output_arguments, add_prompt_arguments
from eval.prompts import encode_template, repeat_haystack
from eval.results import Output, evaluated_name, new_results, stopped_note
from eval.scoring import Sample, score_length
from eval.stats import binomial_interval, difference_bootstrap, permutation_test, seed_bootstrap
from eval.sweep import (add_length_arguments, check_length_fits, check_lengths, format_factor, format_length,
                        length_arguments, sweep, sweep_lengths)
from eval.tables import DASH, length_label, rate, table
from eval.variants import by_family, by_variant

DEPTH_MODES = ("equidistant", "beginning", "end", "random")


class PasskeyPrompts:
    """Builds passkey prompts of an exact token length with the key at a chosen depth."""

    def __init__(self, digits=5, given_tokens=0, enc=None):
        self.enc = enc if enc is not None else load_tokenizer(GPT2)  # the run's; GPT-2 without one
        self.digits, self.given = digits, given_tokens
        self.head = [self.enc.doc_open] + self.enc.encode_ordinary(TASK)
        self.question = self.enc.encode_continuation(" " + QUESTION)
        self.haystack = repeat_haystack(self.enc, GARBAGE, 0)
        # The most tokens a key can take: GPT-2 makes at most `digits` of any key; a tokenizer that splits
        # digits may add one for the space before them (" 12345" -> " ", "1", ..., "5").
        self.key_max = max(digits, *(len(self.key_tokens(str(d) * digits)) for d in range(1, 10)))

    def key_tokens(self, key):
        return self.enc.encode_continuation(f" {key}")

    def min_length(self):
        """The shortest length every key fits in (no garbage at all): a key is at most `key_max` tokens."""
        info, _ = encode_template(self.enc, " " + INFO, {"key": ""})
        return len(self.head) + len(info) + 3 * self.key_max + len(self.question) - 1

    def build(self, length, depth, key):
        info, spans = encode_template(self.enc, " " + INFO, {"key": key})
        answer = self.key_tokens(key)
        n = length + 1 - len(self.head) - len(info) - len(self.question) - len(answer)
        if n < 0:
            raise EvalError(f"length {length} is too short for a passkey prompt (at least {self.min_length()} tokens)")
        if len(self.haystack.tokens) < n:
            self.haystack = repeat_haystack(self.enc, GARBAGE, 2 * n)
        cut = self.haystack.cut(depth, n)  # the information line goes between two garbage sentences
        filler = self.haystack.tokens
        tokens = np.concatenate([self.head, filler[:cut], info, filler[cut:n], self.question, answer]).astype(np.int64)
        answer_start = len(tokens) - len(answer)
        meta = {"depth": float(depth), "actual_depth": cut / n if n else 0.0, "key": int(key),
                "key_position": len(self.head) + cut + spans["key"][0][0]}
        return Sample(tokens, [(answer_start + self.given, len(tokens))], meta)

    def samples(self, length, n, mode, seed):
        """n samples of one length. The random stream depends on (seed, length) only, so two runs, or two
        models, see the same prompts, and adding a length leaves the others unchanged."""
        rng = np.random.default_rng([seed, length])
        keys, draws = [], 0
        while len(keys) < n:
            key = int(rng.integers(10 ** (self.digits - 1), 10 ** self.digits))
            if len(self.key_tokens(key)) > self.given:  # something left to score
                keys.append(key)
            draws += 1
            if draws > 1000 * n and not keys:
                raise EvalError(f"{self.digits}-digit keys are never longer than {self.given} tokens: "
                                f"use fewer --given_tokens or more --digits")
        if mode == "equidistant":
            depths = np.linspace(0.0, 1.0, n) if n > 1 else np.array([0.5])
        elif mode == "beginning":
            depths = np.zeros(n)
        elif mode == "end":
            depths = np.ones(n)
        else:
            depths = rng.random(n)
        return [self.build(length, float(d), k) for d, k in zip(depths, keys)]


def depth_bins(records, bins):
    edges = np.linspace(0.0, 1.0, bins + 1)
    out = []
    for b in range(bins):
        inside = [r for r in records if edges[b] <= r["depth"] < edges[b + 1] or (b == bins - 1 and r["depth"] == 1.0)]
        correct = sum(r["correct"] for r in inside)
        out.append({"bin": [float(edges[b]), float(edges[b + 1])], "samples": len(inside), "correct": correct,
                    "accuracy": correct / len(inside) if inside else None})
    return out


def evaluate_passkey(source, *, options=None, lengths=None, max_factor=None, samples=20, depths="equidistant",
                     bins=10, given_tokens=0, digits=5, stop_after_zero=2):
    """Passkey accuracy per length and depth for a run dir, checkpoint file or model object. `lengths` is
    a list of token counts or a --lengths string. Writes <out>/<name>.json after every length (and the
    .png at the end) when there is an output folder: options.out, or next to the run or checkpoint.
    options.model_overrides change shape-free model settings, e.g. {"rope_scaling": "yarn", "rope_factor":
    "auto"}; the default name then ends with them (passkey_yarn_auto)."""
    options = options or EvalOptions()
    seed = 0 if options.seed is None else options.seed
    batch_size = options.batch_size or 8
    if depths not in DEPTH_MODES:
        raise EvalError(f"unknown depth mode {depths!r}; allowed: {', '.join(DEPTH_MODES)}")
    for label, value, spec in (("samples", samples, ">= 1"), ("bins", bins, ">= 1, <= 1000"),
                               ("digits", digits, f">= 1, <= {MAX_DIGITS}"), ("given_tokens", given_tokens, ">= 0"),
                               ("stop_after_zero", stop_after_zero, ">= 0")):
        try:  # the command line checked these already; a Python caller gets the same rule
            ranges.check(label, value, spec, int)
        except ValueError as e:
            raise EvalError(str(e)) from None
    evaluated = load_for_eval(source, options)
    block_size = evaluated.block_size
    default = lengths is None and not max_factor
    lengths = sweep_lengths(lengths, max_factor, block_size)
    prompts = PasskeyPrompts(digits, given_tokens, evaluated.tokenizer())
    too_short = [n for n in lengths if n < prompts.min_length()]
    if too_short and default:  # a small model's 0.5x: skip what cannot be a prompt rather than fail
        lengths = [n for n in lengths if n >= prompts.min_length()]
    elif too_short:
        raise EvalError(f"length {too_short[0]} is too short for a passkey prompt: "
                        f"use at least {prompts.min_length()} tokens")
    check_lengths(evaluated.model, lengths, samples, evaluated.device)
    output = Output.of(EVALUATOR, source, options, default_name(depths, given_tokens))

    def measure(length, bar):
        model, per_length = evaluated.at_length(length)  # e.g. the factor of rope_factor=auto
        check_length_fits(model, length, samples, evaluated.device)
        batch = prompts.samples(length, samples, depths, seed)
        t0 = time.perf_counter()
        scored = score_length(model, batch, batch_size, evaluated.autocast(), bar)
        records = [{**sample.meta, "correct": correct, "predicted": prompts.enc.decode(guess)}
                   for sample, [(correct, guess)] in zip(batch, scored)]
        correct = sum(r["correct"] for r in records)
        row = {"length": length, "factor": length / block_size if block_size else None,
               "accuracy": correct / samples, "correct": correct, "samples": samples,
               "seconds": round(time.perf_counter() - t0, 3), "by_depth": depth_bins(records, bins),
               **per_length, "records": records}
        return [row], row["accuracy"]

    settings = evaluated.settings(lengths=lengths, samples=samples, depth_mode=depths, depth_bins=bins, seed=seed,
                                  digits=digits, given_tokens=given_tokens, batch_size=batch_size,
                                  stop_after_zero=stop_after_zero, block_size=block_size)
    results = new_results("passkey", evaluated.info, settings, results=[])
    return sweep(lengths, measure, results, output, work_per_length=samples, stop_after_zero=stop_after_zero,
                 progress=options.progress)


def default_name(depths, given_tokens):
    mode = "" if depths == "equidistant" else f"_{depths}"
    return f"passkey{mode}" + (f"_given{given_tokens}" if given_tokens else "")


def format_table(results):
    s = results["settings"]
    lines = [f"passkey accuracy: {evaluated_name(results)}, {s['samples']} samples per length, depths "
             f"{s['depth_mode']}" + (f", first {s['given_tokens']} key token(s) given" if s["given_tokens"] else ""),
             "",
             "| length | x context | accuracy | 95% interval | by depth, 0 -> 1 (%) | seconds |",
             "|---:|---:|---:|---:|:---|---:|"]
    for r in results["results"]:
        by_depth = " ".join("  -" if b["accuracy"] is None else f"{100 * b['accuracy']:3.0f}" for b in r["by_depth"])
        factor = format_factor(r["factor"]) if r["factor"] is not None else "—"
        low, high = binomial_interval(r["correct"], r["samples"])
        lines.append(f"| {r['length']:,} | {factor} | {100 * r['accuracy']:.0f}% | {100 * low:.0f}-{100 * high:.0f}% | "
                     f"`{by_depth}` | {r['seconds']:.1f} |")
    return "\n".join(lines + stopped_note(results))


def plot_passkey(results, path):
    from eval.plotting import draw_heatmap, plt, save_figure

    rows = results["results"]
    bins = results["settings"]["depth_bins"]
    used = [b for b in range(bins) if any(r["by_depth"][b]["samples"] for r in rows)] or list(range(bins))
    matrix = [[math.nan if r["by_depth"][b]["accuracy"] is None else r["by_depth"][b]["accuracy"] for b in used]
              for r in rows]
    row_labels = [f"{format_length(r['length'])}" + (f" ({format_factor(r['factor'])}x)" if r["factor"] else "")
                  + f"  {100 * r['accuracy']:.0f}%" for r in rows]
    col_labels = [f"{sum(rows[0]['by_depth'][b]['bin']) / 2:.2f}" if rows else str(b) for b in used]
    s = results["settings"]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(used) + 3.0), max(3.4, 0.4 * len(rows) + 2.0)),
                           layout="constrained")
    if rows:
        image = draw_heatmap(ax, matrix, row_labels, col_labels, "depth of the key (fraction of the haystack)",
                             "length (x context), accuracy",
                             f"{evaluated_name(results)}: passkey accuracy (%)\n{s['samples']} samples per length, "
                             f"{s['depth_mode']} depths"
                             + (f", {s['given_tokens']} key token given" if s["given_tokens"] else ""))
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="accuracy")
    else:
        ax.text(0.5, 0.5, "no length was evaluated", ha="center", va="center")
        ax.set_axis_off()
    save_figure(fig, path, dpi=120)


def add_arguments(ap):
    ap.add_argument("source", help="run directory or checkpoint file")
    ap.add_argument("--samples", type=number(int, ">= 1"), default=20, help="prompts per length (default %(default)s)")
    ap.add_argument("--depths", default="equidistant", choices=DEPTH_MODES,
                    help="where the key goes (default %(default)s)")
    ap.add_argument("--depth_bins", type=number(int, ">= 1, <= 1000"), default=10, help="columns of the depth heatmap (default %(default)s)")
    ap.add_argument("--given_tokens", type=number(int, ">= 0"), default=0,
                    help="leading key tokens given and not scored; 1 = the paper's first-digit variant")
    ap.add_argument("--digits", type=number(int, f">= 1, <= {MAX_DIGITS}"), default=5,
                    help=f"digits of the pass key (default %(default)s, at most {MAX_DIGITS})")
    add_length_arguments(ap)
    add_prompt_arguments(ap, batch_size=8)
    add_model_arguments(ap)
    add_output_arguments(ap, "results file name (default: passkey[_<depths>][_given<N>][_<overrides>])")


def run(args, options):
    evaluate_passkey(args.source, options=options, samples=args.samples, depths=args.depths, bins=args.depth_bins,
                     given_tokens=args.given_tokens, digits=args.digits, **length_arguments(args))


# ---------------------------------------------------------------------------------------------------
# eval.report


def seed_counts(variant_runs, name, length):
    """(correct, prompts) at `length` of each seed of a variant that has it, from results file `name`."""
    counts = []
    for r in variant_runs:
        row = next((x for x in r.all("passkey").get(name, {"results": []})["results"] if x["length"] == length), None)
        if row is not None:
            counts.append((row["correct"], row["samples"]))
    return counts


def variant_cell(counts):
    """Mean accuracy over seeds, the seeds' own values (their range past four seeds) in brackets, and the
    two-level bootstrap interval over seeds and prompts; one seed: its rate with the Wilson interval."""
    if not counts:
        return DASH
    if len(counts) == 1:
        return rate(*counts[0])
    accuracy = [c / n for c, n in counts]
    spread = " ".join(f"{100 * a:.0f}" for a in accuracy) if len(accuracy) <= 4 else \
        f"{100 * min(accuracy):.0f}-{100 * max(accuracy):.0f}"
    low, high = seed_bootstrap(counts)
    return f"{100 * np.mean(accuracy):.0f} [{spread}] ({100 * low:.0f}-{100 * high:.0f})"


def comparison(name, a, b, variants, lengths, runs):
    """Variant a against variant b at every length both have: the difference of mean accuracy, its two-level
    bootstrap interval, and the permutation test over their seeds."""
    rows = []
    for n in lengths:
        ca, cb = seed_counts(variants[a], name, n), seed_counts(variants[b], name, n)
        if not ca or not cb:
            continue
        sa, sb = [c / t for c, t in ca], [c / t for c, t in cb]
        low, high = difference_bootstrap(ca, cb)
        rows.append([length_label(n, runs), f"{100 * np.mean(sa):.0f} ({len(sa)})", f"{100 * np.mean(sb):.0f} ({len(sb)})",
                     f"{100 * (np.mean(sa) - np.mean(sb)):+.0f} ({100 * low:+.0f} to {100 * high:+.0f})",
                     f"{permutation_test(sa, sb):.3g}"])
    return [f"**{a}** against **{b}** ({name}):", ""] + table(["length", a, b, "difference", "p"], rows) + [""]


COMPARISONS = ("Comparisons (`--compare A B`): per length, each variant's mean accuracy (%) with its number of "
               "seeds, the difference with its 95% two-level bootstrap interval, and the two-sided p-value of a "
               "permutation test over the seeds' accuracies (exact over every relabelling; with n and m seeds it "
               "cannot go below 1 / C(n + m, n), or 2 / C(2n, n) for n against n). Many comparisons are made at "
               "once, so a single p near its floor is weak evidence on its own.")


def section(runs, report_options):
    """Per passkey results file (passkey, passkey_given1, ...): a table of variants (seeds aggregated; only
    when some variant has several seeds), the comparisons asked for (--compare A B), then every run on its
    own (its Wilson interval)."""
    names = sorted({name for r in runs for name in r.all("passkey")}, key=lambda n: (n != "passkey", n))
    lines = []
    for name in names:
        present = [r for r in runs if name in r.all("passkey")]
        s = present[0].all("passkey")[name]["settings"]
        given = f", first {s['given_tokens']} key token(s) given" if s["given_tokens"] else ""
        lengths = sorted({x["length"] for r in present for x in r.all("passkey")[name]["results"]})
        variants = by_variant(present)
        protocol = f"{s['samples']} prompts per length and seed, {s['depth_mode']} depths{given}"
        if any(len(members) > 1 for members in variants.values()):  # else the table of runs says it all
            lines += [f"**{name}** by variant — mean accuracy (%) over the variant's seeds, the seeds' own accuracies "
                      f"in brackets (their range past four seeds), and in parentheses the 95% interval of the mean "
                      f"over seeds and prompts (two-level bootstrap, docs/evaluation.md); a variant of one seed shows "
                      f"its Wilson interval and prompt count instead. {protocol}.", ""]
            rows = [[variant, len(members)] + [variant_cell(seed_counts(members, name, n)) for n in lengths]
                    for variant, members in variants.items()]
            lines += table(["variant", "seeds"] + [length_label(n, runs) for n in lengths], rows) + [""]
        pairs = [(a, b) for a, b in report_options.get("compare") or [] if a in variants and b in variants]
        lines += [COMPARISONS, ""] if pairs else []
        for a, b in pairs:
            lines += comparison(name, a, b, variants, lengths, runs)
        # One row per run and one column per length, as the paper's tables: many runs stay readable.
        rows = []
        for r in present:
            cells = {x["length"]: x for x in r.all("passkey")[name]["results"]}
            rows.append([r.name] + [rate(cells[n]["correct"], cells[n]["samples"]) if n in cells else DASH
                                    for n in lengths])
        lines += [f"**{name}**, every run — accuracy (%) by prompt length, with its Wilson 95% interval and the "
                  f"number of prompts; {protocol}.", ""]
        lines += table(["run"] + [length_label(n, runs) for n in lengths], rows) + [""]
    return lines


def plot_variants(runs, path):
    """Accuracy against length (the plain passkey results) in small multiples, one panel per family of
    encodings (model.ENCODINGS' `family`): a line per variant through its mean over seeds, a band over its
    seeds' range."""
    from eval.plotting import family_panels, finish_panels, log2_length_axis, plt

    variants = by_variant([r for r in runs if r.all("passkey").get("passkey", {}).get("results")])
    families = {family: {v: variants[v] for v in names} for family, names in by_family(variants).items()}
    if not families:
        return False
    fig, axes, panels = family_panels(families)
    for ax, family, variants in panels:
        for i, (variant, members) in enumerate(variants.items()):
            lengths = sorted({x["length"] for r in members for x in r.all("passkey")["passkey"]["results"]})
            per_seed = [[c / n for c, n in seed_counts(members, "passkey", L)] for L in lengths]
            color = plt.get_cmap("tab10")(i % 10)
            style = ("-", "--", ":")[i // 10 % 3]
            ax.plot(lengths, [100 * np.mean(a) for a in per_seed], marker="o", markersize=3, color=color,
                    linestyle=style, label=f"{variant} ({len(members)} seed{'s' if len(members) > 1 else ''})")
            if len(members) > 1:
                ax.fill_between(lengths, [100 * min(a) for a in per_seed], [100 * max(a) for a in per_seed],
                                color=color, alpha=0.15, linewidth=0)
        context = {r.pretraining_context for v in variants.values() for r in v if r.pretraining_context}
        for c in context:
            ax.axvline(c, color="grey", linestyle=":", linewidth=1)
        log2_length_axis(ax)
        ax.set_ylim(-3, 103)
        ax.set_title(family, fontsize=10)
        ax.set_xlabel("prompt length (tokens); dotted: training context")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")  # accuracy falls with length: short and low is empty
    finish_panels(fig, axes, len(families), "passkey accuracy (%)",
                  "passkey retrieval by variant: mean over seeds, band = the seeds' range", path)
    return True


EVALUATOR = Evaluator(
    name="passkey", title="Passkey retrieval", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=plot_passkey, section=section,
    summary_plot=plot_variants, interrupted="passkey: interrupted; the lengths finished so far are saved")
main = EVALUATOR.main

if __name__ == "__main__":
    EVALUATOR.cli()
