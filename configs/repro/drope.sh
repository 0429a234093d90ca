#!/usr/bin/env bash
# DroPE on the 5-digit grid (docs/repro.md, "DroPE: RoPE dropped after pretraining"): RoPE runs trained as the
# grid's are, recalibrated without RoPE (configs/repro/drope_*.toml: NoPE, NoPE + SSMax, BAM + SSMax at the ALiBi
# init, with its prior at 10x lr, and with its prior started flat), each against RoPE + YaRN on the same RoPE runs
# and against the same encoding trained from scratch for the same total steps (2,000 + 200).
#
#   bash configs/repro/drope.sh                          # everything; ~15 min per long run, ~3 per recalibration
#   SEEDS=1 TARGETS=drope_nope SCRATCH=nope bash configs/repro/drope.sh     # a part of it
#
# Like grid5.sh it resumes everything and keeps each finished run's small files in $RESULTS (committed), so the
# report is regenerated from them on any machine. The RoPE runs' checkpoints, which a recalibration starts from,
# stay in $SRC (not in git): a recalibration not yet kept on a machine without them trains its RoPE run again.
set -euo pipefail
cd "$(dirname "$0")/../.."

export DIGITS=5 LENGTHS=128,256,512,1024,2048,4096,8192 SAMPLES=20
export TOKENS=${TOKENS:-8388608} DATA=${DATA:-data/repro5}   # the grid's passkey documents (grid5.sh)
SRC=${SRC:-runs/repro5_drope_src}     # the RoPE runs, with their checkpoints
OUT=${OUT:-runs/repro5_drope}         # the recalibrations and the runs from scratch
RESULTS=${RESULTS:-docs/repro/runs5_drope}
REPORT=${REPORT:-docs/repro/report5_drope.md}
SEEDS=${SEEDS:-"1 2"}
PRETRAIN=2000                         # the grid's budget, which the RoPE runs train
TARGETS=${TARGETS:-"drope_nope drope_nope_ssmax drope_bam_ssmax drope_bam_ssmax_prior_lr drope_bam_ssmax_uniform"}
SCRATCH=${SCRATCH:-"nope nope_ssmax bam_ssmax"}   # configs/repro/<name>.toml from scratch at the same total steps
export JOBS=${JOBS:-2}
source configs/repro/passkey.sh
RECAL=$(python -c "from bam.config import load_config as c; print(c('configs/repro/drope_nope.toml').train.max_steps)")
TOTAL=$(( PRETRAIN + RECAL ))

runs() {  # NAMES...: every NAME@SEED
  local name seed
  for name in "$@"; do for seed in $SEEDS; do echo -n " $name@$seed"; done; done
}
recalibrations=$(to_run "$RESULTS" $(runs $TARGETS))
scratch=$(to_run "$RESULTS/scratch_$TOTAL" $(runs $SCRATCH))
sources=""  # a RoPE run is needed where a recalibration of its seed is still to run, or its own result is not kept
for seed in $SEEDS; do
  if [[ " $recalibrations " == *"@$seed "* ]] || [[ -n $(to_run "$RESULTS" "rope@$seed" 2>/dev/null) ]]; then
    sources+=" rope@$seed"
  fi
done

