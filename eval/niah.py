"""
Needle in a haystack, RULER-style (Hsieh et al. 2024): the needle variants the paper reports, on a
repeated-text haystack and on real text from the validation shard.

    python -m eval.niah runs/bam_ssmax_512                              # all tasks, both haystacks
    python -m eval.niah runs/bam_ssmax_512 --tasks single_number,multikey --haystacks repeat --lengths 1K,16K

A needle is "One of the special magic numbers for {key} is: {value}." with a word-pair key
("golden-river") and a 7-digit number or a UUID as the value. Tasks:

    single_number   one needle, number value (RULER niah_single)
    single_uuid     one needle, UUID value
    multikey        the needle among 3 distractor needles with other keys (niah_multikey)
    multivalue      4 needles with the same key; all 4 values must be recalled (niah_multivalue)
    multiquery      4 needles with different keys, all 4 asked for (niah_multiquery)

RULER generates an answer and string-matches it; our models are small base LMs, so scoring is teacher-forced
as for the passkey: the answer ("The special magic number for golden-river is: 1234567") follows the
question, and a value counts as retrieved when the argmax at every one of its token positions is right.
A sample's score is the fraction of its values retrieved (RULER's recall). Needles sit at random depths
(seeded); lengths are exact and count every token the model reads, as in eval.passkey.

Haystacks: `repeat` is RULER's noise (the passkey's garbage sentences), `text` is validation text
(<|endoftext|> becomes a blank line), from --data_dir or the data_dir the checkpoint was trained on.
Outputs: niah.json, niah.png (length x task accuracy per haystack) and a table, as eval.passkey.
"""

import math
import sys
import time
import uuid

import numpy as np

from bam.ranges import number
from bam.retrieval import GARBAGE
from bam.tokenizer import GPT2, load_tokenizer
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval
from eval.options import EvalOptions, add_model_arguments, add_output_arguments, add_prompt_arguments
from eval.prompts import Haystack, encode_template, repeat_haystack, validation_tokens
from eval.results import Output, evaluated_name, new_results, stopped_note
from eval.scoring import Sample, score_length
from eval.sweep import (add_length_arguments, check_length_fits, check_lengths, format_factor, format_length,
                        length_arguments, sweep, sweep_lengths)
from eval.tables import length_label, rate, table

# (value kind, needles, of which distractors, keys asked for)
TASKS = {
    "single_number": dict(kind="number", needles=1, distractors=0, queries=1),
    "single_uuid": dict(kind="uuid", needles=1, distractors=0, queries=1),
    "multikey": dict(kind="number", needles=4, distractors=3, queries=1),
    "multivalue": dict(kind="number", needles=4, distractors=0, queries=1),
    "multiquery": dict(kind="number", needles=4, distractors=0, queries=4),
}
HAYSTACKS = ("repeat", "text")

INSTRUCTION = ("Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the {kind}s afterwards.")
NEEDLE = " One of the special magic {kind}s for {key} is: {value}."
QUESTION_ONE = " What is the special magic {kind} for {key} mentioned in the provided text?"
QUESTION_ALL = " What are all the special magic {kind}s for {key} mentioned in the provided text?"
ANSWER_ONE = " The special magic {kind} for {key} is: {value}"

ADJECTIVES = ("golden", "silent", "crimson", "brave", "hidden", "frozen", "gentle", "rapid", "ancient", "bitter",
              "clever", "distant", "eager", "fragile", "hollow", "humble", "jolly", "lively", "mighty", "noble",
              "polite", "quiet", "rustic", "shiny", "tender", "vivid", "wild", "wooden", "young", "zealous",
              "calm", "dusty", "fancy", "giant", "icy", "lucky", "proud", "royal", "sunny", "tiny")
NOUNS = ("river", "falcon", "lantern", "meadow", "harbor", "violin", "glacier", "orchard", "compass", "canyon",
         "pebble", "island", "thunder", "garden", "mirror", "forest", "engine", "feather", "castle", "planet",
         "marble", "anchor", "candle", "desert", "bridge", "blanket", "tiger", "window", "rocket", "saddle",
         "basket", "helmet", "ladder", "pepper", "tunnel", "whistle", "banner", "cactus", "dragon", "kettle")


def sentence_end_tokens(enc):
    """Ids of the tokens after which a new sentence can start: those ending in . ! ? or a newline."""
    ends = np.zeros(enc.n_vocab, dtype=bool)
    for i in range(enc.n_vocab):
        try:
            text = enc.decode_single_token_bytes(i).decode("utf-8", errors="ignore")
        except KeyError:
            continue
        ends[i] = text.rstrip(" ").endswith((".", "!", "?", "\n"))
    return ends


