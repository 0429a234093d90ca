"""The record of a run: the plan (sections of cases, each with its expected seconds), the budget that follows
from it, every case's outcome written out after every case (gpu_check.md, gpu_check.json and the logs' archive),
and the exit status that sums it up (EXIT_STATUSES)."""

import dataclasses
import gc
import io
import json
import logging
import os
import signal
import tarfile
import time
import traceback
from contextlib import contextmanager
from typing import Callable

import torch

from bam.outputs import write_bytes, write_text

# What the command's exit status means (docs/benchmarks.md, "GPU check"; tests/test_gpu_check.py holds each).
EXIT_PASSED = 0  # every planned case ran and passed, and every planned target was measured and met
EXIT_FAILED = 1  # a case failed or a target was measured and not met (what also went unmeasured is listed too)
EXIT_USAGE = 2  # the command line was wrong: nothing ran
EXIT_NOT_MEASURED = 3  # nothing failed, but a planned case was skipped or stopped, or a target has no measurement
EXIT_PREFLIGHT = 4  # the preflight found a problem (one line each, with its fix): nothing ran
EXIT_STATUSES = {EXIT_PASSED: "every planned case passed and every target was measured and met",
                 EXIT_FAILED: "a case failed or a target was not met",
                 EXIT_USAGE: "the command line was wrong; nothing ran",
                 EXIT_NOT_MEASURED: "nothing failed, but something planned was not measured",
                 EXIT_PREFLIGHT: "the preflight found a problem; nothing ran"}

REPORT_FILES = ("gpu_check.md", "gpu_check.json", "gpu_check_logs.tar.gz")  # all the output folder holds
ARCHIVED = (".log", ".jsonl", ".toml", ".json", ".txt")  # what the logs' archive takes from the work folder
ARCHIVE_MEMBER_BYTES = 4 * 2**20  # a longer log keeps its last 4 MiB: the archive stays one file a GPU run sends back


def now():
    return time.perf_counter()


class CaseTimeout(Exception):
    """A case ran past its time limit and was stopped."""


class Skip(Exception):
    """Raised by a case that cannot run because what it needs did not happen (the reason is its message)."""


@dataclasses.dataclass
class Case:
    """One measurement: `run()` returns a dict of numbers, with "ok": False where the case failed its check.
    `expected_s` is its time on one H100/H200 (on the CPU with --quick): the budget is their sum, a case is
    skipped when it no longer fits, and stopped past twice its time (at least 30 s more). `targets`: the names
    of the acceptance targets it measures (Report.target), each "not measured" if the case does not record it.
    `opt_in`: run only with --all (another case covers its code path; it measures more)."""
    name: str
    expected_s: float
    run: Callable[[], dict]
    targets: tuple = ()
    opt_in: bool = False


@dataclasses.dataclass
class Section:
    """A part of the run: `plan(s)` lists its cases (nothing runs until a case's run() is called), `around(s)`
    (a context manager, or None) holds what its cases share (a process group, a float32 matmul precision).
    `default`: in the acceptance run."""
    name: str
    plan: Callable
    default: bool
    what: str = ""
    around: Callable = None


def case_limit(expected_s):
    return max(2 * expected_s, expected_s + 30)


