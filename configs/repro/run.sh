#!/usr/bin/env bash
# The paper's headline on a CPU (docs/repro.md): train a tiny model per positional encoding at
# context 128 on the demo corpus mixed with synthetic passkey documents, then ask each for the pass
# key at 1x ... 64x its training length and write one comparison report.
#
#   bash configs/repro/run.sh                 # the full grid (about 30-40 minutes on 2 cores)
#   STEPS=5 LENGTHS=128,256 SAMPLES=2 OUT=/tmp/smoke bash configs/repro/run.sh   # a smoke run
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-runs/repro}              # run directories and the report
DATA=${DATA:-data/repro}
STEPS=${STEPS:-}                    # override configs/repro/base.toml's train.max_steps
LENGTHS=${LENGTHS:-1x,2x,4x,8x,16x,32x,64x}
SAMPLES=${SAMPLES:-20}
RUNS=${RUNS:-"nope rope rope@2 sinusoidal alibi alibi_ssmax bam bam@2 bam_ssmax"}  # name@seed

python prepare_fineweb.py --source demo --retrieval_fraction 0.5 --retrieval_length 128 --out_dir "$DATA"

dirs=()
for run in $RUNS; do
  name=${run%@*}; seed=1; [[ $run == *@* ]] && seed=${run#*@}
  dir="$OUT/${name}_seed$seed"
  extra=(--data.data_dir="$DATA" --train.seed="$seed" --log.out_dir="$dir")
  [[ -n $STEPS ]] && extra+=(--train.max_steps="$STEPS" --train.warmup_steps=0 --train.val_every=0)
  echo "== train $name (seed $seed) -> $dir"
  python train.py "configs/repro/$name.toml" "${extra[@]}"
  echo "== passkey $name (seed $seed)"
  python -m eval.passkey "$dir" --lengths "$LENGTHS" --samples "$SAMPLES" --depths equidistant \
      --stop_after_zero 0 --seed 0
  python -m eval.priors "$dir" || true   # NoPE/RoPE/sinusoidal have no prior: it says so and exits 0
  dirs+=("$dir")
done

python -m eval.report "${dirs[@]}" --out "$OUT/report.md" --title "Passkey retrieval past a 128-token training context (CPU)"
echo "report: $OUT/report.md"
