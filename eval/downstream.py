"""
Downstream tasks through lm-evaluation-harness (its Python API), on the run's own model:

    python -m eval.downstream runs/bam_ssmax_512 --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai
    python -m eval.downstream runs/bam_ssmax_512 --tasks my_task --include_path my_tasks/ --limit 100

The paper's reviewers asked for these short-context scores next to the retrieval results (docs/paper.md §7).
`ProjectLM` hands lm-eval the project model and tokenizer directly (no export needed; `export_hf.py` makes
a folder that lm-eval's own `hf` model type also loads): a choice's score is the sum of the log-probabilities
of its tokens after the context, as lm-eval's HF model computes it, with the context cut from the left to
--max_length tokens (default: the training context). Batches are right-padded, which cannot change the
logits of the tokens before the padding in a causal model.

Task data come from the Hugging Face Hub, downloaded by lm-eval (`datasets`) on first use; offline, a Hub
task fails with one line saying so, and a task of your own (a YAML file over local JSON files, passed with
--include_path) works. Outputs: RUN/eval/downstream.json (schema "downstream") and downstream.png.
"""

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from bam.ranges import number
from eval import EvalError
from eval.contract import Evaluator
from eval.loading import load_for_eval, model_device
from eval.options import EvalOptions, add_model_arguments, add_output_arguments
from eval.results import Output, new_results
from eval.sweep import progress_bar
from eval.tables import DASH, table

PAPER_TASKS = "hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai"
# The metric a task's row shows first (lm-eval reports several; all are kept in the JSON).
MAIN_METRICS = ("acc_norm", "acc", "exact_match", "word_perplexity", "perplexity")
NETWORK_HINTS = ("offline", "connection", "resolve", "network", "timed out", "couldn't reach", "max retries",
                 "name or service", "temporary failure", "hf_hub_offline", "cannot find the requested files")


HUB = ("huggingface.co", 443)


def hub_reachable(timeout=3.0):
    """Whether the Hugging Face Hub answers at all (one TCP connection, a few seconds at most)."""
    import socket

    try:
        socket.create_connection(HUB, timeout=timeout).close()
        return True
    except OSError:
        return False


def offline_if_unreachable():
    """Without a network the hub client retries every file for half a minute, printing each retry; in
    offline mode it reads the datasets cache at once, and a task whose data are not cached fails at once
    (one line, is_network_error). Must run before lm-eval imports `datasets`, which reads the setting then."""
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return
    if not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


def lm_eval_api():
    try:
        import lm_eval
        from lm_eval.api.model import LM
    except ImportError:
        raise EvalError("eval.downstream needs lm-evaluation-harness: pip install -r requirements-downstream.txt") \
            from None
    return lm_eval, LM


