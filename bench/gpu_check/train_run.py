"""train_run: train.py itself on configs/paper/bam_ssmax_512.toml and the prepared demo corpus, in a rank that
`torchrun --standalone --nproc_per_node=1` starts: DDP for ~20 steps with validation and a checkpoint, then
--resume to 25; FSDP + activation checkpointing a few steps (plain FSDP and the FSDP resumes on request). Each
run's metrics.jsonl (losses, validation, tokens/s, MFU) and log (recompiles, graph breaks, the recompile limit)
are read back. On a GPU every run is a torchrun start of its own; --quick starts torchrun once for all of them
(a start is ~10 s of a small CPU for a second of training), each run train.main(argv) in turn in that rank.

    python -m torch.distributed.run --standalone --nproc_per_node=1 -m bench.gpu_check.train_run RUNS.json

is that rank: RUNS.json lists (argv, log, result file) per run; each run's output goes to its log and its exit
status, with its seconds, to its result file."""

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

import torch

import train
from bam.checkpoint import checkpoint_dir, metrics_path, step_path
from bam.outputs import write_text
from bench.gpu_check.common import BASE_CONFIG, ROOT
from bench.gpu_check.report import Case, CaseTimeout, Section, Skip


@dataclasses.dataclass
class TrainPyRun:
    """One train.py run: `name` its run folder, `steps` (on a GPU; --quick trains 2 and resumes to 3),
    `resumed_from`: the step a --resume run continues from (None: a fresh run)."""
    name: str
    extra: tuple
    steps: int
    val_every: int
    resumed_from: int = None
    opt_in: bool = False
    expected_s: float = 0

    @property
    def key(self):
        return self.name + ("_resume" if self.resumed_from is not None else "")

    @property
    def sharded(self):
        return "--train.parallel=fsdp" in self.extra


FSDP, AC = ("--train.parallel=fsdp",), ("--train.activation_checkpointing=full",)
# On a GPU: the DDP run as long as issue 51 asked, FSDP + activation checkpointing a few steps (its cost is
# compilation: a Block with flex inside, for training and validation), resumed; plain FSDP and the FSDP resumes
# are the same code as these and run on request. Expected: each torchrun start ~10 s (imports, NCCL); the DDP
# run's training graph comes from the training section's inductor cache, its validation graph is compiled anew,
# 20 steps of 2 x 48 x 512 tokens; a resume finds every graph cached.
RUNS = [TrainPyRun("ddp", (), 20, 10, expected_s=55),
        TrainPyRun("ddp", (), 25, 10, resumed_from=20, expected_s=25),
        TrainPyRun("fsdp_ac", FSDP + AC, 4, 2, expected_s=50),
        TrainPyRun("fsdp", FSDP, 4, 2, opt_in=True, expected_s=50),
        TrainPyRun("fsdp_ac", FSDP + AC, 6, 2, resumed_from=4, opt_in=True, expected_s=25),
        TrainPyRun("fsdp", FSDP, 6, 2, resumed_from=4, opt_in=True, expected_s=25)]
# On one rank, two micro-batches of the paper's 48 x 512 per step (gradient accumulation runs) instead of 24;
# validation over two batches of the demo corpus's 50,000-token validation shard.
GPU_RUN = ("--train.tokens_per_step=49152", "--train.val_tokens=49152")
# --quick: a 2-layer model, uncompiled (inductor's C++ build would take minutes on a small CPU), two steps
# resumed to three.
QUICK_RUN = ("--model.n_layer=2", "--model.n_embd=64", "--model.n_head=4", "--model.block_size=64",
             "--data.batch_size=2", "--train.tokens_per_step=256", "--train.val_tokens=256", "--train.compile=false")
# What a rank's log says once per event with TORCH_LOGS=dynamo,recompiles,graph_breaks (child_env).
LOG_COUNTS = {"compiled_graphs": "Step 2: calling compiler function", "recompiles": "Recompiling function",
              "graph_breaks": "Graph break in user code", "recompile_limit_hit": "torch._dynamo hit config."}
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*\.)?\w*(Error|Exception|Unsupported|Interrupt|LimitHit)\w*: ")


def quick_run(run):
    if run.resumed_from is None:
        return dataclasses.replace(run, steps=2, val_every=1, expected_s=8)
    return dataclasses.replace(run, steps=3, val_every=1, resumed_from=2, expected_s=3)


