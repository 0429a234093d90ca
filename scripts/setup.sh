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
# pip only where a requirement is not met (it takes seconds to find that all are), and then with its output.
unmet=$(python - requirements.txt requirements-downstream.txt <<'PY'
import re
import sys
from importlib.metadata import PackageNotFoundError, version


def unmet(line):
    try:
        installed = version(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)[0])
    except PackageNotFoundError:
        return True
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare environment, where pip runs anyway and checks every version
        return False
    return not Requirement(line).specifier.contains(installed, prereleases=True)


lines = [line.split("#")[0].strip() for path in sys.argv[1:] for line in open(path, encoding="utf-8")]
print("; ".join(line for line in lines if line and not line.startswith("-") and unmet(line)))
PY
)
if [[ -n $unmet ]]; then
    echo "setup: installing requirements.txt and requirements-downstream.txt (not met: $unmet)"
    python -m pip install -r requirements.txt -r requirements-downstream.txt
fi
python -m bam.fetch