def make_project_lm(model, enc, max_length, batch_size, amp):
    """An lm_eval LM over a model.py Transformer and the run's tokenizer (tokenizer.Tokenizer, or tiktoken's
    GPT-2 Encoding). Where lm-eval's HF model would use the end-of-text token (an empty context, the start of
    rolling windows, padding), this uses the token every training document opens with: GPT-2's EOT, the BOS."""
    _, LM = lm_eval_api()
    doc_open = enc.doc_open
    # A BOS/EOS tokenizer's documents all start with BOS in training, so every context does here too (as
    # lm-eval's HF model adds BOS for such tokenizers); GPT-2's contexts stay bare, as they always were.
    lead = [doc_open] if enc.doc_close is not None else []

    class ProjectLM(LM):
        def __init__(self):
            super().__init__()
            self.model, self.enc, self.max_length, self.batch_size, self.amp = model, enc, max_length, batch_size, amp
            self._device = model_device(model)

        def encode_pair(self, context, continuation):
            """Tokens of context and continuation as lm-eval's HF model splits them: the whole string is
            encoded once (so a word is not split differently at the seam), a space that ends the context
            is moved to the continuation, and an empty context becomes <|endoftext|> (the BOS)."""
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if not context:
                return [doc_open], self.enc.encode_ordinary(continuation)
            whole = self.enc.encode_ordinary(context + continuation)
            n_context = len(self.enc.encode_ordinary(context))
            return lead + whole[:n_context], whole[n_context:]

        def score(self, pairs, desc):
            """[(context tokens, continuation tokens)] -> [(sum of log-probs, greedy?)], longest first in
            batches of similar length (padding stays small); the LM head runs only from the earliest
            scored position of the batch on (never the full T x vocab for long contexts)."""
            order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
            results = [None] * len(pairs)
            bar = progress_bar(len(pairs), desc)
            for b in range(0, len(order), self.batch_size):
                rows = []
                for i in order[b:b + self.batch_size]:
                    context, continuation = pairs[i]
                    if not continuation:
                        results[i] = (0.0, True)
                        continue
                    whole = (list(context) + list(continuation))[-(self.max_length + 1):]
                    rows.append((i, whole[:-1], min(len(continuation), len(whole) - 1)))
                if rows:
                    T = max(len(inp) for _, inp, _ in rows)
                    x = torch.full((len(rows), T), doc_open, dtype=torch.long)
                    for r, (_, inp, _) in enumerate(rows):
                        x[r, :len(inp)] = torch.tensor(inp)
                    keep = max(T - (len(inp) - n) for _, inp, n in rows)  # from the earliest scored position
                    with torch.no_grad(), self.amp:
                        logits, _ = self.model(x.to(self._device), last_k=keep)
                    logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
                    for r, (i, inp, n) in enumerate(rows):
                        end = len(inp) - (T - keep)  # one past the last scored position, in the kept window
                        target = torch.tensor(pairs[i][1][-n:])
                        window = logprobs[r, end - n:end]
                        results[i] = (float(window.gather(1, target[:, None]).sum()),
                                      bool((window.argmax(-1) == target).all()))
                bar.update(len(order[b:b + self.batch_size]))
            bar.close()
            return results

        def loglikelihood(self, requests, disable_tqdm=False):
            return self.score([self.encode_pair(*r.args) for r in requests], "loglikelihood")

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            pairs, owner = [], []
            for k, request in enumerate(requests):
                tokens = self.enc.encode_ordinary(request.args[0])
                for window in get_rolling_token_windows(tokens, doc_open, self.max_length, context_len=1):
                    pairs.append(make_disjoint_window(window))
                    owner.append(k)
            totals = [0.0] * len(requests)
            for k, (logprob, _) in zip(owner, self.score(pairs, "loglikelihood_rolling")):
                totals[k] += logprob
            return totals

        def generate_until(self, requests, disable_tqdm=False):
            """Greedy (or sampled, as the task asks) continuation, cut at the first stop string."""
            outputs = []
            for request in requests:
                context, kwargs = request.args
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or [self.enc.decode([self.enc.doc_close if self.enc.doc_close is not None
                                                                 else doc_open])]
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kwargs.get("max_gen_toks", 256))
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
                tokens = (lead + self.enc.encode_ordinary(context) or [doc_open])[-self.max_length:]
                x = torch.tensor([tokens], device=self._device)
                with self.amp:
                    out = self.model.generate(x, max_new, temperature=temperature)
                text = self.enc.decode(out[0, len(tokens):].tolist())
                cut = min([text.find(s) for s in until if s and s in text], default=len(text))
                outputs.append(text[:cut])
            return outputs

    return ProjectLM()


def is_network_error(exc):
    """Somewhere in the chain of causes, a failed download (the Hub unreachable, or offline mode set)."""
    seen = exc
    while seen is not None:
        name, text = type(seen).__name__.lower(), str(seen).lower()
        if "connection" in name or "offline" in name or "timeout" in name or any(h in text for h in NETWORK_HINTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def task_manager(tasks, include_path):
    """lm-eval's index of tasks, holding every one of `tasks`; an EvalError naming those it does not know,
    asked before the output folder is made (a refusal creates nothing)."""
    from lm_eval.tasks import TaskManager

    def known(manager):
        return set(manager.all_tasks) | set(getattr(manager, "all_groups", []))

    manager = None
    if include_path:  # tasks of one's own: no need to index lm-eval's ~15K built-in tasks (half a minute)
        manager = TaskManager(include_path=include_path, include_defaults=False)
        manager = manager if all(t in known(manager) for t in tasks) else None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in known(manager)]
    if unknown:
        where = f" (nor in --include_path {include_path})" if include_path else ""
        raise EvalError(f"unknown lm-eval task(s): {', '.join(unknown)}{where}; `lm-eval ls tasks` lists them")
    return manager


