"""
One markdown report comparing runs, from the results their evaluators saved (nothing is re-run).

    python -m eval.report runs/bam_ssmax_512 runs/rope_512 runs/alibi_512 --out report.md

Reads RUN/eval/*.json of each run (passkey*.json, niah*.json, perplexity*.json, priors.json, downstream.json),
RUN/metrics.jsonl for the tokens trained, and writes: the runs (encoding, size, parameters, tokens), passkey
accuracy by length, NIAH scores by length and by task, perplexity at chosen positions, downstream task scores
(lm-evaluation-harness), the prior shape groups, and every
run's plots side by side (relative links, so the report can be moved together with the run folders).
Two summary plots are drawn next to the report: <name>_passkey.png and <name>_perplexity.png.
An evaluation a run does not have is shown as "—".

Results evaluated with model overrides (`--window 512`, `--rope_scaling yarn --rope_factor 16`, ...) count
as a run of their own (a row of the passkey table, a column elsewhere), named after them: "rope_512: rope + YaRN x16", "rope_512: rope-local (W=512)".
Retrieval cells give the rate, its Wilson 95% interval and the number of trials, e.g. "45 (26-66, n=20)",
so a difference between two runs can be told from noise.
"""

import glob
import json
import os
import sys

from checkpoint import write_text
from eval.common import (SCHEMA_VERSION, EvalError, Parser, binomial_interval, format_length, output_dir,
                         overrides_label, overrides_suffix, parse_length, read_json, read_metrics, run_cli,
                         save_figure, writable_folder)
from eval.perplexity import perplexity_at, plot_perplexity

DASH = "—"
KNOWN = ("passkey", "niah", "perplexity", "priors", "downstream")


def eval_folder(path):
    """A run's eval folder: RUN/eval, a checkpoint's eval/<name>/, or an eval folder given directly."""
    if not os.path.exists(path):
        raise EvalError(f"no run directory, checkpoint or eval folder at {path}")
    is_eval_folder = not os.path.isdir(os.path.join(path, "eval")) and glob.glob(os.path.join(path, "*.json"))
    if os.path.isdir(path) and is_eval_folder:
        return path
    return output_dir(path)


def run_dir_of(path):
    if os.path.isdir(path) and os.path.isdir(os.path.join(path, "checkpoints")):
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
        key = json.dumps(overrides, sort_keys=True)
        run = variants.setdefault(key, empty_run(path, folder, name, overrides))
        stem = os.path.splitext(os.path.basename(file))[0]
        suffix = overrides_suffix(overrides)
        if suffix and stem.endswith("_" + suffix):  # passkey_yarn_x16 sits in the table of passkey
            stem = stem[:-len(suffix) - 1]
        schema = results["schema"]
        if schema == "passkey":
            run["passkey"][stem] = results
        else:
            run[schema] = results
        run["model"] = run["model"] or results.get("model")
    runs = [variants.pop(json.dumps({}), None)] + [variants[k] for k in sorted(variants)]
    runs = [r for r in runs if r] or [empty_run(path, folder, name, {})]
    for run in runs:
        if run["overrides"]:
            config = (run["model"] or {}).get("config") or {}
            run["name"] = f"{name}: {overrides_label(config, run['overrides'])}"
        add_training_state(run, path)
    if not any(r[k] for r in runs for k in KNOWN):
        print(f"report: no evaluation results in {folder} (run python -m eval.passkey {path} first)", file=sys.stderr)
    return runs


def empty_run(path, folder, name, overrides):
    return {"path": path, "folder": folder, "name": name, "overrides": overrides, "passkey": {}, "niah": None,
            "perplexity": None, "priors": None, "downstream": None, "model": None, "tokens": None,
            "step": None}


def results_files(folder):
    """(path, results) of every evaluator's JSON in the folder that this report can read."""
    for file in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            results = read_json(file)
        except (OSError, ValueError):
            print(f"report: skipping {file}: not readable JSON", file=sys.stderr)
            continue
        schema = results.get("schema") if isinstance(results, dict) else None
        if schema not in KNOWN:
            continue
        if results.get("schema_version") != SCHEMA_VERSION:
            print(f"report: skipping {file}: schema version {results.get('schema_version')}, this report reads "
                  f"{SCHEMA_VERSION}", file=sys.stderr)
            continue
        results["_png"] = os.path.splitext(file)[0] + ".png"
        yield file, results


