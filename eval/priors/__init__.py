"""
The learned positional priors of a model with an additive prior (ALiBi, BAM, KERPLE, any in
model.PRIORS) or SSMax: what each head ended up preferring, and how it got there.

    python -m eval.priors runs/bam_ssmax_512
    python -m eval.priors runs/bam_ssmax_512/checkpoints/step_00020000.pt --max_distance 256K

For every layer and head, the prior's logit bias g(d) against the distance d = i - j (log axis, 1 to
the longest evaluated length), computed with each prior module's own bias function (model.py); a table
of every head's parameters as the prior names them (BAM: shape b, log-scale a, scale, location mu;
KERPLE: r1, r2; ALiBi: its slope; T5: its bucket biases at distances 0, 1 and past the last bucket; FIRE:
c and the threshold L, with its curve drawn from the query at position d to a document's first token; FoX:
its gate bias and weight norm, and, on the run's validation text, the quantiles of each head's forget gates
and its memory -1 / mean(log f) in tokens, in priors_gates.png) and SSMax scale s; for BAM, the paper's three groups of shapes
(docs/paper.md §2): local (b > 0), retrieval (-0.6 <= b <= 0) and aggressive retrieval (b < -0.6); and, from
RUN/metrics.jsonl, how those parameters moved during training.

The bias shown is the prior alone. With SSMax the whole logit, prior included, is then multiplied by
s * log n (n = the number of keys the query sees), which sharpens every head alike as the context grows.

Outputs: priors.json, priors.png (bias curves), priors_shapes.png (BAM: shape histogram and shape against
scale; otherwise a histogram of each learned parameter) and priors_training.png (parameters against
training step) in RUN/eval. NoPE, RoPE and sinusoidal models have no prior; without SSMax there is
nothing to show and the command says so and exits 0.

The evaluator is a package: this file reads the priors and writes the results, eval/priors/plots.py draws
the figures, eval/priors/section.py is its section of eval.report, and __main__.py runs the command.
"""
import glob
import math
import os
from dataclasses import replace

import numpy as np
import torch

from bam import outputs
from bam.checkpoint import is_sharded
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval, output_dir
from eval.options import EvalOptions, add_output_arguments
from eval.priors.plots import (group_colors, plot_curves, plot_gates, plot_shapes, plot_shapes_in_training,
                               plot_training)
from eval.priors.section import section
from eval.prompts import validation_tokens
from eval.results import SCHEMA_VERSION, lock_results, read_json, read_metrics, writable_folder, write_json
from eval.sweep import parse_length


def head_table(model):
    """One row per (layer, head) with every positional parameter that head has, as each prior module
    names them (`head_parameters`), its group if the prior defines groups, and its SSMax scale. A layer with
    neither (a layer_pattern's RoPE or NoPE layer) has no rows."""
    cfg = model.config
    rows = []
    for layer in range(cfg.n_layer):
        prior, ssmax = model.prior_of_layer(layer), model.blocks[layer].attn.ssmax_scale
        if prior is None and ssmax is None:
            continue
        columns = prior.head_parameters() if prior is not None else {}
        for head in range(cfg.n_head):
            row = {"layer": layer, "head": head, **{name: values[head] for name, values in columns.items()}}
            if prior is not None and prior.GROUPS:
                row["group"] = prior.head_group(head)
            if ssmax is not None:
                row["ssmax_scale"] = float(ssmax[head].detach())
            rows.append(row)
    return rows


def first_layers(model):
    """{layer: the first layer of its prior module} for every layer with a prior: the curves (bias_curves) are
    drawn once per module, at that layer."""
    first = {}
    for layer, index in enumerate(model.prior_index):
        if index is not None:
            first.setdefault(index, layer)
    return {layer: first[index] for layer, index in enumerate(model.prior_index) if index is not None}


def grouping_prior(model):
    """The class of the first prior that groups its heads (BAM), else of the first prior, else None."""
    kinds = [type(p) for p in model.priors]
    return next((k for k in kinds if k.GROUPS), kinds[0] if kinds else None)


def distances(max_distance, points=256):
    return np.unique(np.round(np.logspace(0, math.log10(max(max_distance, 2)), points)))


def bias_curves(model, dist):
    """{layer: (n_head, len(dist)) bias} from each prior module's own bias function (ggd_bias, t5_bias, ...;
    FIRE's as seen from the query at position d of a document's first token), keyed by the first layer of the
    module (first_layers); empty for a prior that is not a function of the distance (FoX: see
    gate_statistics)."""
    d = torch.tensor(dist, dtype=torch.float32)[None, :]
    head = torch.arange(model.config.n_head)[:, None]
    curves = {}
    with torch.no_grad():
        for layer in sorted(set(first_layers(model).values())):
            curve = model.prior_of_layer(layer).distance_curve(d, head)
            if curve is not None:
                curves[layer] = curve.float().numpy()
    return curves