def run_tasks(lm, tasks, manager, num_fewshot, limit, seed):
    lm_eval, _ = lm_eval_api()
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, log_samples=False, bootstrap_iters=1000,
                                       random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                       fewshot_random_seed=seed)
    except Exception as e:
        if is_network_error(e):
            raise EvalError(f"cannot download the data of {', '.join(tasks)} (lm-eval reads them from the Hugging "
                            f"Face Hub, which is not reachable: {str(e).splitlines()[0][:160]}); run once with "
                            f"network access to fill the datasets cache, or use a local task (--include_path)") \
                from None
        raise


def task_rows(output):
    """lm-eval's {task: {"acc,none": x, "acc_stderr,none": s, ...}} -> our rows, one per task."""
    rows = []
    n_samples = output.get("n-samples", {})
    for task, values in sorted(output["results"].items()):
        metrics, stderrs = {}, {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = key.split(",")[0]
            value = None if isinstance(value, float) and math.isnan(value) else float(value)
            (stderrs if name.endswith("_stderr") else metrics)[name.removesuffix("_stderr")] = value
        main = next((m for m in MAIN_METRICS if m in metrics), next(iter(metrics), None))
        samples = n_samples.get(task, {})
        rows.append({"task": task, "metric": main, "value": metrics.get(main), "stderr": stderrs.get(main),
                     "metrics": metrics, "stderrs": stderrs,
                     "samples": samples.get("effective", samples.get("original")),
                     "num_fewshot": output.get("n-shot", {}).get(task)})
    return rows


def evaluate_downstream(source, *, options=None, tasks=PAPER_TASKS, num_fewshot=None, limit=None, max_length=None,
                        include_path=None):
    """lm-eval's scores of `tasks` (names, or one comma-separated string) for a run dir, checkpoint or model."""
    options = options or EvalOptions()
    seed = 1234 if options.seed is None else options.seed  # lm-eval's own default
    batch_size = options.batch_size or 16
    tasks = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not tasks:
        raise EvalError("no tasks given: --tasks hellaswag,arc_easy,... (comma-separated lm-eval task names)")
    if limit is not None and limit <= 0:
        raise EvalError(f"--limit must be positive, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise EvalError(f"--num_fewshot must be 0 or more, got {num_fewshot}")
    if include_path and not os.path.isdir(include_path):
        raise EvalError(f"--include_path {include_path} is not a folder")
    evaluated = load_for_eval(source, options)
    offline_if_unreachable()
    lm_eval, _ = lm_eval_api()
    max_length = max_length or evaluated.block_size or 2048
    if max_length < 2:
        raise EvalError(f"--max_length must be at least 2 tokens, got {max_length}")
    model, per_length = evaluated.at_length(max_length)  # contexts are cut to max_length tokens
    manager = task_manager(tasks, include_path)
    output = Output.of(EVALUATOR, source, options, "downstream")
    lm = make_project_lm(model, evaluated.tokenizer(), max_length, batch_size, evaluated.autocast())
    with output.undone_on_error():  # e.g. a task's data cannot be downloaded: one line, and no folder
        scores = run_tasks(lm, tasks, manager, num_fewshot, limit, seed)
    settings = evaluated.settings(tasks=tasks, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
                                  max_length=max_length, include_path=include_path, seed=seed,
                                  lm_eval=getattr(lm_eval, "__version__", None), **per_length)
    results = new_results("downstream", evaluated.info, settings, results=task_rows(scores))
    results["complete"] = True
    return output.finish(results)


def format_table(results):
    lines = [f"{'task':<24} {'metric':<16} {'value':>8} {'stderr':>8} {'samples':>8}"]
    for row in results["results"]:
        value = "-" if row["value"] is None else f"{row['value']:.4f}"
        stderr = "-" if row["stderr"] is None else f"{row['stderr']:.4f}"
        lines.append(f"{row['task']:<24} {row['metric'] or '-':<16} {value:>8} {stderr:>8} {row['samples'] or '-':>8}")
    return "\n".join(lines)


def plot_downstream(results, path):
    from eval.plotting import plt, save_figure

    rows = [r for r in results["results"] if r["value"] is not None and r["metric"] in ("acc", "acc_norm",
                                                                                             "exact_match")]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(rows)), 3.5))
    if rows:
        xs = np.arange(len(rows))
        ax.bar(xs, [100 * r["value"] for r in rows], yerr=[100 * (r["stderr"] or 0) for r in rows], capsize=3,
               color="#4c72b0")
        ax.set_xticks(xs, [f"{r['task']}\n{r['metric']}" for r in rows], fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("score (%)")
    ax.set_title(f"downstream tasks: {results['model']['name']}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def add_arguments(ap):
    ap.add_argument("source", help="run directory or checkpoint file")
    ap.add_argument("--tasks", default=PAPER_TASKS, help="comma-separated lm-eval tasks (default %(default)s)")
    ap.add_argument("--num_fewshot", type=number(int, ">= 0"), default=None, help="few-shot examples (default: each task's own)")
    ap.add_argument("--limit", type=number(float, "> 0"), default=None,
                    help="documents per task: a count, or a fraction below 1 (default: all)")
    ap.add_argument("--batch_size", type=number(int, ">= 1"), default=16, help="sequences per forward (default %(default)s)")
    ap.add_argument("--max_length", type=number(int, ">= 2"), default=None,
                    help="tokens of context kept from the left (default: the training context)")
    ap.add_argument("--include_path", default=None, help="folder with task YAML files of your own")
    ap.add_argument("--seed", type=number(int, ">= 0, < 4294967296"), default=1234, help="seed of lm-eval's few-shot sampling (default %(default)s)")
    add_model_arguments(ap)
    add_output_arguments(ap)


def run(args, options):
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    evaluate_downstream(args.source, options=options, tasks=args.tasks, num_fewshot=args.num_fewshot, limit=limit,
                        max_length=args.max_length, include_path=args.include_path)


def section(runs, report_options):
    """One row per (task, metric), one column per run."""
    present = [r.get("downstream") for r in runs if r.get("downstream")]
    cells = sorted({(x["task"], x["metric"]) for res in present for x in res["results"]})
    by_run = [{(x["task"], x["metric"]): x for x in r.get("downstream")["results"]} if r.get("downstream") else {}
              for r in runs]

    def cell(row):
        if row is None or row["value"] is None:
            return DASH
        if "perplexity" in row["metric"]:
            return f"{row['value']:.2f}"
        return f"{100 * row['value']:.1f}" + (f" ± {100 * row['stderr']:.1f}" if row.get("stderr") else "")

    shots = sorted({str(x.get("num_fewshot")) for res in present for x in res["results"]})
    lines = [f"lm-evaluation-harness scores (accuracy in %, ± its standard error; perplexities as they are); "
             f"few-shot examples: {', '.join(shots)}.", ""]
    rows = [[f"{task} ({metric})"] + [cell(scores.get((task, metric))) for scores in by_run] for task, metric in cells]
    return lines + table(["task (metric)"] + [r.name for r in runs], rows)


EVALUATOR = Evaluator(
    name="downstream", title="Downstream tasks", description=__doc__,
    add_arguments=add_arguments, run=run, table=format_table, plot=plot_downstream, section=section,
    run_plots=(("downstream tasks", ""),))
main = EVALUATOR.main

if __name__ == "__main__":
    EVALUATOR.cli()
