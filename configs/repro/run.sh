#!/usr/bin/env bash
# The paper's headline on a CPU (docs/repro.md): train a tiny model per positional encoding at
# context 128 on synthetic passkey documents, then ask each for the pass key at 1x ... 64x its
# training length and write one comparison report.
#
#   bash configs/repro/run.sh                 # the full grid (about 35 minutes on 2 cores)
#   STEPS=5 LENGTHS=128,256 SAMPLES=2 OUT=/tmp/smoke bash configs/repro/run.sh   # a smoke run
#   RUNS="nope bam_ssmax_prior_lr" DIGITS=5 STEPS=2000 TOKENS=8388608 DATA=data/repro5 OUT=runs/repro5 \
#       bash configs/repro/run.sh            # 5-digit keys: an induction copy, not only a lookup
#
# Every step resumes: a run with checkpoints continues from the newest one (train.py --resume), a
# passkey result that is complete for the same lengths, samples and digits is kept, and so are the
# priors' figures drawn after the newest checkpoint, so the same command carries a grid across
# interruptions and sessions.
#
# JOBS runs train at a time, each on (cores / JOBS) threads: two single-threaded runs get more done
# on 2 cores than one run on both. With JOBS > 1 each run's progress bar goes to $OUT/<run>.log
# (`tail -f runs/repro/*.log` to watch); with JOBS=1 it goes to the terminal.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-runs/repro}              # run directories, logs and the report
DATA=${DATA:-data/repro}
STEPS=${STEPS:-}                    # override configs/repro/base.toml's train.max_steps (800)
LENGTHS=${LENGTHS:-1x,2x,4x,8x,16x,32x,64x}
SAMPLES=${SAMPLES:-20}
RUNS=${RUNS:-"nope rope rope@2 sinusoidal alibi alibi_ssmax bam bam@2 bam_ssmax bam_ssmax@2
              bam_ssmax_prior_lr bam_ssmax_prior_lr@2"}  # configs/repro/<name>.toml, @seed (default 1)
JOBS=${JOBS:-2}
DIGITS=${DIGITS:-2}                 # pass key digits, in training and evaluation alike (docs/repro.md)
TRAIN_ARGS=${TRAIN_ARGS:-}          # more train.py options for every run, e.g. "--train.spike_threshold=0"
INIT_FROM=${INIT_FROM:-}            # train.init_from of every run, {seed} its seed: DroPE's recalibration (drope.sh)
for run in $RUNS; do  # every name checked before any work starts
  [[ -f configs/repro/${run%@*}.toml ]] || { echo "error: no configs/repro/${run%@*}.toml (a name in RUNS)" >&2; exit 1; }
done
CORES=$(python -c "from bam.cli import usable_cores; print(usable_cores())")
THREADS=$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))

# Documents of exactly 128 tokens, so every training row is one whole document. 4M tokens are more
# than base.toml's 800 steps x 4,096 tokens; longer runs (STEPS) may want more (TOKENS).
TOKENS=${TOKENS:-4194304}
python prepare_fineweb.py --source retrieval --retrieval_length 128 --retrieval_min_length 128 \
    --retrieval_filler garbage --key_digits "$DIGITS" --max_tokens "$TOKENS" --out_dir "$DATA"

source configs/repro/passkey.sh  # grid_passkey: eval.passkey at the grid's settings, kept when complete

one_run() {  # name seed dir: train, then passkey and the learned priors; stops at the first failure
  local name=$1 seed=$2 dir=$3
  local extra=(--data.data_dir="$DATA" --train.seed="$seed" --log.out_dir="$dir")
  [[ -n $STEPS ]] && extra+=(--train.max_steps="$STEPS")
  [[ -n $INIT_FROM ]] && extra+=(--train.init_from="${INIT_FROM//\{seed\}/$seed}")
  local more; read -r -a more <<< "$TRAIN_ARGS"
  extra+=(${more[@]+"${more[@]}"})
  [[ -n $STEPS ]] && (( STEPS < 100 )) && extra+=(--train.warmup_steps=0)  # a smoke run: no warmup
  export OMP_NUM_THREADS=$THREADS
  # `|| return 1` on every step: bash ignores set -e inside a function called from an `if`.
  echo "== train $name (seed $seed) -> $dir"
  python train.py "configs/repro/$name.toml" "${extra[@]}" --resume || return 1
  grid_passkey "$dir" passkey || return 1
  if priors_done "$dir"; then
    echo "== priors: $dir/eval/priors.json newer than the newest checkpoint, kept"
  else
    python -m eval.priors "$dir" || return 1  # NoPE/RoPE/sinusoidal have no prior: it says so, exits 0
  fi
}

priors_done() {  # DIR: eval.priors' results were drawn from the run's newest checkpoint (a rerun keeps them)
  local newest
  newest=$(ls -td "$1"/checkpoints/step_* 2>/dev/null | head -n 1)
  [[ -n $newest && -f $1/eval/priors.json && $1/eval/priors.json -nt $newest ]]
}

logged_run() {  # one_run with its output in <dir>.log; on failure, the log's end on stderr
  if ! one_run "$@" > "$3.log" 2>&1; then
    echo "error: $1 (seed $2) failed; the end of $3.log:" >&2
    tail -n 5 "$3.log" >&2
    return 1
  fi
  echo "== $1 (seed $2) done [$(( SECONDS - started ))s]"
}

mkdir -p "$OUT"
dirs=() pids=() failed=0 started=$SECONDS
for run in $RUNS; do
  name=${run%@*}; seed=1; [[ $run == *@* ]] && seed=${run#*@}
  dir="$OUT/${name}_seed$seed"
  dirs+=("$dir")
  if (( JOBS == 1 )); then
    one_run "$name" "$seed" "$dir" || exit 1
    continue
  fi
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || failed=1; done
  echo "== $name (seed $seed): started, log in $dir.log [$(( SECONDS - started ))s]"
  logged_run "$name" "$seed" "$dir" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done  # every run's status, also those wait -n saw
(( failed )) && { echo "error: a run failed (above); the report is not written" >&2; exit 1; }

python -m eval.report "${dirs[@]}" --out "$OUT/report.md" \
    --title "Passkey retrieval past a 128-token training context (CPU)"
echo "report: $OUT/report.md [$(( SECONDS - started ))s]"