class NeedlePrompts:
    def __init__(self, text_stream=None, enc=None):
        self.enc = enc if enc is not None else load_tokenizer(GPT2)  # the run's; GPT-2 without one
        self.head = [self.enc.doc_open] + self.enc.encode_ordinary(INSTRUCTION.replace("{kind}", "number"))
        self.repeat = repeat_haystack(self.enc, GARBAGE, 0)
        self.text = None
        if text_stream is not None:
            if self.enc.doc_close is not None:  # [BOS] doc [EOS]: one paragraph break between documents
                text_stream = text_stream[text_stream != self.enc.doc_close]
            stream = np.where(text_stream == self.enc.doc_open, self.enc.encode_continuation("\n\n")[0], text_stream)
            self.text = (stream, sentence_end_tokens(self.enc))

    def haystack(self, name, n, rng):
        if name == "repeat":
            if len(self.repeat.tokens) < n:
                self.repeat = repeat_haystack(self.enc, GARBAGE, 2 * n)
            return self.repeat
        stream, ends = self.text
        tokens = np.take(stream, np.arange(n) + int(rng.integers(len(stream))), mode="wrap")
        return Haystack(tokens, np.concatenate([[0], np.flatnonzero(ends[tokens]) + 1]))

    def draw(self, task, rng):
        """Keys, values and which needles are asked about, for one sample."""
        spec = TASKS[task]
        n = spec["needles"]
        adjectives = rng.choice(len(ADJECTIVES), n, replace=False)
        nouns = rng.choice(len(NOUNS), n, replace=False)  # distinct last tokens: no two keys end alike
        keys = [f"{ADJECTIVES[a]}-{NOUNS[b]}" for a, b in zip(adjectives, nouns)]
        if task == "multivalue":
            keys = [keys[0]] * n
        if spec["kind"] == "uuid":
            values = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n)]
        else:
            values = [int(v) for v in rng.integers(10**6, 10**7, n)]
        return keys, values

    def build(self, task, haystack, length, rng):
        spec = TASKS[task]
        kind = spec["kind"]
        keys, values = self.draw(task, rng)
        needles = [encode_template(self.enc, NEEDLE.replace("{kind}", kind), {"key": k, "value": v})
                   for k, v in zip(keys, values)]
        depths = sorted(float(d) for d in rng.random(len(needles)))
        order = list(range(len(needles)))  # needles in the order they appear in the haystack
        if task in ("single_number", "single_uuid", "multikey"):
            asked = [0]  # needle 0 is the target, the others (multikey) distractors
            question = QUESTION_ONE.replace("{kind}", kind).replace("{key}", keys[0])
            answer, slots = encode_template(self.enc, ANSWER_ONE.replace("{kind}", kind),
                                            {"key": keys[0], "value": values[0]})
            spans = slots["value"]
        elif task == "multivalue":
            asked = order
            question = QUESTION_ALL.replace("{kind}", kind).replace("{key}", keys[0])
            template = f" The special magic {kind}s for {{key}} are: " + ", ".join(f"{{v{i}}}" for i in order)
            answer, slots = encode_template(self.enc, template, {"key": keys[0], **{f"v{i}": values[i] for i in order}})
            spans = [slots[f"v{i}"][0] for i in order]
        else:  # multiquery: the keys asked in a shuffled order, each answered in turn
            asked = [int(i) for i in rng.permutation(len(needles))]
            listed = ", ".join(keys[i] for i in asked[:-1]) + " and " + keys[asked[-1]]
            question = QUESTION_ALL.replace("{kind}", kind).replace("{key}", listed)
            one = ANSWER_ONE.replace("{kind}", kind)
            template = ".".join(one.replace("{key}", f"{{k{j}}}").replace("{value}", f"{{v{j}}}")
                                for j in range(len(asked)))
            answer, slots = encode_template(self.enc, template, {**{f"k{j}": keys[i] for j, i in enumerate(asked)},
                                                                 **{f"v{j}": values[i] for j, i in enumerate(asked)}})
            spans = [slots[f"v{j}"][0] for j in range(len(asked))]
        question = self.enc.encode_continuation(question)
        n = length + 1 - len(self.head) - sum(len(t) for t, _ in needles) - len(question) - len(answer)
        if n < 0:
            return None
        hay = self.haystack(haystack, n, rng)
        cuts = [hay.cut(d, n) for d in depths]
        pieces, start = [self.head], 0
        for cut, (needle, _) in zip(cuts, needles):
            pieces += [hay.tokens[start:cut], needle]
            start = cut
        pieces += [hay.tokens[start:n], question, answer]
        tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
        offset = len(tokens) - len(answer)
        meta = {"keys": keys, "values": values, "depths": [cut / n if n else 0.0 for cut in cuts],
                "asked": [keys[i] for i in asked]}
        return Sample(tokens, [(offset + s, offset + e) for s, e in spans], meta)


