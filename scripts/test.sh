#!/usr/bin/env bash
# The README's test command: scripts/setup.sh (what is missing is installed, GPT-2's ranks fetched), then the
# whole suite. Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast lane.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python -m pytest "$@"