class Report:
    def __init__(self, out_dir, work_dir, env, plan, budget_s, judged=True):
        """`plan`: [(Section, [Case])] in the order they run; `budget_s` the whole run's (None: no limit),
        split over the sections in proportion to their planned seconds. `judged`: whether the targets are
        judged here (not on a CPU, whose numbers mean nothing)."""
        self.out_dir, self.work_dir, self.env, self.judged = out_dir, work_dir, env, judged
        self.plan = [(section.name, cases) for section, cases in plan]
        self.planned = {section: sum(c.expected_s for c in cases) for section, cases in self.plan}
        self.planned_targets = [t for _, cases in self.plan for c in cases for t in c.targets]
        self.cases, self.targets, self.sections = [], [], {}
        self.start, self.budget_s = now(), budget_s
        self.deadline = self.case_end = None
        self.section = None
        self.refused = None  # the preflight's problems, when it stopped the run
        self._archived = None

    @property
    def end(self):
        return None if self.budget_s is None else self.start + self.budget_s

    def begin_section(self, name):
        # Deadlines add up from the start, so time a section leaves unused passes on to the next one.
        total = sum(self.planned.values())
        before = sum(self.planned[s] for s in self.sections)
        scale = None if self.end is None else self.budget_s / max(total, 1e-9)
        self.deadline = None if scale is None else self.start + (before + self.planned[name]) * scale
        self.sections[name] = {"started_s": round(now() - self.start, 1), "budget_s": round(self.planned[name])}
        self.section = name
        print(f"\n== {name}", flush=True)

    def end_section(self):
        info = self.sections[self.section]
        info["seconds"] = round(now() - self.start - info["started_s"], 1)
        self.write()

    def fits(self, expected_s):
        return self.deadline is None or now() + expected_s <= self.deadline

    def seconds_left(self):
        """What the running case has left before it is stopped (None: no limit)."""
        return None if self.case_end is None else max(0.0, self.case_end - now())

    def run(self, case):
        """Run one case. Any exception fails this case only; running past its time limit stops it."""
        if not self.fits(case.expected_s):
            self.add(case.name, "skipped", {"reason": f"time budget (expects ~{case.expected_s:.0f} s)"})
            return
        t0 = now()
        if self.end is not None:
            self.case_end = min(t0 + case_limit(case.expected_s), self.end)
        counts = compile_counts()
        try:
            with time_limit(self.seconds_left()):
                detail = case.run()
            status = "pass" if detail.pop("ok", True) else "fail"
        except Skip as reason:
            detail, status = {"reason": str(reason)}, "skipped"
        except CaseTimeout as exc:
            detail, status = {"error": one_line(exc)}, "stopped"
        except Exception as exc:  # the point of the script: record it and go on
            self.keep_traceback(case.name)
            detail, status = {"error": one_line(exc)}, "fail"
        finally:
            self.case_end = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        detail["seconds"] = round(now() - t0, 2)
        for key, value in compile_counts(since=counts).items():
            detail.setdefault(key, value)
        self.add(case.name, status, detail)

    def keep_traceback(self, name):
        """The traceback to the console and to tracebacks.log (in the logs' archive): the report has one line."""
        text = traceback.format_exc()
        print(text, end="", flush=True)
        if self.work_dir:
            with open(os.path.join(self.work_dir, "tracebacks.log"), "a") as f:
                f.write(f"== {self.section}: {name}\n{text}\n")

    def add(self, name, status, detail):
        self.cases.append({"section": self.section, "name": name, "status": status, **detail})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in detail.items())
        print(f"{status.upper():7} {name}: {shown}", flush=True)
        self.write()

    def target(self, name, value, goal, met):
        """An acceptance target measured: `met` True, False, or None where it is not judged (a CPU)."""
        self.targets.append({"target": name, "measured": value, "goal": goal,
                             "met": met if self.judged else None})

    # ---- what the run comes to

    def not_measured(self):
        """What was planned and has no measurement: cases not run (or skipped, or stopped), targets with none."""
        seen = {(c["section"], c["name"]): c for c in self.cases}
        missing = []
        for section, cases in self.plan:
            for case in cases:
                record = seen.get((section, case.name))
                if record is None:
                    missing.append(f"{case.name} (not reached)")
                elif record["status"] in ("skipped", "stopped"):
                    missing.append(f"{case.name} ({record['status']}: {record.get('reason') or record.get('error')})")
        recorded = {t["target"]: t for t in self.targets}
        for name in self.planned_targets:
            if name not in recorded:
                missing.append(f"target: {name} (its case did not measure it)")
            elif self.judged and recorded[name]["met"] is None:
                missing.append(f"target: {name} (measured {_fmt(recorded[name]['measured'])}, not judged)")
        return missing

    def failed(self):
        return [c["name"] for c in self.cases if c["status"] == "fail"] + \
            [f"target: {t['target']}" for t in self.targets if t["met"] is False]

    def exit_status(self):
        if self.refused:
            return EXIT_PREFLIGHT
        return EXIT_FAILED if self.failed() else EXIT_NOT_MEASURED if self.not_measured() else EXIT_PASSED

    # ---- the files

    def write(self):
        status = self.exit_status()
        obj = {"env": self.env, "elapsed_s": round(now() - self.start, 1), "exit_status": status,
               "exit_meaning": EXIT_STATUSES[status], "failed": self.failed(), "not_measured": self.not_measured(),
               "sections": self.sections, "targets": self.targets, "cases": self.cases,
               "plan": [{"section": section, "name": c.name, "expected_s": c.expected_s, "targets": list(c.targets)}
                        for section, cases in self.plan for c in cases]}
        write_text(os.path.join(self.out_dir, "gpu_check.json"), json.dumps(obj, indent=1, default=str))
        write_text(os.path.join(self.out_dir, "gpu_check.md"), markdown(obj))
        self.archive_logs()

    def archive_logs(self):
        """The work folder's logs (train.py's, its metrics.jsonl and config, the tracebacks) as one .tar.gz in the
        output folder, rewritten when they changed; shards and checkpoints are left out."""
        if not self.work_dir or not os.path.isdir(self.work_dir):
            return
        members = []
        for folder, dirs, names in os.walk(self.work_dir):
            dirs[:] = sorted(d for d in dirs if d != "checkpoints")
            for name in sorted(names):
                path = os.path.join(folder, name)
                if name.endswith(ARCHIVED) and os.path.isfile(path):
                    stat = os.stat(path)
                    members.append((os.path.relpath(path, self.work_dir), path, stat.st_size, stat.st_mtime_ns))
        if members == self._archived:
            return
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, path, size, _ in members:
                with open(path, "rb") as f:
                    if size > ARCHIVE_MEMBER_BYTES:
                        f.seek(size - ARCHIVE_MEMBER_BYTES)
                    data = f.read(ARCHIVE_MEMBER_BYTES)
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        write_bytes(os.path.join(self.out_dir, REPORT_FILES[2]), [buffer.getvalue()])
        self._archived = members


