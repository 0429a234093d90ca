"""
Where every head looks as prompts grow: for sampled query positions of prompts of each length, per layer
and head, the entropy of the attention distribution, the mean distance attended, and the share of the
attention mass on keys further back than the training context.

    python -m eval.attention runs/bam_ssmax_512                           # validation text, 0.5x ... 64x
    python -m eval.attention runs/alibi_ssmax_512 --prompts passkey --lengths 512,4K,32K,256K
    python -m eval.attention runs/rope_512 --rope_scaling yarn --rope_factor auto

The paper's claims (docs/paper.md §6), head by head: ALiBi heads turn local as prompts grow (a head's reach
stops at about 1 / its slope; with SSMax the prior is multiplied by s log n and steepens with the length),
BAM's heads of shape b <= 0 keep mass past the training context, and SSMax keeps the entropy flat where a
plain softmax spreads as log n.

Prompts (--prompts): `text` (the default when validation shards are found, from --data_dir or the data
the run was trained on): consecutive windows of the validation stream without its <|endoftext|>
separators, as eval.perplexity's concat source, a shorter length reading each window's beginning;
`passkey`: eval.passkey's prompts, the key at equidistant depths. --queries positions are spread evenly
over the last half of every prompt (the final position among them) and the metrics averaged over them
and the --samples prompts:

    entropy        -sum_j p_ij log p_ij in nats, a learned sink one more outcome; n keys evenly attended: log n
    mean distance  sum_j p_ij (i - j), in tokens
    far mass       sum of p_ij over the keys with i - j >= the training context: distances never trained on

Memory stays O(T) per sampled query at any length. The model runs its ordinary forward (FlexAttention
past a few thousand tokens: no T x T matrix), and a forward pre-hook on every layer's attention takes the
layer's q and k (model.Attention.project: after RoPE, keys repeated for grouped-query attention) and
scores only the sampled queries against all keys: the content score, then model.positional_scores (the
prior and SSMax's factor, the one place positions change logits) and model.py's causal and window mask,
in chunks of queries sized to a fixed budget. Document masks play no part at evaluation.

Outputs: attention.json (attention_passkey.json with passkey prompts; overrides add their suffix), one row
per length with each metric as a [layer][head] table; attention.png, per metric a heatmap of every head
(rows, grouped by layer) against the length (columns); the table on stdout.
"""

import math
import sys
import time

import numpy as np
import torch

from bam.data import EOT
from bam.ranges import number
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval
from eval.memory import plan_batch, stop_when_out_of_memory
from eval.options import EvalOptions, add_model_arguments, add_output_arguments, add_prompt_arguments
from eval.passkey import PasskeyPrompts
from eval.prompts import validation_tokens
from eval.tables import DASH, length_label, table
from eval.results import Output, evaluated_name, new_results, stopped_note
from eval.sweep import (add_length_arguments, check_length_fits, check_lengths, format_factor, format_length,
                        length_arguments, sweep, sweep_lengths)
from model import dense_mask, grid_features, layer_prior, positional_scores, sink_log_softmax

PROMPTS = ("text", "passkey")
METRICS = {"entropy": "entropy (nats)", "mean_distance": "mean distance attended (tokens)",
           "far_mass": "mass past the training context"}
SCORE_BYTES = 32 * 2**20  # fp32 logits of one chunk of sampled queries against every key


