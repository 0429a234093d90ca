"""
One markdown report comparing runs, from the results their evaluators saved (nothing is re-run).

    python -m eval.report runs/bam_ssmax_512 runs/rope_512 runs/alibi_512 --out report.md

Reads RUN/eval/*.json of each run (the results of every evaluator in eval.EVALUATORS) and RUN/metrics.jsonl
for the tokens trained and the loss curves, and writes: the runs (encoding, size, parameters, tokens), the
loss each variant reached (eval.training, with <name>_training.png), then one section per
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

import glob
import json
import os
import re
import sys

from bam.checkpoint import CONFIG, METRICS
from bam.cli import Parser, run_cli
from bam.config import ConfigError, load_config, to_dict
from bam.outputs import write_bytes, write_text
from eval import EvalError, evaluators, training, variants
from eval.loading import output_dir
from eval.options import overrides_label, overrides_suffix
from eval.reporting import DASH, Run, human, table
from eval.results import SCHEMA_VERSION, read_json, read_metrics, writable_folder


def eval_folder(path):
    """A run's eval folder: RUN/eval, a checkpoint's eval/<name>/, or an eval folder given directly."""
    if not os.path.exists(path):
        raise EvalError(f"no run directory, checkpoint or eval folder at {path}")
    is_eval_folder = not os.path.isdir(os.path.join(path, "eval")) and glob.glob(os.path.join(path, "*.json"))
    if os.path.isdir(path) and is_eval_folder:
        return path
    return output_dir(path)


def run_dir_of(path):
    """The run directory of `path`: one with checkpoints, or one kept without them (its config.toml beside its
    eval/ folder or its metrics.jsonl, as configs/repro/grid5.sh keeps finished runs under docs/repro/runs5; a
    diverged run has no results, and git keeps no empty eval/ folder for it)."""
    kept = os.path.isfile(os.path.join(path, CONFIG)) and (os.path.isdir(os.path.join(path, "eval"))
                                                            or os.path.isfile(os.path.join(path, METRICS)))
    if os.path.isdir(path) and (os.path.isdir(os.path.join(path, "checkpoints")) or kept):
        return path
    if os.path.isfile(path) and os.path.basename(os.path.dirname(os.path.abspath(path))) == "checkpoints":
        return os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return None


def load_runs(path):
    """The columns one run contributes: its plain evaluations, then one per set of model overrides."""
    folder = eval_folder(path)
    name = os.path.basename(os.path.normpath(path))
    variants = {}
    for file, results in results_files(folder):
        overrides = results.get("settings", {}).get("model_overrides") or {}
        run = variants.setdefault(json.dumps(overrides, sort_keys=True), Run(path, folder, name, overrides))
        stem = os.path.splitext(os.path.basename(file))[0]
        suffix = overrides_suffix(overrides)
        if suffix and stem.endswith("_" + suffix):  # passkey_yarn_x16 sits in the table of passkey
            stem = stem[:-len(suffix) - 1]
        run.results.setdefault(results["schema"], {})[stem] = results
        run.model = run.model or results.get("model")
    runs = [variants.pop(json.dumps({}), None)] + [variants[k] for k in sorted(variants)]
    runs = [r for r in runs if r] or [Run(path, folder, name, {})]
    config = run_config(path)
    for run in runs:
        run.config = config
        if run.overrides:
            run.name = f"{name}: {overrides_label((run.model or {}).get('config') or {}, run.overrides)}"
        add_training_state(run, path)
    if not any(r.results for r in runs):
        stop = training.divergence(runs[0].metrics) if runs[0].metrics else None
        if stop:  # nothing to evaluate: the report's training section shows where it stopped
            print(f"report: {path} diverged at step {stop[0]}; it is in the training section only", file=sys.stderr)
        else:
            print(f"report: no evaluation results in {folder} (run python -m eval.passkey {path} first)",
                  file=sys.stderr)
    return runs


def results_files(folder):
    """(path, results) of every registered evaluator's JSON in the folder, in a schema version this reads."""
    known = evaluators()
    for file in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            results = read_json(file)
        except (OSError, ValueError):
            print(f"report: skipping {file}: not readable JSON", file=sys.stderr)
            continue
        if not isinstance(results, dict) or results.get("schema") not in known:
            continue
        if results.get("schema_version") != SCHEMA_VERSION:
            print(f"report: skipping {file}: schema version {results.get('schema_version')}, this report reads "
                  f"{SCHEMA_VERSION}", file=sys.stderr)
            continue
        results["_file"] = file
        yield file, results