def evaluate_niah(source, *, options=None, lengths=None, max_factor=None, tasks=tuple(TASKS), haystacks=None,
                  samples=10, data_dir=None, stop_after_zero=2):
    """NIAH scores per length, haystack and task for a run dir, checkpoint file or model object; files and
    names as evaluate_passkey's. `haystacks` None: both when validation shards are found, else repeat."""
    options = options or EvalOptions()
    seed = 0 if options.seed is None else options.seed
    batch_size = options.batch_size or 8
    unknown = [t for t in tasks if t not in TASKS] + [h for h in (haystacks or ()) if h not in HAYSTACKS]
    if unknown:
        raise EvalError(f"unknown task or haystack {unknown[0]!r}; tasks: {', '.join(TASKS)}; "
                        f"haystacks: {', '.join(HAYSTACKS)}")
    if samples < 1 or stop_after_zero < 0:
        raise EvalError("samples must be at least 1, stop_after_zero at least 0")
    evaluated = load_for_eval(source, options)
    enc = evaluated.tokenizer()
    block_size = evaluated.block_size
    lengths = sweep_lengths(lengths, max_factor, block_size)
    check_lengths(evaluated.model, lengths, samples, evaluated.device)
    data_dir = data_dir or evaluated.info.get("data_dir")
    stream = None
    if haystacks is None or "text" in haystacks:
        try:
            stream = validation_tokens(data_dir, max(4 * max(lengths), 1 << 20), enc.identity)
        except EvalError as e:
            if haystacks is not None:
                raise
            print(f"niah: skipping the text haystack: {e}", file=sys.stderr)
    haystacks = list(haystacks or (HAYSTACKS if stream is not None else ("repeat",)))
    prompts = NeedlePrompts(stream, enc)
    output = Output.of(EVALUATOR, source, options, "niah")

    def measure(length, bar):
        cells = []
        model, per_length = evaluated.at_length(length)  # e.g. the factor of rope_factor=auto
        check_length_fits(model, length, samples, evaluated.device)
        for hay in haystacks:
            for task in tasks:
                if bar is not None:
                    bar.set_postfix(length=format_length(length), task=f"{hay}/{task}")
                cell = evaluate_cell(model, prompts, task, hay, length, samples, seed, batch_size,
                                     evaluated.autocast(), bar)
                cells.append({**cell, "factor": length / block_size if block_size else None, **per_length})
        scores = [c["score"] for c in cells if c["score"] is not None]
        return cells, max(scores) if scores else None

    settings = evaluated.settings(lengths=lengths, tasks=list(tasks), haystacks=haystacks, samples=samples, seed=seed,
                                  data_dir=data_dir if "text" in haystacks else None, batch_size=batch_size,
                                  stop_after_zero=stop_after_zero, block_size=block_size)
    results = new_results("niah", evaluated.info, settings, results=[])
    return sweep(lengths, measure, results, output, work_per_length=len(tasks) * len(haystacks) * samples,
                 stop_after_zero=stop_after_zero, progress=options.progress)


def evaluate_cell(model, prompts, task, haystack, length, samples, seed, batch_size, amp, bar):
    # One random stream per cell, from (seed, length, task, haystack) only: reproducible and independent
    rng = np.random.default_rng([seed, length, list(TASKS).index(task), HAYSTACKS.index(haystack)])
    built = [prompts.build(task, haystack, length, rng) for _ in range(samples)]
    cell = {"length": length, "haystack": haystack, "task": task}
    if any(s is None for s in built):
        if bar is not None:
            bar.update(samples)
        return {**cell, "score": None, "samples": 0, "skipped": "the needles, question and answer alone are longer"}
    t0 = time.perf_counter()
    scored = score_length(model, built, batch_size, amp, bar)
    records = []
    for sample, spans in zip(built, scored):
        retrieved = [ok for ok, _ in spans]
        records.append({**sample.meta, "retrieved": retrieved, "score": sum(retrieved) / len(retrieved),
                        "predicted": [prompts.enc.decode(guess) for _, guess in spans]})
    score = sum(r["score"] for r in records) / len(records)
    return {**cell, "score": score, "samples": samples, "seconds": round(time.perf_counter() - t0, 3),
            "records": records}


def score_table(results):
    """{haystack: {task: {length: score or None}}}"""
    table = {}
    for r in results["results"]:
        table.setdefault(r["haystack"], {}).setdefault(r["task"], {})[r["length"]] = r["score"]
    return table