status=0
if [[ -n $sources ]]; then  # trained as the grid's RoPE runs; run.sh resumes from their checkpoints
  RUNS=${sources# } STEPS=$PRETRAIN OUT=$SRC bash configs/repro/run.sh || status=$?
  # YaRN at every length, as the grid evaluates its RoPE runs: the baseline a recalibration is compared with
  METHODS=yarn FINE_TUNE=0 OUT=$SRC bash configs/repro/rope_extensions.sh || status=$?
fi
if [[ -n $recalibrations ]]; then  # each from its seed's RoPE run, at the recalibration's own budget
  RUNS=$recalibrations INIT_FROM="$SRC/rope_seed{seed}" STEPS= OUT=$OUT bash configs/repro/run.sh || status=$?
fi
if [[ -n $scratch ]]; then  # apart from the recalibrations: the same config names at another budget
  RUNS=$scratch STEPS=$TOTAL OUT=$OUT/scratch_$TOTAL bash configs/repro/run.sh || status=$?
fi
collect "$SRC" "$RESULTS"
collect "$OUT" "$RESULTS"
collect "$OUT/scratch_$TOTAL" "$RESULTS/scratch_$TOTAL"

# Each recalibration against RoPE + YaRN on the same RoPE runs, against the same encoding from scratch for the same
# total steps, and the BAM recalibrations against NoPE's; each a pair of eval.report's variant names, made when both
# have a result. The grid's runs of those encodings at its own 2,000 steps are reported beside them.
shopt -s nullglob
has() { local found=("$@"); (( ${#found[@]} )); }  # GLOB...: some file matches
steps=$(python -c "print(f'{$TOTAL:,} steps')")
grid_dir=${GRID:-docs/repro/runs5}
scratch_name() {  # CONFIG LABEL: the report's name of CONFIG's runs from scratch. eval.report adds the budget to a
  # variant's name only where runs of it at another budget are reported too: here the grid's, if it has that config
  local found=("$grid_dir/$1"_seed*/)
  if (( ${#found[@]} )); then echo "$2, $steps"; else echo "$2"; fi
}
nope_scratch=$(scratch_name nope "nope")
nope_ssmax_scratch=$(scratch_name nope_ssmax "nope + ssmax")
bam_ssmax_scratch=$(scratch_name bam_ssmax "bam + ssmax")
scratch_dir=$RESULTS/scratch_$TOTAL
declare -A results_of=(  # each variant name below -> the glob of its results
  ["rope"]="$RESULTS/rope_seed*/eval/passkey.json"
  ["rope + YaRN auto"]="$RESULTS/rope_seed*/eval/passkey_yarn_auto.json"
  ["nope, DroPE"]="$RESULTS/drope_nope_seed*/eval/passkey.json"
  ["nope + ssmax, DroPE"]="$RESULTS/drope_nope_ssmax_seed*/eval/passkey.json"
  ["bam + ssmax, DroPE"]="$RESULTS/drope_bam_ssmax_seed*/eval/passkey.json"
  ["bam + ssmax, prior lr x10, DroPE"]="$RESULTS/drope_bam_ssmax_prior_lr_seed*/eval/passkey.json"
  ["bam + ssmax, init uniform, DroPE"]="$RESULTS/drope_bam_ssmax_uniform_seed*/eval/passkey.json"
  ["$nope_scratch"]="$scratch_dir/nope_seed*/eval/passkey.json"
  ["$nope_ssmax_scratch"]="$scratch_dir/nope_ssmax_seed*/eval/passkey.json"
  ["$bam_ssmax_scratch"]="$scratch_dir/bam_ssmax_seed*/eval/passkey.json")
pairs=("nope, DroPE" "rope + YaRN auto" "nope, DroPE" "$nope_scratch" "nope, DroPE" "rope"
       "nope + ssmax, DroPE" "rope + YaRN auto" "nope + ssmax, DroPE" "$nope_ssmax_scratch"
       "nope + ssmax, DroPE" "nope, DroPE"
       "bam + ssmax, DroPE" "rope + YaRN auto" "bam + ssmax, DroPE" "$bam_ssmax_scratch"
       "bam + ssmax, DroPE" "nope + ssmax, DroPE"
       "bam + ssmax, prior lr x10, DroPE" "rope + YaRN auto" "bam + ssmax, prior lr x10, DroPE" "$bam_ssmax_scratch"
       "bam + ssmax, prior lr x10, DroPE" "bam + ssmax, DroPE"
       "bam + ssmax, init uniform, DroPE" "rope + YaRN auto" "bam + ssmax, init uniform, DroPE" "$bam_ssmax_scratch"
       "bam + ssmax, init uniform, DroPE" "nope + ssmax, DroPE" "bam + ssmax, init uniform, DroPE" "bam + ssmax, DroPE")
compare=()
for (( i = 0; i < ${#pairs[@]}; i += 2 )); do
  has ${results_of[${pairs[i]}]} && has ${results_of[${pairs[i + 1]}]} \
    && compare+=(--compare "${pairs[i]}" "${pairs[i + 1]}")
done
kept=("$RESULTS"/*_seed*/ "$scratch_dir"/*_seed*/)
(( ${#kept[@]} )) || { echo "error: nothing finished in $RESULTS yet" >&2; exit 1; }
grid=()
for name in $SCRATCH; do grid+=("$grid_dir/${name}"_seed*/); done  # the same at 2,000 steps
python -m eval.report "${kept[@]}" ${grid[@]+"${grid[@]}"} --out "$REPORT" --no_run_plots \
    ${compare[@]+"${compare[@]}"} \
    --title "DroPE at 5-digit keys: RoPE dropped after $PRETRAIN steps, recalibrated for $RECAL (CPU), seeds aggregated"
echo "report: $REPORT (from $RESULTS)"
exit $status