def plan(s):
    runs = [quick_run(run) if s.quick else run for run in RUNS]
    launcher = Launcher(s, runs)
    cases = [Case("prepared demo corpus", 1, launcher.corpus_case)]
    for run in runs:
        what = f"--resume to {run.steps}" if run.resumed_from is not None else \
            f"{run.steps} steps, validation, checkpoint"
        title = f"torchrun train.py {run.name.replace('_ac', ' + activation checkpointing')}: {what}"
        # --quick: one torchrun start for every run (~10 s of a small CPU), paid by the first case
        expected = run.expected_s + (10 if s.quick and run is runs[0] else 0)
        cases.append(Case(title, expected, lambda run=run: launcher.run_case(run), opt_in=run.opt_in))
    return cases


class Launcher:
    """Starts the ranks, reads back what each run left; the runs of this run's plan share its folder."""

    def __init__(self, s, runs):
        self.s, self.runs = s, runs
        self.done = {}  # run key -> whether it passed
        self.launched = set()

    @property
    def root(self):
        return os.path.join(self.s.work_dir, "train_run")

    def corpus_case(self):
        data_dir = self.s.data_dir
        shards = glob.glob(os.path.join(data_dir, "*_train_*.bin"))
        if not shards:
            raise FileNotFoundError(f"--data_dir {data_dir} holds no *_train_*.bin shards; make them with "
                                    f"`python -m bench.gpu_check.prepare`")
        self.done["data"] = True
        return {"data_dir": os.path.relpath(data_dir, ROOT) if data_dir.startswith(ROOT) else data_dir,
                "train_shards": len(shards)}

    def run_case(self, run):
        if "data" not in self.done:
            raise Skip("no demo corpus")
        if run.resumed_from is not None and not self.done.get(run.name):
            raise Skip("no run to resume")
        if run.key not in self.launched:
            self.launch(run)
        return self.read(run)

    def launch(self, run):
        """One torchrun start for `run` (on a GPU), or for it and every planned run after it (--quick)."""
        os.makedirs(self.root, exist_ok=True)
        planned = [r for r in self.runs if self.s.all or not r.opt_in]
        group = planned[planned.index(run):] if self.s.quick else [run]
        for r in group:
            if r.resumed_from is None:  # an earlier call's run folder: train.py would refuse to start over it
                shutil.rmtree(os.path.join(self.root, r.name), ignore_errors=True)
            for path in (self.log(r), self.result_path(r)):
                if os.path.exists(path):
                    os.remove(path)
        spec = [{"argv": self.argv(r), "log": self.log(r), "result": self.result_path(r),
                 "run_dir": os.path.join(self.root, r.name), "metrics": self.metrics(r)} for r in group]
        spec_path = os.path.join(self.root, f"{run.key}_ranks.json")
        write_text(spec_path, json.dumps(spec, indent=1))
        self.launched.update(r.key for r in group)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                "-m", "bench.gpu_check.train_run", spec_path]
        code, output = run_logged(self.s.report, argv, os.path.join(self.root, f"{run.key}_torchrun.log"),
                                  child_env(self.s))
        if code != 0 and not os.path.exists(self.result_path(run)):
            raise RuntimeError(f"torchrun exited with {code}: {failure_line(output)}")

    def argv(self, run):
        return [BASE_CONFIG, f"--data.data_dir={self.s.data_dir}", f"--log.out_dir={os.path.join(self.root, run.name)}",
                f"--train.max_steps={run.steps}", f"--train.val_every={run.val_every}", "--log.log_every=1",
                "--train.keep_last=2", *(QUICK_RUN if self.s.quick else GPU_RUN), *run.extra,
                *([] if run.resumed_from is None else ["--resume"])]

    def log(self, run):
        return os.path.join(self.root, f"{run.key}.log")

    def result_path(self, run):
        return os.path.join(self.root, f"{run.key}.result.json")

    def metrics(self, run):
        """metrics.jsonl as the run left it (a --quick rank runs its resume before this run is read)."""
        return os.path.join(self.root, f"{run.key}.metrics.jsonl")

    def read(self, run):
        """What the run left: its exit status and seconds, its metrics.jsonl and its log's counts."""
        if not os.path.exists(self.result_path(run)):
            raise RuntimeError(f"the rank ended before train.py's {run.key} run did: "
                               f"{failure_line(read_text(self.log(run)))}")
        with open(self.result_path(run)) as f:
            result = json.load(f)
        output = read_text(self.log(run))
        if result["exit"] != 0:
            raise RuntimeError(f"train.py exited with {result['exit']}: {failure_line(output)}")
        summary, rows = metrics_summary(self.metrics(run), run.resumed_from or 0,
                                        0 if self.s.quick else (1 if run.resumed_from else 3))
        checkpoint = os.path.basename(step_path("", run.steps, run.sharded)) in result["checkpoints"]
        detail = {"train_py_s": result["seconds"], "steps": summary.pop("last_step"), **summary,
                  "checkpoint": checkpoint, **{key: output.count(text) for key, text in LOG_COUNTS.items()}}
        ok = detail["steps"] == run.steps and checkpoint and summary["finite"] and run.steps in summary["val_losses"]
        if run.resumed_from is None:
            ok = ok and 0 in summary["val_losses"]  # the untrained model's validation, traced before step 1
            self.done[run.name] = ok
        else:
            detail["resumed"] = f"resuming at step {run.resumed_from}" in output
            before = metrics_summary(self.metrics(dataclasses.replace(run, resumed_from=None)), 0, 0)[1]
            detail["rows_kept"] = rows[:len(before)] == before  # the rows up to the checkpoint, as they were
            ok = ok and detail["resumed"] and detail["rows_kept"]
            # no later run reads them; a GPU run's checkpoints are GBs (its log and metrics stay)
            shutil.rmtree(checkpoint_dir(os.path.join(self.root, run.name)), ignore_errors=True)
        return {"ok": ok, **detail}


