# Sourced by run.sh and rope_extensions.sh: the grid's passkey evaluation, which a rerun of the grid keeps
# when it is already complete, so one command carries a grid across interruptions and sessions.
# Reads LENGTHS, SAMPLES and DIGITS.

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
