#!/usr/bin/env bash
# RoPE's usual ways past its training length, on the RoPE runs of a repro grid (docs/repro.md):
#  - at evaluation only, on every $OUT/rope_seed*: RoPE-local (keys within the last CONTEXT tokens),
#    PI (linear), NTK-aware and YaRN scaled per length (--rope_factor auto: length / CONTEXT), and
#    dynamic NTK, which scales itself with the length;
#  - context extension: $FT_FROM's weights trained on at 4x the context with YaRN x4
#    (configs/repro/rope_yarn_ft.toml, train.init_from), then asked at the same lengths.
#
#   DIGITS=5 OUT=runs/repro5 bash configs/repro/rope_extensions.sh   # after run.sh trained rope, rope@2
#   LENGTHS=128,256 SAMPLES=2 FT_STEPS=2 FT_TOKENS=200000 ... bash configs/repro/rope_extensions.sh   # smoke
#   METHODS="linear yarn" FINE_TUNE=0 ... bash configs/repro/rope_extensions.sh   # PI and YaRN only (grid5.sh)
#
# Only runs the grid has finished are evaluated (their passkey result is complete), so this may run while
# run.sh still trains other seeds. JOBS evaluations run side by side (2 by default, as run.sh trains).
# Each evaluation writes its own file (RUN/eval/passkey_yarn_auto.json, ...), so eval.report over the
# runs gives every method a row of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-runs/repro}
DIGITS=${DIGITS:-2}                                   # as the grid was trained (run.sh's DIGITS)
CONTEXT=${CONTEXT:-128}                               # the grid's training context
LENGTHS=${LENGTHS:-128,256,512,1024,2048,4096,8192}   # in tokens: 1x ... 64x CONTEXT, for every run alike
SAMPLES=${SAMPLES:-20}
FT_FROM=${FT_FROM:-$OUT/rope_seed1}                   # the run whose weights the fine-tune starts from
FT_DATA=${FT_DATA:-data/repro_$(( 4 * CONTEXT ))_${DIGITS}digits}
FT_TOKENS=${FT_TOKENS:-2097152}                       # more than 400 steps x 4,096 tokens
FT_STEPS=${FT_STEPS:-}                                # override rope_yarn_ft.toml's train.max_steps
METHODS=${METHODS:-"window linear ntk yarn dynamic_ntk"}  # window: RoPE-local; linear = PI; *_auto factors
FINE_TUNE=${FINE_TUNE:-1}                             # 0: the evaluations only, no YaRN x4 fine-tune
JOBS=${JOBS:-2}                                       # evaluations at a time, each on (cores / JOBS) threads
for method in $METHODS; do
  [[ $method =~ ^(window|linear|ntk|yarn|dynamic_ntk)$ ]] || {
    echo "error: METHODS has $method; allowed: window linear ntk yarn dynamic_ntk" >&2; exit 1; }
done

shopt -s nullglob
rope_runs=("$OUT"/rope_seed*/)
(( ${#rope_runs[@]} )) || { echo "error: no $OUT/rope_seed*/ run; train them first (configs/repro/run.sh)" >&2; exit 1; }
(( ! FINE_TUNE )) || [[ -d $FT_FROM ]] || { echo "error: FT_FROM=$FT_FROM is not a run directory" >&2; exit 1; }

source configs/repro/passkey.sh  # grid_passkey: eval.passkey at the grid's settings, kept when complete
CORES=$(python -c "from bam.cli import usable_cores; print(usable_cores())")
THREADS=$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))

evaluate() {  # DIR METHOD: the run's passkey evaluation with the method, RUN/eval/passkey_<method>.json
  local dir=$1 method=$2
  case $method in
    window) grid_passkey "$dir" "passkey_window$CONTEXT" --window "$CONTEXT" --no_progress ;;
    # factor 1: the scale is (length / CONTEXT), per forward
    dynamic_ntk) grid_passkey "$dir" passkey_dynamic_ntk --rope_scaling dynamic_ntk --no_progress ;;
    *) grid_passkey "$dir" "passkey_${method}_auto" --rope_scaling "$method" --rope_factor auto --no_progress ;;
  esac
}

# JOBS evaluations side by side, each printing to its own log (RUN/eval/passkey_<method>.log), shown whole
# when it ends, so that two evaluations' tables do not interleave
logs=() pids=() failed=0
for dir in "${rope_runs[@]}"; do
  dir=${dir%/}
  if ! passkey_done "$dir/eval/passkey.json"; then
    echo "== $dir: not finished by the grid (no complete eval/passkey.json), skipped"
    continue
  fi
  echo "== $dir: $METHODS"
  for method in $METHODS; do
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || failed=1; done
    logs+=("$dir/eval/passkey_$method.log")
    { export OMP_NUM_THREADS=$THREADS; evaluate "$dir" "$method"; } > "${logs[-1]}" 2>&1 &
    pids+=($!)
  done
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=1
  cat "${logs[$i]}" && rm "${logs[$i]}"
done
(( failed )) && { echo "error: an evaluation failed (its output above)" >&2; exit 1; }
(( FINE_TUNE )) || { echo "done: results in $OUT/rope_seed*/eval"; exit 0; }

echo "== fine-tune $FT_FROM at $(( 4 * CONTEXT )) tokens with YaRN x4"
python prepare_fineweb.py --source retrieval --retrieval_length $(( 4 * CONTEXT )) \
    --retrieval_min_length $(( 4 * CONTEXT )) --retrieval_filler garbage --key_digits "$DIGITS" \
    --max_tokens "$FT_TOKENS" --out_dir "$FT_DATA"
ft=$OUT/rope_yarn_ft_seed1
extra=()
[[ -n $FT_STEPS ]] && extra+=(--train.max_steps="$FT_STEPS")
[[ -n $FT_STEPS ]] && (( FT_STEPS < 100 )) && extra+=(--train.warmup_steps=0)  # a smoke run: no warmup
python train.py configs/repro/rope_yarn_ft.toml --train.init_from="$FT_FROM" --data.data_dir="$FT_DATA" \
    --log.out_dir="$ft" --resume "${extra[@]}"
grid_passkey "$ft" passkey --no_progress
echo "done: results in $OUT/rope_seed*/eval and $ft/eval; python -m eval.report $OUT/*/ compares them"