def format_table(results):
    s = results["settings"]
    table = score_table(results)
    lengths = sorted({r["length"] for r in results["results"]})
    lines = [f"needle in a haystack: {evaluated_name(results)}, {s['samples']} samples per cell, "
             f"score = % of values retrieved"]
    for hay in s["haystacks"]:
        tasks = [t for t in s["tasks"] if t in table.get(hay, {})]
        lines += ["", f"haystack: {hay}", "", "| length | " + " | ".join(tasks) + " | mean |",
                  "|---:|" + "---:|" * (len(tasks) + 1)]
        for length in lengths:
            cells = [table[hay][t].get(length) for t in tasks]
            known = [c for c in cells if c is not None]
            mean = f"{100 * sum(known) / len(known):.0f}%" if known else "—"
            lines.append(f"| {length:,} | " + " | ".join("—" if c is None else f"{100 * c:.0f}%" for c in cells)
                         + f" | {mean} |")
    return "\n".join(lines + stopped_note(results))


def plot_niah(results, path):
    from eval.plotting import draw_heatmap, plt, save_figure

    s = results["settings"]
    table = score_table(results)
    lengths = sorted({r["length"] for r in results["results"]})
    hays = [h for h in s["haystacks"] if h in table] or s["haystacks"]
    size = (3.2 + 1.1 * len(s["tasks"]) * len(hays), max(3.0, 0.4 * len(lengths) + 2.2))
    fig, axes = plt.subplots(1, len(hays), figsize=size, squeeze=False, layout="constrained")
    block = s.get("block_size")
    row_labels = [format_length(n) + (f" ({format_factor(n / block)}x)" if block else "") for n in lengths]
    image = None
    for ax, hay in zip(axes[0], hays):
        if not lengths:
            ax.text(0.5, 0.5, "no length was evaluated", ha="center", va="center")
            ax.set_axis_off()
            continue
        matrix = [[math.nan if table.get(hay, {}).get(t, {}).get(n) is None else table[hay][t][n] for t in s["tasks"]]
                  for n in lengths]
        image = draw_heatmap(ax, matrix, row_labels, [t.replace("_", "\n") for t in s["tasks"]], "task",
                             "length (x training context)", f"haystack: {hay}")
    fig.suptitle(f"{evaluated_name(results)}: needle in a haystack, % of values retrieved "
                 f"({s['samples']} samples per cell)", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), fraction=0.03, pad=0.02)
    save_figure(fig, path, dpi=120)


def add_arguments(ap):
    ap.add_argument("source", help="run directory or checkpoint file")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, from: %(default)s")
    ap.add_argument("--haystacks", default=None,
                    help="repeat, text or repeat,text (default: both when validation shards exist)")
    ap.add_argument("--data_dir", default=None, help="shards for the text haystack (default: the run's data_dir)")
    ap.add_argument("--samples", type=number(int, ">= 1"), default=10,
                    help="prompts per length, task and haystack (default %(default)s)")
    add_length_arguments(ap)
    add_prompt_arguments(ap, batch_size=8)
    add_model_arguments(ap)
    add_output_arguments(ap, "results file name (default: niah[_<overrides>])")


def run(args, options):
    split = lambda text: [t.strip() for t in text.split(",") if t.strip()]  # noqa: E731
    evaluate_niah(args.source, options=options, tasks=split(args.tasks),
                  haystacks=split(args.haystacks) if args.haystacks else None, samples=args.samples,
                  data_dir=args.data_dir, **length_arguments(args))


def section(runs, report_options):
    """Values retrieved, pooled over tasks and haystacks by length, then over lengths by haystack and task."""
    present = [r for r in runs if r.get("niah")]

    def pooled(rows):  # values retrieved / values asked, over every sample of the rows
        flags = [ok for x in rows for record in x.get("records", ()) for ok in record["retrieved"]]
        return rate(sum(flags), len(flags))

    lengths = sorted({x["length"] for r in present for x in r.get("niah")["results"]})
    cells = sorted({(x["haystack"], x["task"]) for r in present for x in r.get("niah")["results"]})
    results = [r.get("niah")["results"] if r.get("niah") else [] for r in runs]
    note = ("Wilson 95% interval and n = values asked; the values of one prompt are not independent, so the "
            "interval is somewhat too narrow for the multi-value tasks")
    lines = [f"% of values retrieved, pooled over tasks and haystacks, by length ({note}):", ""]
    lines += table(["length"] + [r.name for r in runs],
                   [[length_label(n, runs)] + [pooled([x for x in res if x["length"] == n]) for res in results]
                    for n in lengths])
    lines += ["", "% of values retrieved, pooled over lengths, by haystack and task:", ""]
    lines += table(["haystack / task"] + [r.name for r in runs],
                   [[f"{h} / {t}"] + [pooled([x for x in res if (x["haystack"], x["task"]) == (h, t)])
                                      for res in results] for h, t in cells])
    return lines


EVALUATOR = Evaluator(
    name="niah", title="Needle in a haystack", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=plot_niah, section=section,
    run_plots=(("needle in a haystack", ""),),
    interrupted="niah: interrupted; the lengths finished so far are saved")
main = EVALUATOR.main

if __name__ == "__main__":
    EVALUATOR.cli()