def add_training_state(run, path):
    """The step and tokens trained, from the results or else from the run's metrics.jsonl."""
    if run["model"]:
        run["step"], run["tokens"] = run["model"].get("step"), run["model"].get("tokens_seen")
    run_dir = run_dir_of(path)
    metrics = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
    if metrics and os.path.isfile(metrics):
        rows = read_metrics(metrics)
        if rows and run["tokens"] is None:
            run["tokens"], run["step"] = rows[-1].get("tokens"), run["step"] or rows[-1].get("step")


def percent(x):
    return DASH if x is None else f"{100 * x:.0f}"


def rate(successes, trials):
    """A retrieval cell: the rate in %, its Wilson 95% interval and the number of trials."""
    if not trials:
        return DASH
    low, high = binomial_interval(successes, trials)
    return f"{100 * successes / trials:.0f} ({100 * low:.0f}-{100 * high:.0f}, n={trials})"


def human(n):
    if n is None:
        return DASH
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def block_size(run):
    config = (run["model"] or {}).get("config") or {}
    return config.get("block_size")


def length_label(n, runs):
    sizes = {block_size(r) for r in runs if block_size(r)}
    return f"{n:,}" + (f" ({n / sizes.pop():.3g}x)" if len(sizes) == 1 else "")


def runs_section(runs):
    rows = []
    for r in runs:
        c = (r["model"] or {}).get("config") or {}
        encoding = overrides_label(c, r["overrides"]) if c else DASH
        shape = f"{c['n_layer']} x {c['n_embd']}, {c['n_head']} heads" if c else DASH
        m = r["model"] or {}
        rows.append([r["name"], encoding, shape, c.get("block_size", DASH), human(m.get("num_params")),
                     human(m.get("num_params_non_embedding")), human(r["tokens"]),
                     DASH if r["step"] is None else f"{r['step']:,}"])
    return ["## Runs", ""] + table(["run", "encoding", "layers x width", "training context", "parameters",
                                    "non-embedding", "tokens trained", "step"], rows)


def passkey_section(runs):
    names = sorted({name for r in runs for name in r["passkey"]}, key=lambda n: (n != "passkey", n))
    lines = ["## Passkey retrieval", ""]
    if not names:
        return lines + [f"{DASH} (no run has passkey results: `python -m eval.passkey RUN`)"]
    for name in names:
        present = [r["passkey"][name] for r in runs if name in r["passkey"]]
        s = present[0]["settings"]
        given = f", first {s['given_tokens']} key token(s) given" if s["given_tokens"] else ""
        lines += [f"**{name}** — accuracy (%) by prompt length, with its Wilson 95% interval and the number of "
                  f"prompts; {s['samples']} samples per length, {s['depth_mode']} depths{given}.", ""]
        lengths = sorted({x["length"] for res in present for x in res["results"]})
        # One row per run and one column per length, as the paper's tables: many runs stay readable.
        rows = []
        for r in (r for r in runs if name in r["passkey"]):
            cells = {x["length"]: x for x in r["passkey"][name]["results"]}
            rows.append([r["name"]] + [rate(cells[n]["correct"], cells[n]["samples"]) if n in cells else DASH
                                       for n in lengths])
        lines += table(["run"] + [length_label(n, runs) for n in lengths], rows) + [""]
    return lines


def niah_section(runs):
    lines = ["## Needle in a haystack", ""]
    present = [r for r in runs if r["niah"]]
    if not present:
        return lines + [f"{DASH} (no run has NIAH results: `python -m eval.niah RUN`)"]

    def pooled(rows):  # values retrieved / values asked, over every sample of the rows
        flags = [ok for x in rows for record in x.get("records", ()) for ok in record["retrieved"]]
        return rate(sum(flags), len(flags))

    lengths = sorted({x["length"] for r in present for x in r["niah"]["results"]})
    cells = sorted({(x["haystack"], x["task"]) for r in present for x in r["niah"]["results"]})
    results = [r["niah"]["results"] if r["niah"] else [] for r in runs]
    note = ("Wilson 95% interval and n = values asked; the values of one prompt are not independent, so the "
            "interval is somewhat too narrow for the multi-value tasks")
    lines += [f"% of values retrieved, pooled over tasks and haystacks, by length ({note}):", ""]
    lines += table(["length"] + [r["name"] for r in runs],
                   [[length_label(n, runs)] + [pooled([x for x in res if x["length"] == n]) for res in results]
                    for n in lengths])
    lines += ["", "% of values retrieved, pooled over lengths, by haystack and task:", ""]
    lines += table(["haystack / task"] + [r["name"] for r in runs],
                   [[f"{h} / {t}"] + [pooled([x for x in res if (x["haystack"], x["task"]) == (h, t)])
                                      for res in results] for h, t in cells])
    return lines