def run_config(path):
    """The resolved config of the run at `path` (RUN/config.toml) as a run started today reads it: old key
    names moved, settings newer than the file at their defaults. None for a checkpoint or eval folder
    outside a run directory (its variant is then told by its model config alone)."""
    run_dir = run_dir_of(path)
    file = os.path.join(run_dir, CONFIG) if run_dir else None
    if not file or not os.path.isfile(file):
        return None
    try:
        return to_dict(load_config(file))
    except ConfigError as e:
        print(f"report: {e}; {path} is grouped with other runs by its model config alone", file=sys.stderr)
        return None


def assign_variants(runs):
    """Name every run's variant (eval.variants): the runs that differ only in seed and folder share one."""
    def config_of(run):
        return run.config or (run.model or {}).get("config") or {}

    groups = variants.group(runs, config_of, lambda r: r.overrides)
    # the model config its results recorded, or its config.toml's (a run kept without results: one that diverged)
    labels = [overrides_label((g[0].model or {}).get("config") or (g[0].config or {}).get("model") or {},
                              g[0].overrides) for g in groups]
    defaults = variants.flatten(to_dict(load_config()))  # what a config file that sets nothing gets
    for group, name in zip(groups, variants.names(labels, [config_of(g[0]) for g in groups], defaults)):
        for run in group:
            run.variant = name
            run.seed = variants.flatten(config_of(run)).get("train.seed")


def add_training_state(run, path):
    """The step and tokens trained, from the results or else from the run's metrics.jsonl."""
    if run.model:
        run.step, run.tokens = run.model.get("step"), run.model.get("tokens_seen")
    run_dir = run_dir_of(path)
    metrics = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
    if metrics and os.path.isfile(metrics):
        run.metrics = metrics
        rows = read_metrics(metrics)
        if rows and run.tokens is None:
            run.tokens, run.step = rows[-1].get("tokens"), run.step or rows[-1].get("step")


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
        c = (r.model or {}).get("config") or {}
        shape = f"{c['n_layer']} x {c['n_embd']}, {c['n_head']} heads" if c else DASH
        m = r.model or {}
        rows.append([r.name, r.variant or DASH, DASH if r.seed is None else r.seed, shape, c.get("block_size", DASH),
                     tokenizer_label(m), human(m.get("num_params")), human(m.get("num_params_non_embedding")), human(r.tokens),
                     DASH if r.step is None else f"{r.step:,}"])
    return ["## Runs", "", "A variant is the runs whose configs differ only in the seed (and where they were written); "
            "evaluator overrides make variants of their own. Its name is the encoding, then what sets its config "
            "apart from the variants of the same encoding.", ""] + \
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
    if training.plot(runs, f"{stem}_training.png"):
        summary.append(f"{stem}_training.png")
    for evaluator in evaluators().values():
        path = f"{stem}_{evaluator.name}.png"
        if evaluator.summary_plot and any(r.all(evaluator.name) for r in runs) and evaluator.summary_plot(runs, path):
            summary.append(path)
    listed = ", ".join(f"`{s}`" for s in sources)
    lines = [f"# {title}", "", f"Runs: {listed}. Built by `python -m eval.report` from the "
             f"saved results (`RUN/eval/*.json`); rerun an evaluator to refresh its numbers.", ""]
    sections = [runs_section(runs), training.section(runs)] + [evaluator_section(e, runs, options)
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
