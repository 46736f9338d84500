#!/usr/bin/env bash
# The suite under load: N passes in a row of the given tests (default: the end-to-end fault test and the
# Ray tests) while a CPU hog keeps every core busy. Each pass's pytest output goes to runs/stress/;
# a line per pass and a summary are printed. Exit status 1 if any pass failed.
#
#   tests/stress.sh [-n N] [pytest args ...]        (make stress does tests/stress.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

passes=10
if [ "${1:-}" = "-n" ]; then passes=$2; shift 2; fi
if [ $# -eq 0 ]; then set -- tests/test_e2e_faults.py tests/test_ray_launcher.py; fi
logs=runs/stress/$(date +%Y%m%d-%H%M%S)
mkdir -p "$logs"

hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_hogs EXIT
for _ in $(seq "$(nproc)"); do
  python3 -c 'while True: pass' &
  hogs+=($!)
done
echo "stress: ${#hogs[@]} CPU hogs (pids ${hogs[*]}); $passes passes of: $*; logs in $logs"

failed=0
for i in $(seq "$passes"); do
  started=$SECONDS
  if .venv/bin/python -m pytest -q -p no:cacheprovider "$@" >"$logs/pass-$i.log" 2>&1; then verdict=passed
  else verdict=FAILED; failed=$((failed + 1)); fi
  echo "pass $i/$passes: $verdict in $((SECONDS - started)) s: $(tail -n 1 "$logs/pass-$i.log")"
done
echo "stress: $((passes - failed))/$passes passes green under a ${#hogs[@]}-process CPU hog"
[ "$failed" -eq 0 ]