def perplexity_section(runs, positions):
    lines = ["## Perplexity by position", ""]
    present = [r for r in runs if r["perplexity"]]
    if not present:
        return lines + [f"{DASH} (no run has perplexity results: `python -m eval.perplexity RUN`)"]
    s = present[0]["perplexity"]["settings"]
    lines += [f"Perplexity of the {s['window']}-token window ending at each position ({s['source']} validation "
              f"sequences; {DASH}: not evaluated that far).", ""]
    rows = [[length_label(p, runs)] + [DASH if not r["perplexity"] or perplexity_at(r["perplexity"], p - 1) is None
                                        else f"{perplexity_at(r['perplexity'], p - 1):.2f}" for r in runs]
            for p in positions]
    return lines + table(["position"] + [r["name"] for r in runs], rows)


def downstream_section(runs):
    lines = ["## Downstream tasks", ""]
    present = [r for r in runs if r["downstream"]]
    if not present:
        return lines + [f"{DASH} (no run has downstream results: `python -m eval.downstream RUN`)"]
    cells = sorted({(x["task"], x["metric"]) for r in present for x in r["downstream"]["results"]})
    by_run = [{(x["task"], x["metric"]): x for x in r["downstream"]["results"]} if r["downstream"] else {}
              for r in runs]

    def cell(row):
        if row is None or row["value"] is None:
            return DASH
        if "perplexity" in row["metric"]:
            return f"{row['value']:.2f}"
        return f"{100 * row['value']:.1f}" + (f" ± {100 * row['stderr']:.1f}" if row.get("stderr") else "")

    shots = sorted({str(x.get("num_fewshot")) for r in present for x in r["downstream"]["results"]})
    lines += [f"lm-evaluation-harness scores (accuracy in %, ± its standard error; perplexities as they are); "
              f"few-shot examples: {', '.join(shots)}.", ""]
    rows = [[f"{task} ({metric})"] + [cell(scores.get((task, metric))) for scores in by_run] for task, metric in cells]
    return lines + table(["task (metric)"] + [r["name"] for r in runs], rows)


def priors_section(runs):
    lines = ["## Learned priors", ""]
    rows = []
    for r in runs:
        p = r["priors"]
        if not p or not p.get("groups"):
            rows.append([r["name"], DASH, DASH, DASH, DASH if not p else f"{p['pe']}: no shapes"])
            continue
        g = p["groups"]
        shapes = sorted(h["shape"] for h in p["heads"])
        rows.append([r["name"], g["local"], g["retrieval"], g["aggressive"],
                     f"{shapes[0]:.2f} / {shapes[len(shapes) // 2]:.2f} / {shapes[-1]:.2f}"])
    return lines + ["BAM heads per shape group (docs/paper.md §2): local b > 0, retrieval -0.6 <= b <= 0, "
                    "aggressive b < -0.6.", ""] + table(["run", "local", "retrieval", "aggressive",
                                                          "shape min / median / max"], rows)


def plots_section(runs, out_dir, extra, run_plots=True):
    def link(path):
        return f"![]({os.path.relpath(path, out_dir)})" if path and os.path.isfile(path) else DASH

    kinds = [("passkey", lambda r: r["passkey"].get("passkey", next(iter(r["passkey"].values()), None))),
             ("needle in a haystack", lambda r: r["niah"]), ("perplexity", lambda r: r["perplexity"]),
             ("downstream tasks", lambda r: r["downstream"]), ("prior per head", lambda r: r["priors"]),
             ("prior shapes", lambda r: r["priors"] and {"_png": os.path.join(r["folder"], "priors_shapes.png")}),
             ("priors during training",
              lambda r: r["priors"] and {"_png": os.path.join(r["folder"], "priors_training.png")})]
    rows = [[kind] + [link((get(r) or {}).get("_png")) for r in runs] for kind, get in kinds]
    lines = ["## Plots", ""]
    lines += [f"{link(path)}" for path in extra if os.path.isfile(path)] + [""]
    return lines + (table(["plot"] + [r["name"] for r in runs], rows) if run_plots else [])


