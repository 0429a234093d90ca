"""
How a run stops and continues without losing a step or corrupting what it wrote (docs/training.md,
"Preemption and recovery"): train.py's loop calls these guards and stays a plain training step.

- Stopping: SIGTERM/SIGUSR1 (preemption) and Ctrl-C become a flag the loop reads after each step
  (StopRequest); the step is finished and checkpointed, then the run exits 143 or 130. Under torchrun the
  end of the launcher (a kill -9 of torchrun) is one more stop request (LauncherWatch), so no rank trains on
  as an orphan.
- Divergence: a non-finite or spiking step (spike, check_step) stops the run before it is applied, and
  the checkpoints it indicts are set aside (Diverged names the one to resume from).
- Resuming: the newest checkpoint that loads, only if the settings still describe the same experiment
  (load_resume_state), a run directory found where it was moved to, and the RNG states and metrics rows
  that make the resumed run identical to one that never stopped.
"""

import ctypes
import json
import math
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch

from bam.checkpoint import CONFIG, checkpoint_dir, checkpoint_step, load_newest, reject_after, step_checkpoints
from bam.cli import UserError
from bam.config import CHANGEABLE_ON_RESUME, checkpoint_differences, to_dict

# ---------------------------------------------------------------------------------------------------
# Stopping on a signal

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: what a process ended by SIGTERM reports; also after SIGUSR1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C


PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LauncherWatch:
    """A torchrun rank's watch on its launcher (torchrun's agent, the process that started it). Killed with
    SIGKILL, the agent cannot stop its workers, which would train on as orphans holding the run directory. So:

    - during setup (armed first thing in train.main, before the process group), the kernel sends SIGNAL when
      the launcher ends (prctl PR_SET_PDEATHSIG), whose default action ends the rank at once, writing nothing
      half (every write is atomic): a rank waiting for a rendezvous that a dead launcher hosted would
      otherwise wait for its timeout;
    - while training, StopRequest catches SIGNAL and asks every step whether the launcher is gone (the
      parent is no longer the one armed: the rank was handed to init or a subreaper); the answer rides on the
      step's all-reduce like a signal's, so every rank finishes the same step, checkpoints it and exits 143.

    A launcher that ended before the watch was armed (while the rank was still importing) leaves the rank a
    child of pid 1 already: `gone` says so unless pid 1 is itself a torch launcher (torchrun as a container's
    entrypoint). A subreaper in its place is not told apart (such a rank stops at the rendezvous's timeout)."""

    SIGNAL = signal.SIGUSR2  # not one of StopRequest's: SIGUSR2 with the launcher alive is ignored

    def __init__(self, pid, orphaned=False):
        self.pid, self.orphaned = pid, orphaned  # the launcher; whether it was gone before the watch was armed

    @classmethod
    def arm(cls):
        pid = os.getppid()
        death_signal(cls.SIGNAL)
        return cls(pid, orphaned=pid == 1 and not launcher_is_init())

    def gone(self):
        return self.orphaned or os.getppid() != self.pid


def death_signal(signum):
    """prctl(PR_SET_PDEATHSIG, signum): the kernel sends `signum` to this process when its parent ends (Linux
    only; elsewhere StopRequest's per-step question alone notices it). Returns whether it is set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def launcher_is_init():
    """Whether pid 1 is a torch launcher (torchrun as a container's first process), not init."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return b"torch" in f.read()
    except OSError:
        return True  # cannot tell: never stop a run on a guess


class StopRequest:
    """While installed, SIGTERM (SLURM, Kubernetes), SIGUSR1 (`sbatch --signal`) and a first Ctrl-C only set
    a flag, which the loop reads after each step: the step is finished and checkpointed, then the run stops.
    A second Ctrl-C quits at once (KeyboardInterrupt). One within a second of the first is the same
    keypress arriving twice: under torchrun the terminal sends it to every process and torchrun forwards it.
    With a LauncherWatch, a launcher that is gone is a stop request too (`flags`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, speak, launcher=None):
        self.signum, self.speak, self.previous, self.since = None, speak, {}, 0.0
        self.launcher, self.orphan, self.orphan_elsewhere = launcher, False, False

    def launcher_gone(self):
        """Whether this rank's launcher is gone (said once, by the rank that speaks)."""
        if self.launcher is not None and not self.orphan and self.launcher.gone():
            self.orphan = True
            if self.speak:
                print(f"\nthe launcher (pid {self.launcher.pid}) is gone: stopping after this step with a checkpoint",
                      file=sys.stderr, flush=True)
        return self.orphan

    def flags(self):
        """[a signal asked this rank to stop, this rank's launcher is gone] as 0.0 or 1.0, for the step's
        all-reduce to sum over the ranks; `agree` reads the sums back."""
        return [float(self.signum is not None), float(self.launcher_gone())]

    def agree(self, signalled, orphaned):
        """Whether every rank stops after this step, from the sums of every rank's flags."""
        self.orphan_elsewhere = orphaned > 0 and not self.orphan
        return signalled + orphaned > 0

    def why(self):
        """Why this rank stopped, for its `stopped at step N ...` line."""
        if self.signum is not None:
            return f"on {signal.Signals(self.signum).name}"
        if self.orphan:
            return f"because its launcher (pid {self.launcher.pid}) is gone"
        if self.orphan_elsewhere:
            return "because the launcher of another rank is gone"
        return "on a signal to another rank"

    def handle(self, signum, frame):
        if signum == LauncherWatch.SIGNAL:
            self.launcher_gone()  # the parent's end (or a stray SIGUSR2, then nothing): said now, agreed next step
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            if time.monotonic() - self.since > 1.0:
                raise KeyboardInterrupt
            return
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            if self.speak:
                again = "; Ctrl-C again to quit at once" if signum == signal.SIGINT else ""
                print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint{again}",
                      file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            watched = (LauncherWatch.SIGNAL,) if self.launcher is not None else ()
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS + watched}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    @property
    def exit_code(self):
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED


class Stopped(Exception):
    """The loop stopped on a signal after checkpointing step `step`."""


def interrupted(run_dir, master):
    """Ctrl-C twice (or during setup): no traceback, but where the run can continue from."""
    newest = step_checkpoints(run_dir) if run_dir else []
    if master:
        where = (f"the last checkpoint is {newest[-1]}, continue with --resume" if newest else
                 "no checkpoint was written" if run_dir else "before training started")
        print(f"\ninterrupted; {where}", file=sys.stderr)
    raise SystemExit(EXIT_INTERRUPTED)

# ---------------------------------------------------------------------------------------------------
# Divergence


class Diverged(UserError):
    """A non-finite or spiking step, seen alike by every rank (the loss and gradient norm are all-reduced)."""


def spike(history, loss, grad_norm, train, vocab_size):
    """Why this step's (loss, grad norm) is a divergence by the spike rules of config.TrainConfig, or None.
    Medians and the median absolute deviation are robust to the odd noisy step in the window; the
    deviation has a floor (1% of the median) so that a very flat loss curve does not turn noise into
    spikes. Loss twice that of uniform guessing means the model is broken whatever its history."""
    if train.spike_threshold and loss > 2 * math.log(vocab_size):
        return f"loss {loss:.4g} is more than twice that of uniform guessing ({math.log(vocab_size):.2f})"
    if len(history) < train.spike_window:
        return None  # not enough history yet to know what normal is
    losses, norms = np.array(history[-train.spike_window:]).T
    median = float(np.median(losses))
    sigma = max(1.4826 * float(np.median(np.abs(losses - median))), 0.01 * abs(median))
    if train.spike_threshold and loss > median + train.spike_threshold * sigma:
        return (f"loss {loss:.4g} is more than {train.spike_threshold:g} robust standard deviations above the "
                f"median {median:.4g} of the last {train.spike_window} steps")
    median_norm = float(np.median(norms))
    if train.spike_grad_factor and grad_norm > train.spike_grad_factor * median_norm:
        return (f"gradient norm {grad_norm:.4g} is more than {train.spike_grad_factor:g} x the median "
                f"{median_norm:.4g} of the last {train.spike_window} steps")
    return None


def diverged(run, step, why):
    """Stop before update `step` is applied. Its loss and gradient were computed on the weights of step - 1,
    so those are suspect too: the newest checkpoint that can be trusted is from step - 2 or before. Newer ones
    are set aside (renamed *.rejected, not deleted), so that `--resume` continues from the good one."""
    run_dir, lr = run.cfg.log.out_dir, run.cfg.train.lr
    good = [p for p in step_checkpoints(run_dir) if checkpoint_step(p) <= step - 2]
    if run.procs.master:
        reject_after(run_dir, checkpoint_step(good[-1]) if good else -1)
        # The last row of metrics.jsonl says where and why the run stopped: a report shows the loss curve
        # of a run that did not train beside those that did (a --resume drops the row with the steps it redoes).
        run.metrics.record({"step": step, "diverged": why})
    start = f"continues from {good[-1]}" if good else "starts over (no checkpoint predates it)"
    raise Diverged(f"diverged at step {step}: {why}; stopped without applying it. `--resume --train.lr={lr / 2:.3g}` "
                   f"{start}; lowering train.lr further, raising train.warmup_steps or setting train.grad_clip "
                   "also help (newer checkpoints are kept as *.rejected)")