def markdown(obj):
    env = obj["env"]
    lines = [f"# gpu_check: {env['device_name']}", "",
             f"**Exit status {obj['exit_status']}: {obj['exit_meaning']}.**", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, "
             f"{'quick (tiny shapes, numbers meaningless)' if env['quick'] else 'full'}; "
             f"bf16 peak used for MFU: {env['peak_tflops'] or 'unknown'} TFLOP/s; "
             f"{obj['elapsed_s']} s so far" + (f" of a {env['budget_s']:.0f} s budget; " if env["budget_s"] is not None
                                               else " (no budget); ") +
             f"{len(obj['failed'])} failed, {len(obj['not_measured'])} not measured.", ""]
    if obj["failed"]:
        lines += ["Failed:", ""] + [f"- {name}" for name in obj["failed"]] + [""]
    if obj["not_measured"]:
        lines += ["Not measured:", ""] + [f"- {name}" for name in obj["not_measured"]] + [""]
    if env.get("preflight"):
        lines += ["Preflight:", ""] + [f"- {line}" for line in env["preflight"]] + [""]
    if env.get("notes"):
        lines += [f"- {note}" for note in env["notes"]] + [""]
    if obj["targets"]:
        lines += ["## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        for t in obj["targets"]:
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {_fmt(t['measured'])} | {t['goal']} | {met} |")
        lines.append("")
    for section, info in obj["sections"].items():
        cases = [c for c in obj["cases"] if c["section"] == section]
        keys = []
        for c in cases:
            keys += [k for k in c if k not in ("section", "name", "status") and k not in keys]
        lines += [f"## {section} ({info.get('seconds', '…')} s of a {info['budget_s']} s budget)", "",
                  "| case | status | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for c in cases:
            status = c["status"] if c["status"] != "fail" else "**FAIL**"
            lines.append(f"| {c['name']} | {status} | " + " | ".join(_fmt(c.get(k, "")) for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v).replace("|", "/").replace("\n", " ")


def one_line(exc):
    """An exception as one line: its type and the first line of its message (dynamo's run on for pages)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")


@contextmanager
def time_limit(seconds):
    """Raise CaseTimeout in this (the main) thread once `seconds` have passed; None: no limit. A compilation
    or a kernel is interrupted where it returns to Python, which is where torch spends its waiting."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise CaseTimeout(f"stopped at its time limit of {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RecompileCounter(logging.Handler):
    """Counts dynamo's recompile messages (the TORCH_LOGS=recompiles artifact), one per recompilation."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += 1


RECOMPILES = RecompileCounter()


def compile_counts(since=None):
    """Dynamo's compilations so far in this process: graphs compiled (recompilations included), recompiles,
    graph breaks; with `since` (an earlier call's result), those in between."""
    from torch._dynamo.utils import counters
    counts = {"compiled_graphs": counters["stats"]["unique_graphs"], "recompiles": RECOMPILES.count,
              "graph_breaks": sum(counters["graph_break"].values())}
    if since is None:
        return counts
    return {key: max(0, value - since[key]) for key, value in counts.items()}


@contextmanager
def counting_recompiles():
    """Dynamo logs a recompile (with its reason, on stderr) only while the recompiles artifact is on: it is
    turned on here unless TORCH_LOGS sets the logs (then it should name recompiles for the count), and
    counted."""
    try:
        from torch._dynamo.guards import recompiles_log as log
    except ImportError:  # a torch whose dynamo moved it: the count stays 0, which the report's notes say
        yield False
        return
    own = "TORCH_LOGS" not in os.environ
    if own:
        torch._logging.set_logs(recompiles=True)
    log.addHandler(RECOMPILES)
    try:
        yield True
    finally:
        log.removeHandler(RECOMPILES)
        if own:
            torch._logging.set_logs()
