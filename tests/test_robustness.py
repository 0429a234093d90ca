"""train.py when things go wrong (issue 13): preemption signals and Ctrl-C with an exact resume, the
run-directory lock, a moved run directory, damaged checkpoints, the spike guard and its advice, a full
disk, an unwritable run directory, token ids outside the vocabulary, and torchrun's report."""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from bam import checkpoint, data, outputs, recovery
from small_runs import ROOT, newest, rows, small_config

pytestmark = pytest.mark.slow  # train.py in subprocesses and under torchrun, with real signals

# Runs train.main after arranging for this process to receive real signals at given steps: SIGNALS maps
# a step to the signals sent right after that step's metrics row is made, between two steps, as a
# scheduler's may arrive. The flag is read (and all-reduced) during the next step, which is the one
# finished and checkpointed. Under torchrun only rank STOP_RANK gets them.
SIGNALLER = """
import os, signal, sys, time
import train
SIGNALS, STOP_RANK = {signals}, {rank}
log_step = train.log_step

def log_step_then_signal(run, *args, **kwargs):
    row = log_step(run, *args, **kwargs)
    if run.procs.rank == STOP_RANK:
        for signum in SIGNALS.get(row["step"], []):
            os.kill(os.getpid(), signum)
            time.sleep(1.1)  # a second Ctrl-C counts only a second after the first
    return row

train.log_step = log_step_then_signal
train.main(sys.argv[1:])
"""