def plot_passkey_lines(runs, path):
    import matplotlib.pyplot as plt

    many = len(runs) > 6  # then the legend goes to the right of the axes, where it hides no line
    # ... and the figure grows with it (about 0.15 inch per legend entry), so no entry is cut off
    fig, ax = plt.subplots(figsize=(10.0, max(4.5, 0.15 * len(runs) + 1.2)) if many else (7.5, 4.0))
    drawn = False
    for i, r in enumerate(runs):
        res = r["passkey"].get("passkey") or next(iter(r["passkey"].values()), None)
        if not res or not res["results"]:
            continue
        xs = [x["length"] for x in res["results"]]
        color = plt.get_cmap("tab10")(i % 10)
        style = ("-", "--", ":", "-.")[i // 10 % 4]  # tab10 has ten colours: more runs change the line
        ax.plot(xs, [100 * x["accuracy"] for x in res["results"]], marker="o", label=r["name"], color=color,
                linestyle=style)
        if block_size(r):
            ax.axvline(block_size(r), color=color, linestyle=":", linewidth=1)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: format_length(int(v)) if v >= 1 else ""))
    ax.set_ylim(-3, 103)
    ax.set_xlabel("prompt length (tokens); dotted: training context")
    ax.set_ylabel("passkey accuracy (%)")
    ax.set_title("passkey retrieval, one line per run", fontsize=10)
    ax.grid(True, alpha=0.3)
    if many:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return True


def write_report(sources, *, out="report.md", positions=None, title="Evaluation report", run_plots=True):
    runs = [r for s in sources for r in load_runs(s)]
    if not any(r[k] for r in runs for k in KNOWN):
        raise EvalError(f"nothing to report: no evaluation results in {', '.join(r['folder'] for r in runs)}; "
                        f"run an evaluator first (python -m eval.passkey RUN)")
    names = [r["name"] for r in runs]
    for i, r in enumerate(runs):  # two runs called "eval" or "best" must still be told apart
        if names.count(r["name"]) > 1:
            r["name"] = f"{r['name']} ({i + 1})"
    out_dir = writable_folder(os.path.dirname(os.path.abspath(out)))  # before any plot is drawn
    if os.path.isdir(out):
        raise EvalError(f"--out {out} is a directory; give the markdown file to write, e.g. {os.path.join(out, 'report.md')}")
    stem = os.path.splitext(os.path.abspath(out))[0]
    if positions is None:
        sizes = [block_size(r) for r in runs if block_size(r)]
        longest = max((r["perplexity"]["settings"]["length"] for r in runs if r["perplexity"]), default=0)
        base = min(sizes) if sizes else 512
        positions = [base * f for f in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if base * f <= max(longest, base)]
    extra = []
    if plot_passkey_lines(runs, stem + "_passkey.png"):
        extra.append(stem + "_passkey.png")
    ppl = [r["perplexity"] for r in runs if r["perplexity"]]
    if ppl:
        plot_perplexity(ppl, stem + "_perplexity.png", "perplexity by position, one line per run")
        extra.append(stem + "_perplexity.png")
    listed = ", ".join(f"`{s}`" for s in sources)
    lines = [f"# {title}", "", f"Runs: {listed}. Built by `python -m eval.report` from the "
             f"saved results (`RUN/eval/*.json`); rerun an evaluator to refresh its numbers.", ""]
    for section in (runs_section(runs), passkey_section(runs), niah_section(runs), perplexity_section(runs, positions),
                    downstream_section(runs), priors_section(runs), plots_section(runs, out_dir, extra, run_plots)):
        lines += section + [""]
    write_text(out, "\n".join(lines))
    return out


def main(argv=None):
    ap = Parser(prog="eval.report", description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("sources", nargs="+", help="run directories (or checkpoint files, or eval folders)")
    ap.add_argument("--out", default="report.md", help="markdown file to write (default %(default)s)")
    ap.add_argument("--ppl_at", default=None,
                    help="positions for the perplexity table, e.g. 512,4K,32K or 1x,8x (x = the smallest training "
                         "context among the runs; default: 1x, 2x, 4x, ... up to the longest evaluated)")
    ap.add_argument("--title", default="Evaluation report")
    ap.add_argument("--no_run_plots", action="store_true",
                    help="leave out the table of each run's own plots: for a report kept apart from the run "
                         "folders (e.g. committed under docs/), the summary plots only")
    args = ap.parse_args(argv)
    positions = None
    if args.ppl_at:
        runs = [r for s in args.sources for r in load_runs(s)]
        base = min((block_size(r) for r in runs if block_size(r)), default=512)
        positions = [parse_length(t, base) for t in args.ppl_at.split(",") if t.strip()]
    written = write_report(args.sources, out=args.out, positions=positions, title=args.title,
                           run_plots=not args.no_run_plots)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    run_cli(main)