GATE_TOKENS = 8  # x block_size validation tokens through the model for FoX's gate statistics


def gate_statistics(model, tokens):
    """FoX: every layer's forget gates f = sigmoid(w_h . x + b_h) on `tokens` (B, T), per (layer, head): the
    10/50/90% quantiles of f and the head's memory -1 / mean(log f), the distance in tokens over which its
    product of gates falls by a factor e. {layer: (n_head, gates)} of the gates as well, for the plot."""
    gates, rows = {}, {}

    def hook(layer):
        def record(attn, args):
            f = model.prior_of_layer(layer).log_gates(args[0]).exp()  # (B, H, T)
            gates[layer] = f.transpose(0, 1).reshape(f.shape[1], -1)
        return record

    handles = [b.attn.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.blocks)
               if hasattr(model.prior_of_layer(i), "log_gates")]  # the layers with FoX's gates
    try:
        with torch.no_grad():
            model(torch.as_tensor(tokens), last_k=1)
    finally:
        for handle in handles:
            handle.remove()
    for layer, f in gates.items():
        q = torch.quantile(f.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64), dim=1)
        memory = -1.0 / f.double().clamp(min=1e-12).log().mean(dim=1)
        for head in range(f.shape[0]):
            rows[(layer, head)] = {"gate_p10": float(q[0, head]), "gate_median": float(q[1, head]),
                                   "gate_p90": float(q[2, head]), "memory": float(memory[head])}
    return rows, {layer: f.numpy() for layer, f in gates.items()}


def fox_gates(model, data_dir, verbose):
    """gate_statistics on the run's validation text, or (None, None) with a note where there is none."""
    if not any(hasattr(prior, "log_gates") for prior in model.priors):
        return None, None
    T = model.config.block_size
    try:
        tokens = validation_tokens(data_dir, max_tokens=GATE_TOKENS * T)
    except EvalError as e:
        if verbose:
            print(f"priors: no gate statistics ({e})")
        return None, None
    rows = len(tokens) // T
    return gate_statistics(model, tokens[:rows * T].reshape(rows, T)) if rows else (None, None)


def training_history(metrics_path):
    """[(step, prior dict)] from metrics.jsonl rows that logged the prior."""
    if not (metrics_path and os.path.isfile(metrics_path)):
        return []
    return [(row["step"], row["prior"]) for row in read_metrics(metrics_path) if row.get("prior") and "step" in row]


def metrics_file(source):
    if not isinstance(source, str):
        return None
    run = source if os.path.isdir(source) and not is_sharded(source) else \
        os.path.dirname(os.path.dirname(os.path.abspath(source)))
    path = os.path.join(run, "metrics.jsonl")
    return path if os.path.isfile(path) else None


def longest_evaluated(folder):
    lengths = []
    for path in glob.glob(os.path.join(folder, "*.json")):
        try:
            results = read_json(path)
            lengths += [r["length"] for r in results.get("results", []) if isinstance(r, dict) and "length" in r]
            lengths += [results["settings"]["length"]] if results.get("schema") == "perplexity" else []
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not one of our results files; the default distance does without it
    return max(lengths, default=None)


def evaluate_priors(source, *, options=None, max_distance=None, metrics=None, data_dir=None):
    """The priors of a run dir, checkpoint or model object (on the CPU: nothing here needs more); `data_dir`
    (default: the run's) gives FoX's gate statistics their validation text."""
    options = options or EvalOptions()
    verbose, out = options.verbose, options.out
    evaluated = load_for_eval(source, replace(options, device="cpu"))
    model, info = evaluated.model, evaluated.info
    cfg = model.config
    has_prior = len(model.priors) > 0
    ssmax = any(block.attn.ssmax_scale is not None for block in model.blocks)  # in some layer
    if not has_prior and not ssmax:
        if verbose:
            print(f"priors: {info['name']} uses {cfg.encoding_label} without SSMax: it has no learned positional "
                  f"prior to show")
        return None
    if isinstance(max_distance, str):  # read before anything is created
        max_distance = parse_length(max_distance, cfg.block_size)
    folder = output_dir(source, out) if (out or isinstance(source, str)) else None
    if folder:
        writable_folder(folder)
        lock_results(folder, "priors", "priors")  # also removes a killed run's priors.json.tmp-PID
        outputs.remove_stale(folder, "priors_*.png.tmp-*")
    if max_distance is None:
        max_distance = (folder and longest_evaluated(folder)) or 500 * cfg.block_size
    rows = head_table(model)
    prior_groups = grouping_prior(model).GROUPS if has_prior else {}
    groups = {g: sum(r.get("group") == g for r in rows) for g in prior_groups} or None
    dist = distances(max_distance)
    curves = bias_curves(model, dist) if has_prior else {}
    gate_rows, gates = fox_gates(model, data_dir or info.get("data_dir"), verbose) if has_prior else (None, None)
    for row in rows:
        row.update((gate_rows or {}).get((row["layer"], row["head"]), {}))
    decades = [d for d in (1, 10, 100, 1000, 10_000, 100_000, 1_000_000) if d <= max_distance]
    first = first_layers(model)
    for row in rows:
        if first.get(row["layer"]) in curves:
            curve = curves[first[row["layer"]]][row["head"]]
            row["bias_at"] = {str(d): float(np.interp(d, dist, curve)) for d in decades}
    history = training_history(metrics or metrics_file(source))
    results = {"schema": "priors", "schema_version": SCHEMA_VERSION, "model": info,
               "settings": {"max_distance": int(max_distance), "metrics": metrics or metrics_file(source)},
               "pe": cfg.pe, "layer_pattern": cfg.layer_pattern, "ssmax": ssmax,
               "shared_across_layers": len(model.priors) == 1 and model.prior_index.count(0) > 1,
               "groups": groups, "group_rules": prior_groups or None, "heads": rows,
               "training_rows": len(history)}
    written, failed = [], None
    if folder:
        try:
            write_files(results, model, folder, dist, curves, history, written, gates)
        except OSError as e:
            failed = e
    if verbose or failed:
        print(format_table(results))
    if failed:
        raise EvalError(f"{failed} (the table above has the priors; written before the failure: "
                        f"{', '.join(written) or 'nothing'})")
    if verbose and folder:
        print(f"wrote {', '.join(written)} in {folder}")
    if folder:
        outputs.unlock(os.path.join(folder, ".priors.lock"))
    return results