def run_with_signals(tmp_path, args, signals, rank=0, torchrun=False):
    script = tmp_path / "signaller.py"
    signals = {step: [int(s) for s in sent] for step, sent in signals.items()}
    script.write_text(SIGNALLER.format(signals=signals, rank=rank))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    # One thread per torchrun worker (two share the cores); a lone process uses this one's thread count, so
    # that its steps are bit for bit those of the uninterrupted run made in this process.
    threads = 1 if torchrun else torch.get_num_threads()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ROOT}
    return subprocess.run([*launcher, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def model_of(run_dir):
    return newest(run_dir)["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


STOP_ARGS = ["--train.ckpt_every=0", "--train.max_steps=5"]  # no checkpoint but the stop's and the last


@pytest.fixture(scope="module")
def straight(tmp_path_factory, synthetic):
    """The uninterrupted run the stopped ones must end up identical to."""
    path = tmp_path_factory.mktemp("straight")
    run = str(path / "run")
    train.main([small_config(path, synthetic), *STOP_ARGS, f"--log.out_dir={run}"])
    return run


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_is_exact(tmp_path, synthetic, straight,
                                                                             signum, code):
    common = [small_config(tmp_path, synthetic), *STOP_ARGS]
    stopped = str(tmp_path / "stopped")

    proc = run_with_signals(tmp_path, [*common, f"--log.out_dir={stopped}"], {2: [signum]})
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"stopped at step 3 on {signal.Signals(signum).name}; {stopped}/checkpoints/step_00000003.pt holds it: " \
           "continue with --resume" in proc.stderr
    assert [os.path.basename(p) for p in checkpoint.step_checkpoints(stopped)] == ["step_00000003.pt"]

    train.main([*common, f"--log.out_dir={stopped}", "--resume"])
    assert_same_weights(model_of(stopped), model_of(straight))
    assert [r["step"] for r in rows(stopped)] == [r["step"] for r in rows(straight)]


def test_ctrl_c_twice_quits_at_once_naming_the_last_checkpoint(tmp_path, synthetic):
    run = str(tmp_path / "run")
    proc = run_with_signals(tmp_path, [small_config(tmp_path, synthetic), f"--log.out_dir={run}"],
                            {3: [signal.SIGINT, signal.SIGINT]})
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Ctrl-C again to quit at once" in proc.stderr
    assert f"interrupted; the last checkpoint is {run}/checkpoints/step_00000002.pt, continue with --resume" \
           in proc.stderr  # the second Ctrl-C came before step 3's checkpoint


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    run = str(tmp_path / "ddp")
    proc = run_with_signals(tmp_path, [cfg, f"--log.out_dir={run}", "--train.ckpt_every=0"],
                            {2: [signal.SIGTERM]}, rank=1, torchrun=True)
    assert proc.returncode != 0, proc.stderr[-3000:]
    # Rank 1 alone got the signal; rank 0 (which writes) stopped after the same step and said so once.
    assert proc.stderr.count("stopped at step 3 on a signal to another rank") == 1, proc.stderr[-3000:]
    assert [os.path.basename(p) for p in checkpoint.step_checkpoints(run)] == ["step_00000003.pt"]
    assert re.search(r"exitcode\s*:\s*143", proc.stderr), proc.stderr[-3000:]  # torchrun's report names our code
    train.main([cfg, f"--log.out_dir={run}", "--resume"])  # continues on one process
    assert newest(run)["step"] == 6


def test_torchrun_shows_one_error_line_first(tmp_path, synthetic):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", small_config(tmp_path, synthetic), "--train.optimizer=sgd"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: [train] optimizer = 'sgd' (command line): choose one of: radam, adamw", lines[:5]
    assert len(error_lines(proc.stderr)) == 1


def children(pid):
    """The processes whose parent is `pid` (torchrun's ranks), read from /proc."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if name.isdigit() and f.read().rsplit(")", 1)[1].split()[1] == str(pid):
                    found.append(int(name))
        except OSError:
            pass
    return found


def running(pid):
    """Whether `pid` is a live process: not gone, nor a zombie that its new parent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def kill_9_torchrun(tmp_path, args, when):
    """Start torchrun with two ranks, wait until when() holds, kill -9 torchrun alone (as a lost job step or an
    OOM killer would) and return (torchrun's pid, seconds until no rank was left, stderr). Ranks that outlive it by
    60 s fail the test and are killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", "train.py", *args], cwd=ROOT, env=env, stdout=out,
                                    stderr=err)
    ranks = []
    try:
        wait_until(lambda: len(children(launcher.pid)) == 2 and when(), 240, "torchrun did not start its ranks")
        ranks = children(launcher.pid)
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        wait_until(lambda: not any(running(pid) for pid in ranks), 60, "ranks outlived their launcher")
        return launcher.pid, time.monotonic() - killed, (tmp_path / "err").read_text()
    finally:
        launcher.kill()
        for pid in ranks:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_kill_9_of_torchrun_stops_its_ranks_after_the_next_step_and_resume_continues(tmp_path, synthetic):
    """Each rank watches its launcher: once it is gone, every rank finishes the same step, checkpoints it and
    exits, releasing the run directory for the --resume that follows."""
    run = str(tmp_path / "run")
    args = [small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--train.ckpt_every=0"]
    pid, seconds, err = kill_9_torchrun(tmp_path, [*args, "--train.max_steps=100000"],
                                        when=lambda: os.path.exists(os.path.join(run, "metrics.jsonl"))
                                        and len(rows(run)) > 1)  # a step was logged
    print(f"the ranks stopped {seconds:.1f} s after torchrun's kill -9")
    [line] = [line for line in err.splitlines() if line.startswith("stopped at step")]
    step = int(line.split()[3])
    assert line == (f"stopped at step {step} because its launcher (pid {pid}) is gone; "
                    f"{run}/checkpoints/step_{step:08d}.pt holds it: continue with --resume"), err[-3000:]
    assert "Traceback" not in err
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.step_checkpoints(run)] == [step]
    train.main([*args, f"--train.max_steps={step + 2}", "--resume"])  # not refused as in use
    assert newest(run)["step"] == step + 2
    assert [r["step"] for r in rows(run)] == list(range(step + 3))  # from the untrained model's row on, once each


def orphans_go_to_init():
    """Whether a process whose parent ends is handed to pid 1 here (not to a subreaper), pid 1 being no launcher."""
    probe = ("import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             "'import os, time; time.sleep(0.5); print(os.getppid())']); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    with open("/proc/1/cmdline", "rb") as f:
        return out.strip() == "1" and b"torch" not in f.read()


def test_a_kill_9_of_torchrun_while_its_ranks_start_ends_them(tmp_path, synthetic):
    """Killed before its ranks are up (they would wait for the rendezvous it hosted until its timeout): they end
    at once, before their watch was armed (they are children of init by then) or after it (the kernel's signal)."""
    if not orphans_go_to_init():
        pytest.skip("orphans go to a subreaper here, which a rank cannot tell from its launcher")
    run = str(tmp_path / "run")
    kill_9_torchrun(tmp_path, [small_config(tmp_path, synthetic), f"--log.out_dir={run}"], when=lambda: True)
    assert checkpoint.step_checkpoints(run) == []


HOLDER = """
import sys, time
from bam.checkpoint import run_dir_lock
with run_dir_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(300)
"""


def test_a_second_train_py_on_the_same_run_dir_is_refused_until_the_first_is_gone(tmp_path, synthetic, capsys):
    run = str(tmp_path / "run")
    args = [small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--train.max_steps=2"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, run], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SystemExit) as info:
            train.main(args)
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert err == f"error: {run} is in use by another train.py (pid {holder.pid}, host {os.uname().nodename})\n"
        assert os.listdir(run) == [".lock"]  # nothing of a run was written
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel releases the lock
        holder.wait()
    train.main(args)
    assert newest(run)["step"] == 2
    train.main(args[:-1] + ["--resume", "--train.max_steps=3"])  # the lock is released when main returns


def test_a_moved_run_directory_resumes_where_it_is_now(tmp_path, synthetic, capsys):
    old, new = str(tmp_path / "old"), str(tmp_path / "elsewhere" / "new")
    train.main([small_config(tmp_path, synthetic), f"--log.out_dir={old}", "--train.max_steps=3"])
    os.makedirs(os.path.dirname(new))
    shutil.move(old, new)
    capsys.readouterr()
    train.main([os.path.join(new, "config.toml"), "--resume", "--train.max_steps=5"])
    assert f"names log.out_dir = '{old}', but it lies in {new}: using {new}" in capsys.readouterr().out
    assert not os.path.exists(old)
    assert newest(new)["step"] == 5 and [r["step"] for r in rows(new) if "loss" in r] == [1, 2, 3, 4, 5]
    assert f'out_dir = "{new}"' in open(os.path.join(new, "config.toml")).read()


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, synthetic, capsys):
    cfg = small_config(tmp_path, synthetic)
    straight, damaged = str(tmp_path / "straight"), str(tmp_path / "damaged")
    train.main([cfg, f"--log.out_dir={straight}", "--train.max_steps=5"])
    train.main([cfg, f"--log.out_dir={damaged}", "--train.max_steps=4"])
    step4 = checkpoint.step_path(damaged, 4)
    with open(step4, "r+b") as f:  # torn by a disk or a copy cut short, as the atomic writer never leaves it
        f.truncate(os.path.getsize(step4) // 2)
    capsys.readouterr()
    train.main([cfg, f"--log.out_dir={damaged}", "--train.max_steps=5", "--resume"])
    out = capsys.readouterr().out
    assert f"warning: cannot load {step4} (" in out and "trying the one before it" in out
    assert "resuming at step 3" in out
    assert_same_weights(model_of(damaged), model_of(straight))

    # every checkpoint damaged: one line, nothing changed
    for path in checkpoint.step_checkpoints(damaged):
        open(path, "wb").write(b"not a checkpoint")
    with pytest.raises(SystemExit):
        train.main([cfg, f"--log.out_dir={damaged}", "--train.max_steps=6", "--resume"])
    err = capsys.readouterr().err
    assert error_lines(err) == [f"error: no checkpoint in {damaged}/checkpoints can be loaded (all 2 are damaged); "
                                "move them away to start over"]


def test_changed_training_data_on_resume_is_one_line(tmp_path, synthetic, capsys):
    run, changed = str(tmp_path / "run"), str(tmp_path / "changed")
    shutil.copytree(synthetic, changed)
    cfg = small_config(tmp_path, changed)
    train.main([cfg, f"--log.out_dir={run}", "--train.max_steps=2"])
    data.write_shard(os.path.join(changed, "syn_train_000003.bin"), np.arange(1000))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        train.main([cfg, f"--log.out_dir={run}", "--train.max_steps=3", "--resume"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: cannot resume from step 2: loader state is for a train stream of 23000 tokens")
    assert "the data changed since the checkpoint" in err


def advice(err):
    """The `--resume --train.lr=X` the divergence error recommends."""
    [line] = error_lines(err)
    return re.search(r"`(--resume --train\.lr=\S+)`", line).group(1).split()


def test_a_spike_stops_before_it_is_checkpointed_and_the_advice_leads_to_a_healthy_run(tmp_path, synthetic, capsys):
    run = str(tmp_path / "run")
    # keep_last = 1 still keeps 2: the newest checkpoint's weights are the ones a spike indicts.
    base = [small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--train.val_every=0", "--train.keep_last=1",
            "--train.optimizer=adamw", "--train.spike_window=3",
            "--train.spike_grad_factor=10"]  # the gradient rule is off by default
    train.main([*base, "--train.max_steps=5"])
    healthy = [r["grad_norm"] for r in rows(run)]

    # A learning rate 1000x too high: step 6's update wrecks the weights, step 7's gradient shows it.
    args = [*base, "--train.max_steps=12", "--train.lr=1.0", "--resume"]
    for attempt in range(4):
        capsys.readouterr()
        try:
            train.main(args)
            break
        except SystemExit as e:
            assert e.code == 1
        err = capsys.readouterr().err
        assert re.search(r"error: diverged at step 7: gradient norm \S+ is more than 10 x the median", err), err
        # step 7's gradient came from step 6's weights: the advice goes back to step 5, step 6 is set aside
        assert f"continues from {run}/checkpoints/step_00000005.pt" in err
        assert [checkpoint.checkpoint_step(p) for p in checkpoint.step_checkpoints(run)] == [5]
        assert os.path.exists(checkpoint.step_path(run, 6) + ".rejected")
        args = [a for a in args if not a.startswith(("--train.lr=", "--resume"))] + advice(err)
    assert attempt > 0, "the first learning rate did not diverge: this test would not test anything"

    table = rows(run)
    assert [r["step"] for r in table] == list(range(1, 13))
    after = [r for r in table if r["step"] > 5]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0.01 for r in after)  # not a dead model
    assert max(r["grad_norm"] for r in after) < 10 * np.median(healthy[-3:])
    assert np.mean([r["loss"] for r in after[-3:]]) < table[4]["loss"] - 0.3  # and it learns
    assert newest(run)["step"] == 12


def test_spike_rules():
    assert train.load_config(None, []).train.spike_grad_factor == 0  # off unless asked for
    t = train.load_config(None, ["--train.spike_window=4", "--train.spike_grad_factor=10"]).train
    history = [[3.0, 1.0], [3.1, 1.2], [2.9, 0.8], [3.0, 1.0]]
    assert recovery.spike(history, 3.2, 1.5, t, 50304) is None
    assert "robust standard deviations" in recovery.spike(history, 4.0, 1.0, t, 50304)
    assert "gradient norm 20 is more than 10 x the median 1" in recovery.spike(history, 3.0, 20.0, t, 50304)
    assert recovery.spike(history[:3], 4.0, 20.0, t, 50304) is None  # too little history to judge
    assert "twice that of uniform guessing" in recovery.spike([], 30.0, 1.0, t, 50304)  # no history needed
    t.spike_threshold = t.spike_grad_factor = 0  # off
    assert recovery.spike(history, 1e9, 1e9, t, 50304) is None


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, synthetic,
                                                                                         monkeypatch, capsys):
    run = str(tmp_path / "run")
    args = [small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--train.val_every=0"]

    class Writer:  # io.BufferedWriter's write cannot be replaced; a wrapper with the same methods can
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_disk_open(path, mode="r", *a, **kw):
        f = Writer(open(path, mode, *a, **kw))
        if os.path.basename(path).startswith("step_00000003.pt"):
            f.write = lambda b: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return f
    monkeypatch.setattr(outputs, "open", full_disk_open, raising=False)  # the atomic writer's open
    with pytest.raises(SystemExit) as info:
        train.main(args)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert error_lines(err) == [f"error: cannot write {run}/checkpoints/step_00000003.pt: the disk is full (no space left "
                                f"on device); the previous "
                                f"checkpoint {run}/checkpoints/step_00000002.pt is intact; make room and rerun with --resume"]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_00000001.pt", "step_00000002.pt"]
    monkeypatch.undo()
    assert newest(run)["step"] == 2
    train.main(args + ["--resume"])
    assert newest(run)["step"] == 6


def test_an_unwritable_run_directory_is_one_line(tmp_path, synthetic, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = small_config(tmp_path, synthetic)
    with pytest.raises(SystemExit) as info:
        train.main([cfg, f"--log.out_dir={blocker}/run"])
    assert info.value.code == 1
    assert capsys.readouterr().err == (f"error: log.out_dir = '{blocker}/run' cannot be created or written ({blocker} "
                                       f"is a file, not a directory); choose another --log.out_dir\n")
    if os.geteuid() == 0:
        return  # root writes into read-only directories
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        train.main([cfg, f"--log.out_dir={read_only}/run"])
    assert "Permission denied" in capsys.readouterr().err


def write_tokens(directory, shards):
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(1)
    for name, n, bad_at in shards:
        tokens = rng.integers(0, 2_000, n)
        tokens[::40] = data.EOT
        if bad_at is not None:
            tokens[bad_at] = 60_000  # another tokenizer's id: fits uint16, not GPT-2's 50,257
        data.write_shard(os.path.join(directory, name), tokens)
    return str(directory)


def test_token_ids_outside_the_vocabulary_are_one_line(tmp_path, capsys):
    in_val = write_tokens(tmp_path / "in_val", [("x_val_000000.bin", 2000, 1500), ("x_train_000001.bin", 4000, None)])
    run = str(tmp_path / "run")
    with pytest.raises(SystemExit):
        train.main([small_config(tmp_path, in_val), f"--log.out_dir={run}", "--model.vocab_size=50257"])
    assert capsys.readouterr().err == (
        f"error: cannot use the shards in {in_val}: {in_val}/x_val_000000.bin: token 1,500 has id 60000, outside the "
        "model's vocabulary (model.vocab_size = 50257); raise model.vocab_size or re-tokenize with the GPT-2 tokenizer\n")
    assert not os.path.exists(run)  # found before anything was written

    # in a later training shard: found at the batch that reads it, still one line
    later = write_tokens(tmp_path / "later", [("x_val_000000.bin", 2000, None), ("x_train_000001.bin", 400, None),
                                              ("x_train_000002.bin", 4000, 10)])
    with pytest.raises(SystemExit):
        train.main([small_config(tmp_path, later), f"--log.out_dir={run}", "--model.vocab_size=50257"])
    err = capsys.readouterr().err
    assert error_lines(err) == [f"error: the train split in {later} (tokens 384..448) holds token id 60000, outside "
                                "the model's vocabulary (model.vocab_size = 50257); raise model.vocab_size or "
                                "re-tokenize with the GPT-2 tokenizer"], err


def test_one_ctrl_c_delivered_twice_is_one_stop_request():
    """Under torchrun a keypress reaches each worker from the terminal and again from torchrun."""
    stop = recovery.StopRequest(speak=False)
    stop.handle(signal.SIGINT, None)
    stop.handle(signal.SIGINT, None)  # the same keypress: still a graceful stop
    assert stop.signum == signal.SIGINT and stop.exit_code == 130
    stop.since -= 2
    with pytest.raises(KeyboardInterrupt):
        stop.handle(signal.SIGINT, None)
    term = recovery.StopRequest(speak=False)
    term.handle(signal.SIGTERM, None)
    term.handle(signal.SIGINT, None)  # Ctrl-C after a SIGTERM: the stop already under way goes on
    assert term.signum == signal.SIGTERM and term.exit_code == 143


def snapshot(run_dir):
    """Every file under a run directory with its bytes and modification time; the lock's owner line aside."""
    out = {}
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, run_dir)
            out[rel] = None if rel == checkpoint.LOCK else (os.stat(path).st_mtime_ns, open(path, "rb").read())
    return out


def test_a_refused_train_py_leaves_the_run_directory_as_it_was(tmp_path, synthetic, capsys):
    """Issue 24: only the lock file's owner line may change when a run on an existing run dir is refused."""
    run = str(tmp_path / "run")
    base = [small_config(tmp_path, synthetic), f"--log.out_dir={run}"]
    train.main(base + ["--train.max_steps=2"])
    capsys.readouterr()
    before = snapshot(run)
    for refused in (["--resume", "--model.n_embd=64"],  # another model than the checkpoint's
                    ["--resume", "--model.rope_theta=0"],  # a value out of range
                    ["--resume", "--train.max_steps=3", "--train.init_from=" + str(tmp_path / "nothing")],
                    ["--resume", "--model.n_embd=1048576", "--model.n_head=8"]):  # cannot fit in memory
        with pytest.raises(SystemExit) as info:
            train.main(base + refused)
        assert info.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert snapshot(run) == before, refused
