# Sourced by run.sh, rope_extensions.sh, grid5.sh and drope.sh: the grid's passkey evaluation, which a rerun of
# the grid keeps when it is already complete, so one command carries a grid across interruptions and sessions;
# and what a grid keeps of its finished runs. Reads LENGTHS, SAMPLES and DIGITS.

passkey_done() {  # FILE: a results file that is complete at the lengths, samples and digits asked for now
  python - "$1" "$LENGTHS" "$SAMPLES" "$DIGITS" <<'PY' 2>/dev/null
import json, sys
path, lengths, samples, digits = sys.argv[1:]
r = json.load(open(path))
s = r["settings"]
asked = sorted(round(float(x[:-1]) * s["block_size"]) if x.endswith("x") else int(x) for x in lengths.split(","))
sys.exit(0 if r["complete"] and s["lengths"] == asked and s["samples"] == int(samples)
         and s["digits"] == int(digits) and s["seed"] == 0 else 1)
PY
}

grid_passkey() {  # RUN NAME [eval.passkey options]: RUN/eval/NAME.json at the grid's settings, unless complete
  local dir=$1 name=$2
  shift 2
  if passkey_done "$dir/eval/$name.json"; then
    echo "== passkey: $dir/eval/$name.json complete, kept"
    return 0
  fi
  echo "== passkey: $dir/eval/$name.json"
  python -m eval.passkey "$dir" --name "$name" --lengths "$LENGTHS" --samples "$SAMPLES" --digits "$DIGITS" \
      --depths equidistant --stop_after_zero 0 --seed 0 "$@"
}

diverged() {  # RUN: train.py's divergence guard stopped it (the last row of its metrics.jsonl says so)
  [[ $(tail -n 1 "$1/metrics.jsonl" 2>/dev/null) == *'"diverged"'* ]]
}

collect() {  # OUT RESULTS: copy every finished run's small files from OUT to RESULTS (grid5.sh, drope.sh). A run is
  # finished when its passkey is, or when train.py's divergence guard stopped it (the last row of its
  # metrics.jsonl): that is a result too, which the report's training section shows with its loss curve
  local out=$1 results=$2 dir name file
  for dir in "$out"/*_seed*/; do
    [[ -d $dir ]] || continue
    dir=${dir%/}; name=${dir##*/}
    passkey_done "$dir/eval/passkey.json" || diverged "$dir" || continue
    mkdir -p "$results/$name/eval"
    cp "$dir/config.toml" "$dir/metrics.jsonl" "$results/$name/"
    for file in "$dir"/eval/*.json; do
      [[ ${file##*/} == passkey* ]] && ! passkey_done "$file" && continue  # incomplete: not the grid's yet
      cp "$file" "$results/$name/eval/"
    done
  done
}

to_run() {  # RESULTS RUN...: the RUNs (name@seed) RESULTS does not keep finished, on one line (stdout); the
  # others named on stderr. A run kept there is done, even on a machine without its checkpoints.
  local results=$1 run name seed todo=""
  shift
  for run in "$@"; do
    name=${run%@*}; seed=1; [[ $run == *@* ]] && seed=${run#*@}
    if passkey_done "$results/${name}_seed$seed/eval/passkey.json"; then
      echo "== $run: kept in $results" >&2
    elif diverged "$results/${name}_seed$seed"; then
      echo "== $run: diverged, kept in $results (its metrics.jsonl says where)" >&2
    else
      todo+=" $run"
    fi
  done
  echo "${todo# }"
}
