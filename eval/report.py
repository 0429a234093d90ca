"""
One markdown report comparing runs, from the results their evaluators saved (nothing is re-run).

    python -m eval.report runs/bam_ssmax_512 runs/rope_512 runs/alibi_512 --out report.md

Reads RUN/eval/*.json of each run (the results of every evaluator in eval.EVALUATORS) and RUN/metrics.jsonl
for the tokens trained and the loss curves (eval.runs), and writes: the runs (encoding, size, parameters,
tokens), the loss each variant reached (eval.training_section, with <name>_training.png), then one section per
evaluator in the registry's order (passkey accuracy by length, NIAH by length and task, perplexity at chosen
positions, downstream task scores, the prior shape groups, attention by prompt length), and every run's plots
side by side (relative links, so the report can be moved together with the run folders). Evaluators with a
summary plot draw it next to the report: <name>_passkey.png, <name>_perplexity.png, <name>_attention.png.
An evaluation a run does not have is shown as "—".

Results evaluated with model overrides (`--window 512`, `--rope_scaling yarn --rope_factor 16`, ...) count
as a run of their own (a row of the passkey table, a column elsewhere), named after them:
"rope_512: rope + YaRN x16", "rope_512: rope-local (W=512)". Retrieval cells give the rate, its Wilson 95%
interval and the number of trials, e.g. "45 (26-66, n=20)", so a difference between two runs can be told
from noise.
"""

import os
import re

from bam.cli import Parser, run_cli
from bam.outputs import write_bytes, write_text
from eval import EvalError, evaluators, training_section
from eval.results import writable_folder
from eval.runs import load_runs
from eval.tables import DASH, human, table
from eval.variants import assign_variants


def tokenizer_label(model_block):
    """The run's tokenizer and the model's vocabulary, e.g. `gpt2 (50,257)`; results written before the
    tokenizer was recorded are GPT-2's, the only one there was."""
    if not model_block:
        return DASH
    name = model_block.get("tokenizer") or "gpt2"
    name = os.path.basename(os.path.normpath(name)) if os.path.isdir(name) or name.startswith((".", "/", "~")) else name
    vocab = (model_block.get("config") or {}).get("vocab_size")
    return f"{name} ({vocab:,})" if vocab else name


def runs_section(runs):
    rows = []
    for r in runs:
        c = r.model_config
        shape = f"{c['n_layer']} x {c['n_embd']}, {c['n_head']} heads" if c else DASH
        m = r.model or {}
        rows.append([r.name, r.variant or DASH, DASH if r.seed is None else r.seed, shape, c.get("block_size", DASH),
                     tokenizer_label(m), human(m.get("num_params")), human(m.get("num_params_non_embedding")), human(r.tokens),
                     DASH if r.step is None else f"{r.step:,}"])
    return ["## Runs", "", "A variant is the runs whose configs differ only in the seed (and where they were written); "
            "evaluator overrides make variants of their own. Its name is the encoding, then every setting of the "
            "encoding away from its default, then what else sets its config apart from the variants of the same "
            "encoding.", ""] + \
        table(["run", "variant", "seed", "layers x width", "training context", "tokenizer", "parameters", "non-embedding",
               "tokens trained", "step"], rows)


def evaluator_section(evaluator, runs, options):
    """An evaluator's heading and section; one line saying how to get results when no run has any."""
    lines = [f"## {evaluator.title}", ""]
    if not any(r.all(evaluator.name) for r in runs):
        return lines + [f"{DASH} (no run has {evaluator.name} results: `python -m eval.{evaluator.name} RUN`)"]
    return lines + evaluator.section(runs, options)


def plots_section(runs, out, summary, run_plots=True):
    """The summary plots (drawn next to the report) and, with run_plots, every run's own plots, copied into
    <report>_plots/ beside the report so that the report and its images move (or are committed) together."""
    out_dir, copies = os.path.dirname(os.path.abspath(out)), os.path.splitext(os.path.abspath(out))[0] + "_plots"

    def link(path, run=None):
        if not path or not os.path.isfile(path):
            return DASH
        if run is not None:  # a run's own plot: a copy named after the run, since every run has a passkey.png
            copy = os.path.join(copies, re.sub(r"[^A-Za-z0-9_.+-]+", "-", run.name) + "_" + os.path.basename(path))
            os.makedirs(copies, exist_ok=True)
            with open(path, "rb") as f:
                write_bytes(copy, [f.read()])
            path = copy
        return f"![]({os.path.relpath(path, out_dir)})"

    lines = ["## Plots", ""] + [link(path) for path in summary] + [""]
    if not run_plots:
        return lines
    rows = [[label] + [link(r.plot_path(evaluator.name, suffix), r) for r in runs]
            for evaluator in evaluators().values() for label, suffix in evaluator.plots()]
    return lines + table(["plot"] + [r.name for r in runs], rows)