def query_positions(length, queries):
    """Up to `queries` positions spread evenly over the last half of a prompt, the last position included."""
    return np.unique(np.linspace(length // 2, length - 1, queries).round().astype(np.int64))


def attention_stats(attn, x, ctx, prior_module, positions, context):
    """(entropy, mean distance, far mass), a (3, B, heads, len(positions)) tensor, of the attention `attn` (one
    layer's model.Attention, called with x, ctx and its prior module) gives the queries at `positions`: the model's
    own logits (its sink's too), for those rows only; from `context` (the training context) on a distance is far."""
    q, k, _ = attn.project(x, ctx)
    B, H, T, head_dim = q.shape
    k = k.float().repeat_interleave(H // k.shape[1], dim=1)  # the key head each query head reads
    prior, features = layer_prior(prior_module, x, ctx)  # FIRE's positions, FoX's gates (or None)
    head = torch.arange(H, device=q.device).view(H, 1, 1)
    chunk = max(1, SCORE_BYTES // (4 * B * H * T))
    stats = []
    for start in range(0, len(positions), chunk):
        rows = torch.as_tensor(positions[start:start + chunk], device=q.device)
        q_pos = ctx.q_pos[rows]
        log_n = None if ctx.log_n is None else ctx.log_n[:, rows][:, None, :, None]
        query, key = grid_features(None if features is None else
                                   (tuple(t[..., rows] for t in features[0]), features[1]))
        with torch.autocast(q.device.type, enabled=False):  # fp32 as the model's eager scores, also under bf16
            scores = q[:, :, rows].float() @ k.transpose(-2, -1) / math.sqrt(head_dim)
            scores = positional_scores(scores, head, q_pos[:, None], ctx.k_pos[None, :], log_n, prior,
                                       attn.ssmax_scale, query, key)
        visible = dense_mask(q_pos, ctx.k_pos, ctx.window)  # (1, 1, rows, T), as the model masks this layer
        log_p, log_sink = sink_log_softmax(scores.masked_fill(~visible, float("-inf")), attn.sink_logit,
                                           attn.ssmax_scale, None if log_n is None else log_n[:, 0, :, 0])
        p, p_sink = log_p.exp(), log_sink.exp()  # a learned sink's share (model.attn_sink), at no key
        distance = (q_pos[:, None] - ctx.k_pos[None, :]).float()
        entropy = -(p * log_p.masked_fill(~visible, 0.0)).sum(dim=-1) - torch.special.xlogy(p_sink, p_sink)
        stats.append(torch.stack([entropy, (p * distance).sum(dim=-1), (p * (distance >= context)).sum(dim=-1)]))
    return torch.cat(stats, dim=-1)


def score_prompts(model, tokens, positions, context, amp):
    """attention_stats of every layer for a batch of prompts (B, T): (3, layers, B, heads, queries) on the
    CPU. One ordinary forward (logits at the last position only); each layer's pre-hook scores the
    sampled queries from the input its attention receives."""
    stats = {}

    def hook(layer):
        def record(attn, args):
            x, ctx, prior_module = args[:3]  # Attention.forward(x, ctx, prior_module, tabled_prior, kv_cache)
            stats[layer] = attention_stats(attn, x, ctx, prior_module, positions, context)
        return record

    handles = [block.attn.register_forward_pre_hook(hook(layer)) for layer, block in enumerate(model.blocks)]
    try:
        x = torch.from_numpy(np.ascontiguousarray(tokens)).to(model.lm_head.weight.device)
        with torch.no_grad(), amp:
            model(x, last_k=1)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([stats[layer] for layer in range(len(model.blocks))], dim=1).cpu()


def extra_bytes(model, length):
    """What scoring the sampled queries adds to a forward, per sequence: q, k, v once more and the keys
    repeated to every head (fp32), and the chunk of logits with its softmax temporaries."""
    return 5 * 4 * length * model.config.n_embd + 5 * SCORE_BYTES


def text_prompts(data_dir, longest, samples, enc=None):
    """`samples` consecutive windows of `longest` tokens of validation text (separators removed); `enc` is the
    run's tokenizer (GPT-2's without one)."""
    separators = enc.separators if enc is not None else (EOT,)
    tokens = validation_tokens(data_dir, int(1.1 * samples * longest) + 4096, enc.identity if enc else None)
    tokens = tokens[~np.isin(tokens, separators)]
    if len(tokens) < samples * longest:
        raise EvalError(f"the validation split in {data_dir} has {len(tokens):,} tokens of text, fewer than "
                        f"{samples} samples x {longest:,} tokens; use fewer --samples, shorter --lengths or "
                        f"--prompts passkey")
    return tokens[:samples * longest].reshape(samples, longest)


def prompt_maker(kind, data_dir, lengths, samples, seed, explicit_lengths, enc=None):
    """(kind, lengths, make(length) -> (samples, length) int64 tokens). Without a kind: text when
    validation shards are found, else passkey prompts (said on stderr)."""
    if kind in (None, "text"):
        try:
            windows = text_prompts(data_dir, max(lengths), samples, enc)
            return "text", lengths, lambda length: windows[:, :length]
        except EvalError as e:
            if kind == "text":
                raise
            print(f"attention: passkey prompts instead of validation text: {e}", file=sys.stderr)
    passkey = PasskeyPrompts(enc=enc)
    too_short = [n for n in lengths if n < passkey.min_length()]
    if too_short and explicit_lengths:
        raise EvalError(f"length {too_short[0]} is too short for a passkey prompt: "
                        f"use at least {passkey.min_length()} tokens")
    lengths = [n for n in lengths if n >= passkey.min_length()]  # a small model's 0.5x: skipped
    return "passkey", lengths, lambda length: np.stack(
        [s.tokens[:-1] for s in passkey.samples(length, samples, "equidistant", seed)])


def evaluate_attention(source, *, options=None, lengths=None, max_factor=None, prompts=None, data_dir=None,
                       samples=4, queries=16):
    """Per length: entropy, mean distance and far mass of every layer and head, averaged over `queries`
    sampled positions of `samples` prompts, for a run dir, checkpoint or model.py Transformer."""
    options = options or EvalOptions()
    seed = 0 if options.seed is None else options.seed
    batch_size = options.batch_size or 4
    if prompts not in (None, *PROMPTS):
        raise EvalError(f"unknown --prompts {prompts!r}; allowed: {', '.join(PROMPTS)}")
    if samples < 1 or queries < 1:
        raise EvalError("samples and queries must be at least 1")
    evaluated = load_for_eval(source, options)
    if not hasattr(evaluated.model, "blocks"):
        raise EvalError("eval.attention reads the attention of a model.py Transformer")
    block_size = evaluated.block_size
    explicit = lengths is not None or bool(max_factor)
    lengths = sweep_lengths(lengths, max_factor, block_size)
    check_lengths(evaluated.model, lengths, samples, evaluated.device)
    data_dir = data_dir or evaluated.info.get("data_dir")
    prompts, lengths, make_prompts = prompt_maker(prompts, data_dir, lengths, samples, seed, explicit,
                                                  evaluated.tokenizer())
    output = Output.of(EVALUATOR, source, options, "attention" if prompts == "text" else "attention_passkey")

    def measure(length, bar):
        model, per_length = evaluated.at_length(length)  # e.g. the factor of rope_factor=auto
        check_length_fits(model, length, samples, evaluated.device)
        tokens, positions = make_prompts(length), query_positions(length, queries)
        t0 = time.perf_counter()
        batch = plan_batch(model, min(batch_size, samples), length, 1, evaluated.device, extra_bytes(model, length))
        parts = []
        for i in range(0, samples, batch):
            chunk = tokens[i:i + batch]
            with stop_when_out_of_memory(f"at length {length:,} with batch {len(chunk)}", evaluated.device):
                parts.append(score_prompts(model, chunk, positions, block_size, evaluated.autocast()))
            if bar is not None:
                bar.update(len(chunk))
        per_head = torch.cat(parts, dim=2).double().mean(dim=(2, 4))  # (3, layers, heads)
        seen = [np.minimum(positions + 1, w) if w else positions + 1 for w in model.config.layer_windows]  # per layer
        uniform = np.mean([np.log(n).mean() for n in seen])  # uniform attention's entropy, over the layers
        row = {"length": length, "factor": length / block_size, "samples": samples, "queries": positions.tolist(),
               "seconds": round(time.perf_counter() - t0, 3), "uniform_entropy": float(uniform),
               **{name: per_head[i].tolist() for i, name in enumerate(METRICS)}, **per_length}
        return [row], None

    settings = evaluated.settings(lengths=lengths, prompts=prompts, samples=samples, queries=queries, seed=seed,
                                  data_dir=data_dir if prompts == "text" else None,
                                  batch_size=batch_size, block_size=block_size)
    results = new_results("attention", evaluated.info, settings, head_groups=head_groups(evaluated.model), results=[])
    return sweep(lengths, measure, results, output, work_per_length=samples, progress=options.progress)


def head_groups(model):
    """[layer][head] group names of a prior that groups its heads (BAM's shapes); None for a layer without."""
    priors = [model.prior_of_layer(layer) for layer in range(len(model.blocks))]
    groups = [[p.head_group(h) for h in range(model.config.n_head)] if p is not None and p.GROUPS else None
              for p in priors]
    return groups if any(groups) else None


# ---------------------------------------------------------------------------------------------------
# Tables and plots


def head_summary(row, metric):
    """(mean over every layer and head, the highest head) of one metric at one length."""
    values = np.asarray(row[metric], dtype=float)
    return float(values.mean()), float(values.max())


def format_value(metric, value):
    if metric == "far_mass":
        return f"{100 * value:.0f}%"
    if metric == "mean_distance":
        return format_length(int(round(value))) if value >= 1024 else f"{value:.0f}"
    return f"{value:.2f}"


def format_table(results):
    s = results["settings"]
    lines = [f"attention by prompt length: {evaluated_name(results)}, {s['samples']} {s['prompts']} prompts, "
             f"{s['queries']} queries each in their last half; mean over layers and heads (highest head)", "",
             "| length | x context | entropy | uniform | mean distance | far mass | seconds |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["results"]:
        cells = [f"{format_value(m, mean)} ({format_value(m, high)})"
                 for m, (mean, high) in ((m, head_summary(r, m)) for m in METRICS)]
        lines.append(f"| {r['length']:,} | {format_factor(r['factor'])} | {cells[0]} | {r['uniform_entropy']:.2f} | "
                     f"{cells[1]} | {cells[2]} | {r['seconds']:.1f} |")
    return "\n".join(lines + stopped_note(results))


def plot_attention(results, path):
    """Per metric, a heatmap of every head (rows, layer by layer) against the prompt length (columns)."""
    from matplotlib.colors import LogNorm

    from eval.plotting import plt, save_figure

    rows = results["results"]
    fig_rows = len(rows[0]["entropy"]) * len(rows[0]["entropy"][0]) if rows else 0
    height = min(16.0, max(3.0, 0.16 * fig_rows)) + 1.8
    width = 3 * (1.6 + 0.42 * max(len(rows), 1)) + 1.6
    fig, axes = plt.subplots(1, 3, figsize=(width, height), squeeze=False, layout="constrained")
    if not rows:
        for ax in axes[0]:
            ax.text(0.5, 0.5, "no length was evaluated", ha="center", va="center")
            ax.set_axis_off()
        save_figure(fig, path, dpi=110)
        return
    n_layer, n_head = len(rows[0]["entropy"]), len(rows[0]["entropy"][0])
    block = results["settings"]["block_size"]
    col_labels = [f"{format_length(r['length'])}\n{format_factor(r['factor'])}x" for r in rows]
    groups = results.get("head_groups")
    styles = {"entropy": dict(cmap="viridis", vmin=0.0, vmax=max(max(r["uniform_entropy"] for r in rows), 1e-3)),
              "mean_distance": dict(cmap="magma", norm=LogNorm(vmin=1.0, vmax=max(2.0, rows[-1]["length"]))),
              "far_mass": dict(cmap="viridis", vmin=0.0, vmax=1.0)}
    for ax, metric in zip(axes[0], METRICS):
        matrix = np.array([np.asarray(r[metric], dtype=float).ravel() for r in rows]).T  # (layer x head, length)
        shown = np.maximum(matrix, 1.0) if metric == "mean_distance" else matrix  # a log scale: distance ~0 as 1
        image = ax.imshow(shown, aspect="auto", interpolation="nearest", **styles[metric])
        fig.colorbar(image, ax=ax, location="bottom", shrink=0.85, pad=0.02)
        ax.set_title(METRICS[metric], fontsize=9)
        ax.set_xticks(range(len(rows)), col_labels, fontsize=7)
        for layer in range(1, n_layer):
            ax.axhline(layer * n_head - 0.5, color="white", linewidth=1.2)
        longer = [i for i, r in enumerate(rows) if r["length"] > block]
        if longer and longer[0] > 0:
            ax.axvline(longer[0] - 0.5, color="white", linestyle="--", linewidth=1.2)  # the training context
        if n_layer * n_head <= 48:
            labels = [f"L{layer} h{head}" + (f" {groups[layer][head]}" if groups and groups[layer] else "")
                      for layer in range(n_layer) for head in range(n_head)]
            ax.set_yticks(range(n_layer * n_head), labels, fontsize=6)
        else:
            ax.set_yticks([layer * n_head + n_head / 2 - 0.5 for layer in range(n_layer)],
                          [f"layer {layer}" for layer in range(n_layer)], fontsize=7)
        if n_layer * n_head * len(rows) <= 160:  # small enough to print every value
            for (r, c), value in np.ndenumerate(matrix):
                bright = image.norm(shown[r, c]) > 0.6  # the upper part of viridis and magma is light
                ax.text(c, r, format_value(metric, value).rstrip("%"), ha="center", va="center", fontsize=5.5,
                        color="black" if bright else "white")
    s = results["settings"]
    fig.suptitle(f"{evaluated_name(results)}: attention of {s['queries']} sampled queries of {s['samples']} "
                 f"{s['prompts']} prompts per length\nrows: layer and head; columns: prompt length; dashed: past "
                 f"the training context ({block:,})", fontsize=9)
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------------------------------------------
# The command line and eval.report


def add_arguments(ap):
    ap.add_argument("source", help="run directory or checkpoint file")
    ap.add_argument("--prompts", default=None, choices=PROMPTS,
                    help="validation text or passkey prompts (default: text when validation shards are found)")
    ap.add_argument("--data_dir", default=None, help="shards for the text prompts (default: the run's data_dir)")
    ap.add_argument("--samples", type=number(int, ">= 1"), default=4, help="prompts per length (default %(default)s)")
    ap.add_argument("--queries", type=number(int, ">= 1"), default=16,
                    help="query positions per prompt, spread over its last half (default %(default)s)")
    add_length_arguments(ap, stop_after_zero=False)
    add_prompt_arguments(ap, batch_size=4)
    add_model_arguments(ap)
    add_output_arguments(ap, "results file name (default: attention[_passkey][_<overrides>])")


def run(args, options):
    evaluate_attention(args.source, options=options, prompts=args.prompts, data_dir=args.data_dir,
                       samples=args.samples, queries=args.queries, **length_arguments(args))


def section(runs, report_options):
    """Per metric, a row per run and a column per length: the mean over heads (the highest head)."""
    present = [r for r in runs if r.get("attention")]
    lengths = sorted({x["length"] for r in present for x in r.get("attention")["results"]})
    kinds = " and ".join(sorted({r.get("attention")["settings"]["prompts"] for r in present}))
    lines = [f"Attention of sampled queries (evenly over the last half of each prompt; {kinds} prompts), per "
             "prompt length: the mean over every layer and head, and in brackets the highest head. Entropy in "
             "nats (spread evenly over the visible keys it would be the `uniform` row); far mass: the share on "
             "keys further back than the training context.", ""]
    for metric, title in METRICS.items():
        rows = []
        for r in present:
            cells = {x["length"]: x for x in r.get("attention")["results"]}
            rows.append([r.name] + ["{} ({})".format(*(format_value(metric, v) for v in head_summary(cells[n], metric)))
                                    if n in cells else DASH for n in lengths])
        if metric == "entropy":
            uniform = {}  # the first run's at each length: the same for every run without a window
            for x in (x for r in present for x in r.get("attention")["results"]):
                uniform.setdefault(x["length"], x["uniform_entropy"])
            rows.append(["uniform"] + [f"{uniform[n]:.2f}" for n in lengths])
        lines += [f"**{title}**", ""] + table(["run"] + [length_label(n, runs) for n in lengths], rows) + [""]
    return lines


def plot_runs(runs, path):
    """The three metrics against the length, one line per run (mean over heads, its heads' range shaded)."""
    from eval.plotting import log2_length_axis, plt, save_figure

    fig, axes = plt.subplots(1, 3, figsize=(13.0, 4.0), layout="constrained")
    colors = plt.get_cmap("tab10")
    for i, r in enumerate(runs):
        res = r.get("attention")
        if not res or not res["results"]:
            continue
        xs = [x["length"] for x in res["results"]]
        for ax, metric in zip(axes, METRICS):
            values = np.array([np.asarray(x[metric], dtype=float).ravel() for x in res["results"]])
            scale = 100 if metric == "far_mass" else 1
            ax.plot(xs, scale * values.mean(axis=1), marker="o", markersize=3, color=colors(i % 10), label=r.name)
            ax.fill_between(xs, scale * values.min(axis=1), scale * values.max(axis=1), color=colors(i % 10),
                            alpha=0.12, linewidth=0)
            if r.block_size:
                ax.axvline(r.block_size, color=colors(i % 10), linestyle=":", linewidth=1)
        axes[0].plot(xs, [x["uniform_entropy"] for x in res["results"]], color="gray", linestyle="--", linewidth=1)
    for ax, (metric, title) in zip(axes, METRICS.items()):
        log2_length_axis(ax)
        if metric == "mean_distance":
            ax.set_yscale("log")
        ax.set_title(title + (" (%)" if metric == "far_mass" else ""), fontsize=9)
        ax.set_xlabel("prompt length (tokens); dotted: training context", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[0].plot([], [], color="gray", linestyle="--", linewidth=1, label="uniform over the visible keys")
    axes[0].legend(fontsize=7)
    fig.suptitle("attention by prompt length, one line per run: mean over heads, shaded from the lowest to the "
                 "highest head", fontsize=10)
    save_figure(fig, path, dpi=120)
    return True


EVALUATOR = Evaluator(
    name="attention", title="Attention by prompt length", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=plot_attention, section=section,
    summary_plot=plot_runs, interrupted="attention: interrupted; the lengths finished so far are saved")
main = EVALUATOR.main

if __name__ == "__main__":
    EVALUATOR.cli()
