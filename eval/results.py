"""Results files: RUN/eval/<name>.json and its .png, written atomically as results come in, so that an
interruption, a length that does not fit in memory or a full disk loses nothing that was measured.

Every file has `schema` (the evaluator's name), `schema_version`, `model` (eval.loading.describe_model),
`settings` (with `model_overrides`) and the evaluator's own keys; eval.report reads only these files.
"""

import glob
import json
import os
import sys
from contextlib import contextmanager

import numpy as np

from bam import outputs
from bam.cli import WriteError, describe_os_error, os_reason
from bam.outputs import check_writable, write_text
from eval import EvalError
from eval.loading import output_dir
from eval.options import overrides_label, results_name

SCHEMA_VERSION = 1


def new_results(schema, info, settings, **fields):
    """The results of one evaluation before anything is measured: not yet `complete`, not `stopped`."""
    return {"schema": schema, "schema_version": SCHEMA_VERSION, "model": info, "settings": settings, **fields,
            "stopped": None, "complete": False}


class Output:
    """Where one evaluation's results go: <folder>/<name>.json and <name>.png (no files without a folder),
    and the evaluator's table on stdout. The folder is checked when the Output is made, before anything is
    computed: an evaluation that runs for an hour must not find out at the end that its results have
    nowhere to go."""

    def __init__(self, evaluator, folder, name, verbose=True):
        self.evaluator, self.folder, self.name, self.verbose = evaluator, folder, name, verbose
        self.created = folder and outputs.missing_folder(folder)  # what writable_folder makes, to undo on a refusal
        self.json_path = os.path.join(writable_folder(folder), f"{name}.json") if folder else None
        self.saving = self.json_path is not None
        self.written = False  # whether a results file was written yet
        self.lock = self.json_path and lock_results(folder, name, evaluator.name)

    @contextmanager
    def undone_on_error(self):
        """For what may still refuse after the folder was checked (eval.downstream: task data that cannot be
        downloaded): an exception out of the block before any results were written leaves nothing of this
        Output behind (its lock file, the folders it created) and goes on; a refusal creates nothing."""
        try:
            yield self
        except BaseException:
            if not self.written:
                self.release()
                if self.created:
                    outputs.remove_empty_folders(self.folder, up_to=self.created)
            raise

    def release(self):
        """Let another evaluation write these results (the lock goes with the process otherwise)."""
        if self.lock:
            outputs.unlock(self.lock)
            self.lock = None

    @classmethod
    def of(cls, evaluator, source, options, default_name, overrides=None):
        """The Output an evaluator's options ask for: --out, else next to the run or checkpoint (none for a
        model object without --out); --name, else `default_name` with the overrides' suffix."""
        folder = output_dir(source, options.out) if (options.out or isinstance(source, str)) else None
        overrides = options.model_overrides if overrides is None else overrides
        return cls(evaluator, folder, options.name or results_name(default_name, overrides), options.verbose)

    def save(self, results):
        """Rewrite the results file after a length (or batch); a write that fails (a full disk) is said once
        on stderr and the evaluation goes on: what it measures is kept in memory, and `finish` tries again
        and, if that fails too, still prints the table."""
        if self.saving:
            try:
                write_json(self.json_path, results)
                self.written = True
            except OSError as e:
                print(f"{self.evaluator.name}: {e}; going on, the results are printed at the end", file=sys.stderr)
                self.saving = False

    def finish(self, results):
        """The last step: the final JSON and its PNG (when writing), and the table on stdout. When the files
        cannot be written the table is printed all the same, then the error names the file. Returns results."""
        failed = None
        if self.json_path:
            try:
                write_json(self.json_path, results)
                self.written = True
                if self.evaluator.plot:
                    self.evaluator.plot(results, os.path.join(self.folder, f"{self.name}.png"))
            except OSError as e:
                failed = e
        if self.verbose or failed:
            print(self.evaluator.table(results))
        if failed:
            self.release()
            message = str(failed) if isinstance(failed, WriteError) else describe_os_error(failed, "cannot write")
            raise EvalError(f"{message} (the results are in the table above)")
        if self.verbose and self.json_path:
            print(f"wrote {self.json_path} and {self.name}.png")
        self.release()
        return results


def lock_results(folder, name, command):
    """FOLDER/.NAME.lock while an evaluation writes NAME.json and NAME.png (outputs.lock): the same results
    written by two evaluations at once are refused (other evaluators of the run go on), and the temp files
    that a killed evaluation left (NAME.json.tmp-PID) are removed, which only the holder may do."""
    try:
        key = outputs.lock(os.path.join(folder, f".{name}.lock"), os.path.join(folder, f"{name}.json"),
                           f"eval.{command}", remove=True)
    except outputs.InUse as e:
        raise EvalError(f"{e}; wait for it, or choose another --out or --name") from None
    for suffix in (".json", ".png"):
        outputs.remove_stale(folder, f"{glob.escape(name)}{suffix}.tmp-*")
    return key


def writable_folder(folder, option="--out"):
    """Create `folder` if needed and prove that a file can be written in it; an EvalError naming `option`
    otherwise. Returns the folder."""
    try:
        check_writable(folder)
        os.makedirs(folder, exist_ok=True)  # the evaluator writes here next (check_writable leaves nothing)
        return folder
    except OSError as e:
        raise EvalError(f"{describe_os_error(e, 'cannot write results to')} (choose another folder with {option})") from None


def evaluated_name(results):
    """The model's name in an evaluator's table and plot title, with its overrides when there are any."""
    overrides = results["settings"].get("model_overrides")
    config = results["model"].get("config") or {}
    label = f" as {overrides_label(config, overrides)}" if overrides else ""
    return results["model"]["name"] + label


def stopped_note(results):
    """The line a sweep's table ends with when it stopped early ([] when it did not)."""
    stopped = results["stopped"]
    return [f"\nstopped before length {stopped['length']:,}: {stopped['reason']}"] if stopped else []


def write_json(path, obj):
    """Atomically (outputs.write_text): an interrupted run leaves the previous complete file."""
    write_text(path, json.dumps(obj, indent=1, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_metrics(path):
    """The rows of a metrics.jsonl; a line cut short (a run killed mid-write) or unreadable is skipped."""
    rows = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except OSError as e:
        print(f"skipping {path}: {os_reason(e)}", file=sys.stderr)
    return rows


def rows_by_step(path):
    """{step: that step's rows of a metrics.jsonl merged, in order}: a run resumed from a checkpoint logs that
    checkpoint's later steps again, and the later row of a step wins."""
    rows = {}
    for row in read_metrics(path):
        if isinstance(row.get("step"), int):
            rows.setdefault(row["step"], {}).update(row)
    return rows
