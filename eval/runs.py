"""The runs a report compares, each read from its folder: its results (RUN/eval/*.json, one `Run` per set of
model overrides), its resolved config (RUN/config.toml), and how far it trained (RUN/metrics.jsonl).
eval.report builds its columns from them and hands them to every evaluator's section."""

import glob
import json
import os
import sys
from dataclasses import dataclass, field

from bam.checkpoint import CONFIG, METRICS
from bam.config import ConfigError, load_config, to_dict
from eval import EvalError, evaluators
from eval.loading import output_dir
from eval.options import overrides_label, overrides_suffix
from eval.results import SCHEMA_VERSION, read_json, read_metrics


@dataclass
class Run:
    """One column of the report: a run's results under one set of model overrides ({} = as trained)."""

    path: str  # as given on the command line
    folder: str  # its eval folder
    name: str  # the column's name: the run's, then ": <overrides label>"
    overrides: dict
    results: dict = field(default_factory=dict)  # {schema: {results file stem: results}}
    model: dict | None = None  # the "model" block of its results
    tokens: int | None = None  # tokens trained
    step: int | None = None
    config: dict | None = None  # the run's resolved config (RUN/config.toml as a new run reads it), if any
    variant: str = ""  # its variant's name: the runs whose configs differ only in the seed (eval.variants)
    seed: int | None = None
    metrics: str | None = None  # the run's metrics.jsonl (train.py's log), if it has one

    def all(self, schema):
        """{file stem: results} of one evaluator (passkey keeps several: passkey, passkey_given1, ...)."""
        return self.results.get(schema, {})

    def get(self, schema):
        """The results of one evaluator: the file named after it, else the first; None without any."""
        found = self.all(schema)
        return found.get(schema, next(iter(found.values()), None))

    @property
    def model_config(self):
        """The run's model config: the one its results recorded, else its config.toml's [model] (a run kept
        without results: one the divergence guard stopped); {} with neither."""
        return (self.model or {}).get("config") or (self.config or {}).get("model") or {}

    @property
    def block_size(self):
        return self.model_config.get("block_size")

    @property
    def pretraining_context(self):
        """The context a length is a multiple of: for a model extended with a RoPE scaling, the one it was
        pretrained at (rope_original_context; a YaRN fine-tune from 128 to 512 tokens asked at 1,024 is at
        8x), else its block_size: model.ModelConfig.rope_context's rule, on its model config."""
        return self.model_config.get("rope_original_context") or self.model_config.get("block_size")

    @property
    def divergence(self):
        """(step, why) where train.py's divergence guard stopped the run (the last row of its metrics.jsonl
        says so, see recovery.diverged), or None for a run that did not diverge or has no metrics.jsonl."""
        rows = read_metrics(self.metrics) if self.metrics else []
        last = rows[-1] if rows else {}
        return (last["step"], last["diverged"]) if "diverged" in last else None

    def plot_path(self, schema, suffix=""):
        """<results file stem><suffix>.png of the main results of `schema`, or None."""
        results = self.get(schema)
        return os.path.splitext(results["_file"])[0] + suffix + ".png" if results else None


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
    columns = {}
    for file, results in results_files(folder):
        overrides = results.get("settings", {}).get("model_overrides") or {}
        run = columns.setdefault(json.dumps(overrides, sort_keys=True), Run(path, folder, name, overrides))
        stem = os.path.splitext(os.path.basename(file))[0]
        suffix = overrides_suffix(overrides)
        if suffix and stem.endswith("_" + suffix):  # passkey_yarn_x16 sits in the table of passkey
            stem = stem[:-len(suffix) - 1]
        run.results.setdefault(results["schema"], {})[stem] = results
        run.model = run.model or results.get("model")
    runs = [columns.pop(json.dumps({}), None)] + [columns[k] for k in sorted(columns)]
    runs = [r for r in runs if r] or [Run(path, folder, name, {})]
    config = run_config(path)
    for run in runs:
        run.config = config
        if run.overrides:
            run.name = f"{name}: {overrides_label(run.model_config, run.overrides)}"
        add_training_state(run, path)
    if not any(r.results for r in runs):
        stop = runs[0].divergence
        if stop:  # nothing to evaluate: the report's training section shows where it stopped
            print(f"report: {path} diverged at step {stop[0]}; it is in the training section only",
                  file=sys.stderr)
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
            print(f"report: skipping {file}: schema version {results.get('schema_version')}, this report "
                  f"reads {SCHEMA_VERSION}", file=sys.stderr)
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