def check_comparisons(runs, pairs):
    """--compare A B names two variants of the report; one line listing them otherwise."""
    known = sorted({r.variant for r in runs})
    for name in (n for pair in pairs for n in pair):
        if name not in known:
            raise EvalError(f"--compare {name!r}: no such variant in this report; its variants are: "
                            + "; ".join(repr(k) for k in known))


def distinct_names(runs):
    """Runs of one name told apart: two grids' bam_ssmax_seed1 by the folder above each (runs5/bam_ssmax_seed1,
    runs5_10000/bam_ssmax_seed1), and where that is shared too (two runs' checkpoints/best.pt) by their place
    in the list."""
    def repeated(name):
        return sum(r.name == name for r in runs) > 1
    for r in [r for r in runs if repeated(r.name)]:
        parent = os.path.basename(os.path.dirname(os.path.abspath(os.path.normpath(r.path))))
        r.name = f"{parent}/{r.name}" if parent else r.name
    for i, r in [(i, r) for i, r in enumerate(runs) if repeated(r.name)]:
        r.name = f"{r.name} ({i + 1})"


def write_report(sources, *, out="report.md", title="Evaluation report", run_plots=True, options=None):
    """The report of `sources` (run directories, checkpoints or eval folders) in the markdown file `out`.
    `options`: the report options the evaluators' sections read (eval.report's command line, e.g.
    {"ppl_at": "512,4K"})."""
    runs = [r for s in sources for r in load_runs(s)]
    if not any(r.results for r in runs):
        raise EvalError(f"nothing to report: no evaluation results in {', '.join(r.folder for r in runs)}; "
                        f"run an evaluator first (python -m eval.passkey RUN)")
    distinct_names(runs)
    assign_variants(runs)
    options = dict(options or {})
    check_comparisons(runs, options.get("compare") or [])
    writable_folder(os.path.dirname(os.path.abspath(out)))  # before any plot is drawn
    if os.path.isdir(out):
        raise EvalError(f"--out {out} is a directory; give the markdown file to write, e.g. {os.path.join(out, 'report.md')}")
    stem = os.path.splitext(os.path.abspath(out))[0]
    summary = []
    if training_section.plot(runs, f"{stem}_training.png"):
        summary.append(f"{stem}_training.png")
    for evaluator in evaluators().values():
        path = f"{stem}_{evaluator.name}.png"
        if evaluator.summary_plot and any(r.all(evaluator.name) for r in runs) and evaluator.summary_plot(runs, path):
            summary.append(path)
    listed = ", ".join(f"`{s}`" for s in sources)
    lines = [f"# {title}", "", f"Runs: {listed}. Built by `python -m eval.report` from the "
             f"saved results (`RUN/eval/*.json`); rerun an evaluator to refresh its numbers.", ""]
    sections = [runs_section(runs), training_section.section(runs)] + [evaluator_section(e, runs, options)
                                                                        for e in evaluators().values()]
    for section in sections + [plots_section(runs, out, summary, run_plots)]:
        lines += section + [""]
    write_text(out, "\n".join(lines))
    return out


def main(argv=None):
    ap = Parser(prog="eval.report", description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("sources", nargs="+", help="run directories (or checkpoint files, or eval folders)")
    ap.add_argument("--out", default="report.md", help="markdown file to write (default %(default)s)")
    ap.add_argument("--title", default="Evaluation report")
    ap.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"), default=[],
                    help="two variants (as the runs table names them) to test against each other: per length the "
                         "difference of their mean accuracy, its interval and a permutation test over seeds; "
                         "may be given more than once")
    ap.add_argument("--no_run_plots", action="store_true",
                    help="leave out the table of each run's own plots: for a report kept apart from the run "
                         "folders (e.g. committed under docs/), the summary plots only")
    for evaluator in evaluators().values():
        if evaluator.report_arguments:
            evaluator.report_arguments(ap)
    args = ap.parse_args(argv)
    written = write_report(args.sources, out=args.out, title=args.title, run_plots=not args.no_run_plots,
                           options=vars(args))
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    run_cli(main)