@contextmanager
def removing_checkpoints(s):
    try:
        yield
    finally:
        for folder in glob.glob(os.path.join(s.work_dir, "train_run", "*", "checkpoints")):
            shutil.rmtree(folder, ignore_errors=True)


def child_env(s):
    """The environment of train.py's ranks: this run's GPU alone (train.py takes GPU LOCAL_RANK), none on the
    CPU (it would take any it sees), and dynamo's compilations, recompiles and graph breaks logged to be
    counted."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [name for name in env.get("TORCH_LOGS", "").split(",") if name]
    env["TORCH_LOGS"] = ",".join(dict.fromkeys(logs + ["dynamo", "recompiles", "graph_breaks"]))
    if s.cuda:
        index = s.device.index if s.device.index is not None else torch.cuda.current_device()
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_logged(report, argv, log_path, env):
    """Run a command with its output in log_path, stopped (its whole process group) a few seconds before the
    case's time limit, so that its processes are gone when the case is recorded. Returns (exit status, output)."""
    left = report.seconds_left() if report is not None else None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=None if left is None else max(1.0, left - 5))
        except subprocess.TimeoutExpired:
            raise CaseTimeout(f"stopped at its time limit ({os.path.basename(argv[-1])})") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, read_text(log_path)


def read_text(path):
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def failure_line(output):
    """What a failed command said: train.py's last `error: ...` line, else the last exception line (not
    torchrun's ChildFailedError about it), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    exceptions = [line for line in lines if EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or exceptions or lines or ["(no output)"])[-1][:300]


def metrics_summary(path, since, skip):
    """The numbers of a metrics.jsonl for the steps after `since`: losses, validation losses, tokens/s and MFU
    (medians over the steps after the first `skip` of them, whose intervals hold the compilation). Returns them
    and every row."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "loss" in r and r["step"] > since]
    timed = [r for r in steps if r["step"] > since + skip] or steps
    out = {"last_step": rows[-1]["step"] if rows else None,
           "loss_first": steps[0]["loss"] if steps else None, "loss_last": steps[-1]["loss"] if steps else None,
           "val_losses": {r["step"]: round(r["val_loss"], 4) for r in rows if "val_loss" in r},
           "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed)) if timed else None,
           "finite": all(math.isfinite(r.get(key, 0.0)) for r in rows for key in ("loss", "val_loss"))}
    if timed and all("mfu" in r for r in timed):
        out["mfu"] = round(statistics.median(r["mfu"] for r in timed), 3)
    return out, rows


SECTION = Section("train_run", plan, default=True, around=removing_checkpoints,
                  what="train.py under torchrun on the prepared demo corpus: DDP 20 steps, --resume to 25, "
                       "FSDP + activation checkpointing 4 steps")


# ---------------------------------------------------------------------------------------------------
# The rank torchrun starts


def rank_main(spec_path):
    """Each run in turn, its output (this process's file descriptors 1 and 2, which its tqdm bar and dynamo's
    logs write to) in its log; a run that exits (an error, SystemExit) does not stop the ones after it. Its
    result file says how it ended, which checkpoints it left, and its metrics.jsonl is kept as it was then."""
    with open(spec_path) as f:
        spec = json.load(f)
    for run in spec:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        t0, code = time.time(), 0
        try:
            train.main(run["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in (fd, *saved):
                os.close(descriptor)
        metrics = metrics_path(run["run_dir"])
        if os.path.exists(metrics):
            shutil.copyfile(metrics, run["metrics"])
        folder = checkpoint_dir(run["run_dir"])
        checkpoints = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        write_text(run["result"], json.dumps({"exit": code, "seconds": round(time.time() - t0, 1),
                                              "checkpoints": checkpoints}))


if __name__ == "__main__":
    rank_main(sys.argv[1])
