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
"""

import os

import pytest
import torch

# Asked before CUDA_VISIBLE_DEVICES is emptied below: the CUDA runtime reads the variable when it first counts
# the devices, so this process keeps the GPUs it has.
CUDA_PRESENT = torch.cuda.is_available()
VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""


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
