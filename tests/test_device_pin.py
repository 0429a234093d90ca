"""tests/conftest.py keeps the suite on the CPU on a GPU machine: checked by running pytest, with this
repository's conftest.py and pytest.ini, on a probe file, once as on this CPU and once on a pretend GPU
machine (torch.cuda.is_available() made True before the conftest is loaded, as a `-p` plugin is)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # pytest itself, started on a probe file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRETEND_GPU = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
"""

PROBE = """
import os
import subprocess
import sys

import pytest
import torch

import train
from eval.loading import pick_device

ENV = {**os.environ}  # copied at import, as tests/test_fsdp.py does


@pytest.mark.slow  # it starts a subprocess (tests/conftest.py refuses one to an unmarked test)
def test_unmarked_test_sees_the_cpu():
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert torch.accelerator.current_accelerator() is None
    assert train.setup_processes().device == torch.device("cpu")
    assert pick_device("auto") == torch.device("cpu")
    assert torch.get_float32_matmul_precision() == "highest"  # train.py's TF32 is for a GPU only
    for env in (None, ENV):  # what a subprocess, torchrun and its ranks inherit
        show = "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"
        child = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
        assert child.stdout.strip() == "''"


@pytest.mark.cuda
def test_marked_test_sees_the_gpu():
    assert torch.cuda.is_available()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "0"  # as the machine had it
    torch.set_float32_matmul_precision("high")  # what train.py does on a GPU


def test_precision_is_back_after_a_gpu_test():
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.cuda.is_available()
"""


def run_probe(tmp_path, pretend_gpu, workers="1"):
    for name in ("conftest.py", "pytest.ini"):
        shutil.copy(os.path.join(ROOT, "tests" if name == "conftest.py" else "", name), tmp_path / name)
    (tmp_path / "pretend_gpu.py").write_text(PRETEND_GPU)
    (tmp_path / "test_probe.py").write_text(PROBE)
    # the pretend machine has GPU 0; the CPU machine none, also where this suite itself runs on a GPU
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "0" if pretend_gpu else ""}
    args = ["-p", "pretend_gpu"] if pretend_gpu else []
    # workers: "1", a pytest-xdist worker, which the main process starts after loading conftest.py (the machine's
    # CUDA_VISIBLE_DEVICES must reach it), or "0", the tests in the main process. One worker is what pytest.ini's
    # `-n auto` gives the probe: --dist loadfile sends a file's tests to one worker, and the others (two more on
    # 2 cores, each importing the conftest's torch, datasets and model: ~7 s of CPU) would start and idle.
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-n", workers, "--strict-markers", "-rs",
                           "-p", "no:cacheprovider", "test_probe.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("workers", ["1", "0"])
def test_on_a_gpu_machine_only_marked_tests_see_the_gpu(tmp_path, workers):
    done = run_probe(tmp_path, pretend_gpu=True, workers=workers)
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_on_a_cpu_machine_marked_tests_skip_with_a_reason(tmp_path):
    done = run_probe(tmp_path, pretend_gpu=False)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and "2 passed, 1 skipped" in done.stdout, output
    assert "needs a CUDA GPU" in done.stdout
