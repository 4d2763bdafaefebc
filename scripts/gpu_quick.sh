#!/usr/bin/env bash
# A focused GPU check for a session's changes: chosen test files in parallel (one log each,
# summary at the end), then the bench stages given after "--" (alone, for clean host timings).
#   bash scripts/gpu_quick.sh tests/test_gpu_host.py tests/test_gpu_layer.py -- --stages host --quick
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-bench/results}"
mkdir -p "$out/logs"
files=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do files+=("$1"); shift; done
[ $# -gt 0 ] && shift
pids=()
for f in "${files[@]}"; do
    python3 -m pytest -q -m "gpu or not gpu" "$f" -p no:cacheprovider --tb=short \
        > "$out/logs/$(basename "$f" .py).log" 2>&1 &
    pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; r=$?
    f=${files[$i]}
    echo "$(basename "$f"): rc=$r, $(tail -n 1 "$out/logs/$(basename "$f" .py).log")"
    grep -E "^(FAILED|ERROR)" "$out/logs/$(basename "$f" .py).log" | head -n 10
    rc=$(( rc || r ))
done
if [ $# -gt 0 ]; then
    python3 -m moe_route bench --out "$out/bench" "$@" > "$out/bench.log" 2>&1
    echo "bench rc=$?"
    grep -v -i warning "$out/bench.log" | tail -n 60
fi
exit $rc
