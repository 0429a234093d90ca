"""Every test runs on the CPU unless it asks for a GPU with @pytest.mark.cuda (pytest.ini registers the
marker). On a GPU machine the code under test would otherwise take CUDA wherever it is visible: train.py's
setup_processes (with TF32 on and bf16 autocast by default), the evaluators' --device auto, the benchmarks'
defaults. The CPU tests pin exact values and bitwise resumes that TF32, bf16 and the GPU kernels' atomic adds
do not keep, so they must see the machine a CPU-only CI sees:

- in this process, torch.cuda.is_available() and device_count() (and torch.accelerator's view of the same)
  say there is no GPU for the length of each unmarked test: every device choice in the repository asks
  torch.cuda.is_available() when it runs, never at import;
- in every process a test starts (python train.py, torchrun and its ranks, the evaluators' command lines),
  CUDA_VISIBLE_DEVICES is empty. It is set here, when pytest loads this file, before any test module is
  imported, so that environments copied at import (tests/test_fsdp.py's ENV) carry it too. This process
  learnt its GPUs before that, so the marked tests still have them; they see the variable as it was.

A test marked `cuda` is skipped with its reason where no GPU is visible. After every test the float32 matmul
precision is put back, so that a GPU test (or train.py on a GPU, which turns TF32 on) cannot change the
numbers of the tests after it.

The fast lane, `python -m pytest -m "not slow"`, leaves out what pytest.ini's `slow` marker names: the tests
that start a process (python train.py, torchrun, the command lines), start a process group or compile, and
the files that run the commands end to end (whole-file marks). An unmarked test that starts a process or
compiles fails here with the advice to mark it, so the lane stays the one-minute loop it is documented to
be: a subprocess, a process group and the flex path (whose kernels are compiled on first use) are refused
when they start; any other compile (torch.compile, dynamo's explain) is counted by dynamo and reported when
the test ends. tests/test_structure.py also reads the test files for unmarked tests that do so.

No test reaches the network. What the repository fetches from outside, GPT-2's ranks, comes from the set-up
step (`python -m bam.fetch`, which scripts/setup.sh runs): without it the session stops before the first test
with one line that names the command. $BAM_GPT2_TIKTOKEN is set here to the ranks the set-up step fetched,
before any test module is imported, so that this process and every process a test starts read that file and
never take bam.tokenizer's routes that download on first use (a test of those routes sets its own).

The suite runs in parallel (pytest.ini: pytest-xdist, one worker more than the cores, each test file on one
worker so that a module's fixtures are built once). Each worker, and every process it starts, gets its share of the
cores as torch's thread count: with two workers on two cores each running torch's two threads, OpenMP's
threads wait on each other: two files of the model's tests took 50 s against 7.6 s in one process. `-n 0` runs
the suite in this process alone (for a debugger).

The shared fixtures live here too; the shared helpers (tiny models and batches, small training runs) are
plain modules beside this file, so no test file imports from another.
"""

import os
import subprocess

# datasets binds sys.stderr to its logger when it is first imported: first imported inside a test that captures
# stderr (capsys: transformers and lm-eval import it lazily), it kept that test's stream, closed when the test
# ended, and each later warning of datasets in the same worker printed "--- Logging error ---" into another test's
# output (test_io_errors' torn JSONL after test_import_hf). Imported here, it binds the session's stream.
import datasets  # noqa: F401
import numpy as np
import pytest
import torch
import torch._inductor.config
import torch.distributed as dist
from torch._dynamo.utils import counters

import model
from bam import data, tokenizer
from bam.cli import usable_cores

# pytest-xdist's workers are started by the main process after it has loaded this file, and would inherit the
# emptied variable: the machine's value travels to them in MACHINE_DEVICES ("<pid of the main process>:<value>",
# so that a pytest a test starts records its own) and is put back before they ask CUDA.
MACHINE_DEVICES, UNSET = "BAM_TESTS_MACHINE_CUDA_VISIBLE_DEVICES", "<unset>"
pid, _, machine = os.environ.get(MACHINE_DEVICES, "").partition(":")
if os.environ.get("PYTEST_XDIST_WORKER") and pid == str(os.getppid()):  # a worker of the pytest that wrote it
    if machine == UNSET:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = machine
else:
    os.environ[MACHINE_DEVICES] = f"{os.getpid()}:{os.environ.get('CUDA_VISIBLE_DEVICES', UNSET)}"
