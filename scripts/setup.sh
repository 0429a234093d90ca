#!/usr/bin/env bash
# Everything the repository needs, in the active Python environment (a fresh venv is best), then the set-up
# step: torch when the environment has none, both requirements files, and `python -m bam.fetch`, which
# fetches what the code would otherwise download on first use (GPT-2's tokenizer ranks). With everything
# there it prints nothing and takes a few seconds; scripts/test.sh and scripts/quickstart.sh start with it.
#
# torch is installed only where there is none, so a GPU machine installs the CUDA build that matches its
# driver first (pytorch.org's selector gives the command) and keeps it. Where there is none this installs
# TORCH_VERSION from pip's index: on Linux, PyPI serves the CUDA build (a few GB; it runs on a CPU too), and
# `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu` first gets the CPU build alone.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0  # the version the suite runs on

if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "setup: no torch in $(python -c 'import sys; print(sys.prefix)'), installing torch==$TORCH_VERSION"
    python -m pip install "torch==$TORCH_VERSION"
fi
# pip's own output only while it installs something: its lines for each requirement already there are noise
# in every later run.
missing=$(python - requirements.txt requirements-downstream.txt <<'PY'
import re, sys
from importlib.metadata import PackageNotFoundError, version

for path in sys.argv[1:]:
    for line in open(path, encoding="utf-8"):
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line.strip())
        if name:
            try:
                version(name[0])
            except PackageNotFoundError:
                print(name[0], end=" ")
PY
)
if [[ -n $missing ]]; then
    echo "setup: installing requirements.txt and requirements-downstream.txt (missing: ${missing% })"
    python -m pip install -r requirements.txt -r requirements-downstream.txt
else
    python -m pip install --quiet -r requirements.txt -r requirements-downstream.txt  # versions, if any moved
fi
python -m bam.fetch
