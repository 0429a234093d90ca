#!/usr/bin/env bash
# The README's quickstart from a fresh clone: scripts/setup.sh (what is missing is installed, GPT-2's ranks
# fetched), then NoPE, RoPE and BAM + SSMax trained side by side on synthetic passkey documents and asked for
# the key at 1x ... 64x their training length (configs/repro/run.sh; the report lands in runs/repro/).
# RUNS, JOBS and run.sh's other settings can be given as for run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RUNS=${RUNS:-"nope rope bam_ssmax_uniform"} JOBS=${JOBS:-3} exec bash configs/repro/run.sh