# Asked before CUDA_VISIBLE_DEVICES is emptied below: the CUDA runtime reads the variable when it first counts
# the devices, so this process keeps the GPUs it has.
CUDA_PRESENT = torch.cuda.is_available()
VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
GPT2_RANKS = tokenizer.gpt2_tiktoken_cache_path()
os.environ["BAM_GPT2_TIKTOKEN"] = GPT2_RANKS
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, usable_cores() // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # the processes a test starts (train.py, torchrun's ranks)
    torch.set_num_threads(THREADS)
    # Inductor's C++ compiles in the process that asks, not in a pool of its own (by default one process per
    # core, each importing torch): the workers already keep every core busy (the heaviest flex test from a cold
    # cache: 66 s against 71 s). The variable for the processes a test starts; this one has read it already.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    torch._inductor.config.compile_threads = 1


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker more than the cores, because a test that waits on a process it started
    (torchrun's rendezvous, a signal, a subprocess's import) leaves its core to the others. On 2 cores the whole
    suite from a fresh clone took 562 s with 3 workers against 617 s with 2, each beside a background job at
    nice 19 that takes only what the suite leaves idle; quiet, the suite keeps both cores 99% busy either way."""
    return usable_cores() + 1


# The longest test files (their tests' seconds added up, --durations=0 of a fresh clone's run at 6454532, 2 cores,
# cold compile caches), longest first. They are handed to the workers first, so that the run ends on short files
# and no worker waits long for the last one: the files are otherwise handed out in collection order, and a
# long file handed out last kept one worker busy ~50 s after the others were done. A stale list costs only time
# (tests/test_structure.py checks that each is a test file).
LONGEST_FILES = ["model/test_attention_paths.py", "test_repro.py", "test_fsdp.py", "test_robustness.py",
                 "model/test_prior_tables.py", "test_gpu_check.py", "test_train.py", "test_compile.py",
                 "test_export_hf.py", "model/test_sinks_gates.py", "test_prepare.py", "test_import_hf.py"]


def pytest_configure(config):
    # pytest-xdist 3.8+ hands the files out by their number of tests, most first, unless told not to
    # (--no-loadscope-reorder, which older versions do not know): the order below is by seconds, not tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The LONGEST_FILES first (a stable sort: every file keeps its tests' order)."""
    rank = {os.path.join(os.path.dirname(__file__), name): i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


def pytest_sessionstart(session):
    if not os.path.isfile(GPT2_RANKS):
        raise pytest.UsageError(f"no GPT-2 ranks at {GPT2_RANKS}: run the set-up step first, `python -m bam.fetch` "
                                f"(scripts/setup.sh installs the requirements and runs it)")


def no_accelerator(*args, **kwargs):
    return None


@pytest.fixture(autouse=True)
def device_pin(request, monkeypatch):
    precision = torch.get_float32_matmul_precision()
    if request.node.get_closest_marker("cuda"):
        if not CUDA_PRESENT:
            pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
        # torch.cuda.device_count() reads CUDA_VISIBLE_DEVICES again (NVML) until CUDA is initialised
        if VISIBLE_DEVICES is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE_DEVICES)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", no_accelerator)
    yield
    torch.set_float32_matmul_precision(precision)


class SlowInFastLane(Exception):
    """What an unmarked test raises when it starts work that pytest.ini's `slow` marker names."""


def slow_work(what):
    return (f"this test {what}: mark it @pytest.mark.slow (or its module: pytestmark = pytest.mark.slow) so that "
            f"`python -m pytest -m \"not slow\"` stays the fast lane")


def refuse(what):
    def refused(*args, **kwargs):
        raise SlowInFastLane(slow_work(what))
    return refused


def compiled_graphs():
    """How many graphs dynamo has compiled in this process (torch.compile, explain, the flex kernels)."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fast_lane_guard(request, monkeypatch):
    """An unmarked test may not start a process or a process group, run the flex path (every flex kernel is
    compiled on first use, and in the fast lane no slow test has compiled it before) or compile anything."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("starts a subprocess"))
    monkeypatch.setattr(dist, "init_process_group", refuse("starts a process group"))
    monkeypatch.setitem(model.ATTENTION, "flex", refuse("runs the flex path (a compiled FlexAttention kernel)"))
    before = compiled_graphs()
    yield
    if compiled_graphs() > before:
        pytest.fail(slow_work("compiles (dynamo compiled a graph)"), pytrace=False)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Random tokens with an EOT every ~40: enough to test mechanics, nothing to learn (tests/small_runs.py's
    small_config trains on them)."""
    path = tmp_path_factory.mktemp("synthetic")
    rng = np.random.default_rng(0)
    for name, n in (("syn_val_000000.bin", 4_000), ("syn_train_000001.bin", 3_000), ("syn_train_000002.bin", 20_000)):
        tokens = rng.integers(0, 2_000, n)
        tokens[rng.random(n) < 1 / 40] = data.EOT
        data.write_shard(str(path / name), tokens)
    return str(path)
