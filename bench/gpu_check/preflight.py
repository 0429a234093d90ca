"""The preflight: in about a second, before anything compiles, what the run needs of this machine: Python and
torch in the versions the repository supports, CUDA and the GPU (its name, memory, bf16, Triton), the prepared
data where train_run reads it, free disk for the checkpoints and compile caches. Every item is one line; a problem
is one line with its fix, and any problem stops the run before it starts (EXIT_PREFLIGHT): on a lent GPU machine
minutes are the scarce thing, and a run that cannot finish is better fixed than started."""

import glob
import importlib.util
import os
import platform
import re
import shutil
import sys

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from bench.gpu_check.common import ROOT
from train import PEAK_BF16_TFLOPS

GIB = 2**30
# The acceptance run's shapes (the 121M model's training at 48 x 512, a 256,000-token forward) in ~40 GiB;
# less only warns, since a section may still fit.
GPU_MEMORY_GIB = 40
# Checkpoints of the 121M model (weights and AdamW state, ~1.5 GB, two kept per run) and inductor's caches.
DISK_GIB = {"gpu": 10, "quick": 0.5}


def torch_requirement():
    """The torch line of requirements.txt ("torch>=2.11,<2.14"), the range the suite passes on."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            match = re.match(r"\s*torch\s*([<>=!~][^#;]*)", line)
            if match:
                return match.group(1).strip()
    return ""


def preflight(s, sections, work_dir):
    """(lines, problems): what was found, one line each, and the problems among them, each with its fix."""
    lines, problems = [], []

    def ok(line):
        lines.append(line)

    def problem(line):
        lines.append(f"PROBLEM: {line}")
        problems.append(line)

    version = platform.python_version()
    (ok if sys.version_info >= (3, 11) else problem)(
        f"Python {version}" + ("" if sys.version_info >= (3, 11) else ": the repository needs 3.11 or newer (tomllib)"))
    spec = torch_requirement()
    try:
        supported = Version(torch.__version__) in SpecifierSet(spec, prereleases=True)
    except InvalidSpecifier:
        supported = True
    (ok if supported else problem)(
        f"torch {torch.__version__} (requirements.txt: torch{spec})" + ("" if supported else
                                                                        f": install a torch{spec} build"))
    if s.cuda:
        gpu_items(s, ok, problem)
    else:
        ok(f"CPU ({platform.machine()}, {os.cpu_count()} cores): --quick, the targets are not judged")
    if "train_run" in sections:
        data_items(s, ok, problem)
    need = DISK_GIB["gpu" if s.cuda else "quick"]
    free = shutil.disk_usage(work_dir).free / GIB
    (ok if free >= need else problem)(
        f"{free:.1f} GiB free where the run works ({work_dir})" +
        ("" if free >= need else f": it needs ~{need} GiB (checkpoints, compile caches); free some or give --work_dir "
                                 f"a folder on a larger disk"))
    return lines, problems


def gpu_items(s, ok, problem):
    if torch.version.cuda is None:
        problem(f"torch {torch.__version__} is a CPU build: install the CUDA build of torch that matches the driver")
        return
    if not torch.cuda.is_available():
        problem(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the driver "
                f"(nvidia-smi) and CUDA_VISIBLE_DEVICES")
        return
    props = torch.cuda.get_device_properties(s.device)
    memory = props.total_memory / GIB
    ok(f"{props.name}, {memory:.0f} GiB, CUDA {torch.version.cuda}, compute capability {props.major}.{props.minor}")
    if memory < GPU_MEMORY_GIB:
        ok(f"warning: the acceptance run's shapes want ~{GPU_MEMORY_GIB} GiB; expect out-of-memory failures in "
           f"training and at 256K tokens (or run fewer --sections)")
    if not torch.cuda.is_bf16_supported():
        problem(f"{props.name} has no bf16: the acceptance run measures bf16 training; use an Ampere or newer GPU")
    if not any(key in props.name for key, _ in PEAK_BF16_TFLOPS):
        ok(f"warning: no published bf16 peak known for {props.name!r} (train.PEAK_BF16_TFLOPS): MFU is not "
           f"measured, and its target goes unmeasured")
    if s.compile_backend == "inductor" and importlib.util.find_spec("triton") is None:
        problem("triton is not installed: torch.compile's inductor and FlexAttention need it on a GPU; install "
                "the triton that matches this torch")


def data_items(s, ok, problem):
    train = glob.glob(os.path.join(s.data_dir, "*_train_*.bin"))
    val = glob.glob(os.path.join(s.data_dir, "*_val_*.bin"))
    shown = os.path.relpath(s.data_dir, ROOT) if s.data_dir.startswith(ROOT) else s.data_dir
    if train and val:
        size = sum(os.path.getsize(p) for p in train + val) / 2**20
        ok(f"prepared data: {shown}, {len(train)} training and {len(val)} validation shards ({size:.1f} MiB)")
    else:
        problem(f"no prepared data in {shown} (*_train_*.bin and *_val_*.bin): run `python -m bench.gpu_check.prepare` "
                f"on a machine with the requirements and bring data/gpu_check along (or name shards with --data_dir)")