def check_step(run, step, loss, grad_norm):
    """Diverged (on every rank alike: the values are all-reduced) for a non-finite or spiking step; a healthy
    one joins the history the spike rules compare against."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        diverged(run, step, f"non-finite loss or gradient (loss {loss}, grad norm {grad_norm})")
    why = spike(run.state.recent, loss, grad_norm, run.cfg.train, run.cfg.model.vocab_size)
    if why:
        diverged(run, step, why)
    run.state.recent = (run.state.recent + [[loss, grad_norm]])[-run.cfg.train.spike_window:]

# ---------------------------------------------------------------------------------------------------
# Resuming


def load_resume_state(cfg, resume, master):
    """(path, checkpoint) to continue from, or (None, None) for a fresh run. A run directory that holds another
    run's checkpoints, or settings that would make the resumed run a different experiment, are refused. An FSDP
    run reads a sharded checkpoint's tensors later, into its shards (train.restore); any other run gets them
    here, a sharded checkpoint joined into whole tensors."""
    run_dir = cfg.log.out_dir
    existing = step_checkpoints(run_dir)
    if existing and not resume:
        raise UserError(f"{run_dir} already holds checkpoints (newest {os.path.basename(existing[-1])}); "
                        "pass --resume to continue that run or choose another --log.out_dir")
    if not existing:
        return None, None
    path, ckpt = load_newest(existing, warn=print if master else lambda message: None,
                             join_shards=cfg.train.parallel != "fsdp", set_aside=master)
    if ckpt is None:
        raise UserError(f"no checkpoint in {checkpoint_dir(run_dir)} can be loaded (all {len(existing)} are damaged); "
                        "move them away to start over")
    if "loader" not in ckpt:  # an imported model (import_hf.py), or a bare save_model: weights without a run
        raise UserError(f"{path} holds weights only, no training state to resume; start a run from them with "
                        f"--train.init_from={run_dir} --log.out_dir=NEW_RUN")
    forbidden, changed = checkpoint_differences(ckpt["config"], to_dict(cfg), CHANGEABLE_ON_RESUME)
    if forbidden:
        allowed = ", ".join(f"{s}.{k}" for s, ks in CHANGEABLE_ON_RESUME.items() for k in sorted(ks))
        raise UserError(f"cannot resume {path} with different settings ({'; '.join(forbidden)}); "
                        f"only these may change: {allowed}")
    if master and changed:
        print(f"resuming with changed settings: {'; '.join(changed)}")
    return path, ckpt


def follow_moved_run_dir(cfg, path, overrides, master):
    """`train.py RUN/config.toml --resume` continues the run in RUN, also when RUN was moved or copied since
    its config.toml was written (the log.out_dir inside still names the old place). An explicit
    --log.out_dir wins."""
    run_dir = os.path.dirname(os.path.abspath(path))
    is_run_dir = os.path.basename(path) == CONFIG and os.path.isdir(checkpoint_dir(run_dir))
    if not is_run_dir or any(arg.startswith("--log.out_dir=") for arg in overrides):
        return
    init_from = cfg.train.init_from and os.path.abspath(cfg.train.init_from)
    if init_from in (run_dir, checkpoint_dir(run_dir)) or os.path.dirname(init_from or "") == checkpoint_dir(run_dir):
        # `train.py RUN/config.toml --train.init_from=RUN` starts a new run from RUN's weights: it never writes
        # into RUN, and goes where the config says (an imported run's names a folder beside it, import_hf.py)
        return
    if os.path.abspath(cfg.log.out_dir) != run_dir:
        if master:
            print(f"{path} names log.out_dir = {cfg.log.out_dir!r}, but it lies in {run_dir}: using {run_dir}")
        cfg.log.out_dir = run_dir


def rng_state(device):
    """Every generator a run draws from, as plain lists and tensors (checkpoints load with
    torch.load(weights_only=True)). On a GPU, the generator of this rank's device only: each rank owns one
    device, and a resume may see another number of them."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    device = torch.device(device)
    return {"python": random.getstate(), "numpy": [key.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, device):
    """rng_state()'s state back, `device`'s generator included; also as a sharded checkpoint's state.json holds it
    (lists for tuples and byte tensors). Checkpoints written before rng_state kept one device's generator hold
    a list of every visible device's: this rank's local device takes its own entry where the list has one,
    else the first (a resume on fewer visible GPUs)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    device, cuda = torch.device(device), state.get("cuda")
    if device.type != "cuda" or cuda is None or len(cuda) == 0:
        return
    if not isinstance(cuda, torch.Tensor) and not isinstance(cuda[0], int):  # one state per device (older)
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(torch.as_tensor(cuda, dtype=torch.uint8), device)


def metrics_rows_until(path, step):
    """The lines of metrics.jsonl at `path` up to and including `step`: the rows past a checkpoint belong to
    steps that are about to be redone. A line cut short by a kill reads as past every checkpoint."""
    def row_step(line):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return math.inf
    with open(path) as f:
        return [line for line in f if row_step(line) <= step]