def write_files(results, model, folder, dist, curves, history, written, gates=None):
    """priors.json and the plots; `written` collects the names of the files done."""
    write_json(os.path.join(folder, "priors.json"), results)
    written.append("priors.json")
    prior_cls, colors = grouping_prior(model), group_colors(model)
    if curves:
        plot_curves(results, dist, curves, os.path.join(folder, "priors.png"), colors)
        written.append("priors.png")
    if any(k not in ("layer", "head", "group", "bias_at", "slope") for r in results["heads"] for k in r):  # learned
        plot_shapes(results, os.path.join(folder, "priors_shapes.png"), prior_cls, colors)
        written.append("priors_shapes.png")
    if history:
        plot_training(results, history, os.path.join(folder, "priors_training.png"), prior_cls)
        written.append("priors_training.png")
    if gates:
        plot_gates(results, gates, os.path.join(folder, "priors_gates.png"))
        written.append("priors_gates.png")


def format_table(results):
    pattern = results.get("layer_pattern")  # absent in results written before patterns
    encoding = (f"layer_pattern={pattern!r}" if pattern else
                "pe=" + results["pe"] + (" + ssmax" if results["ssmax"] else ""))
    lines = [f"positional priors: {results['model']['name']} ({encoding}"
             + (", one prior shared by all layers" if results["shared_across_layers"] else "") + ")"]
    if results["groups"]:
        total = sum(results["groups"].values())
        counts = [f"{g} ({results['group_rules'][g]}) {n}/{total}" for g, n in results["groups"].items()]
        lines.append("head groups: " + ", ".join(counts))
    # every column some layer has (a layer_pattern's layers may differ: BAM's shapes, SSMax's scale alone)
    columns = list(dict.fromkeys(c for r in results["heads"] for c in r if c not in ("layer", "head", "bias_at")))
    lines += ["", "| layer | head | " + " | ".join(columns) + " |", "|---:|---:|" + "---:|" * len(columns)]
    for r in results["heads"]:
        cells = ["-" if c not in r else r[c] if isinstance(r[c], str) else f"{r[c]:.4g}" for c in columns]
        lines.append(f"| {r['layer']} | {r['head']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(ap):
    ap.add_argument("source", help="run directory or checkpoint file")
    ap.add_argument("--max_distance", default=None,
                    help="longest distance plotted, e.g. 256K or 500x (default: the longest evaluated length "
                         "in the eval folder, else 500x the training context)")
    ap.add_argument("--metrics", default=None, help="metrics.jsonl for the training plot (default: the run's)")
    ap.add_argument("--data_dir", default=None,
                    help="validation shards for FoX's gate statistics (default: the run's data folder)")
    add_output_arguments(ap)


def run(args, options):
    if args.metrics and not os.path.isfile(args.metrics):
        raise EvalError(f"--metrics {args.metrics} is not a file (give a run's metrics.jsonl)")
    evaluate_priors(args.source, options=options, max_distance=args.max_distance, metrics=args.metrics,
                    data_dir=args.data_dir)


EVALUATOR = Evaluator(
    name="priors", title="Learned priors", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=None, section=section,
    summary_plot=plot_shapes_in_training,
    run_plots=(("prior per head", ""), ("prior shapes", "_shapes"), ("priors during training", "_training"),
               ("forget gates", "_gates")))
main = EVALUATOR.main
