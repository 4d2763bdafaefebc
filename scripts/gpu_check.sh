#!/usr/bin/env bash
# The whole GPU check (for the lent device machine or any CUDA box), in two parts that each fit
# a 10-minute job:
#   bash scripts/gpu_check.sh tests     the demo on CUDA, then every GPU-marked test file, the
#                                       files in parallel (compiles are CPU-bound), one log each
#   bash scripts/gpu_check.sh bench     routing, forward and training benchmarks, short tables
#   bash scripts/gpu_check.sh all       both (default)
# Extra arguments go to the benchmark scripts (e.g. --quick). Results under $OUT, else
# bench/results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
part="${1:-all}"
[ $# -gt 0 ] && shift
out="${OUT:-bench/results}"
mkdir -p "$out"
rc=0

if [ "$part" = tests ] || [ "$part" = all ]; then
    python3 -m moe_route info
    python3 -m moe_route demo --device cuda | tail -n 2
    pids=()
    files=(tests/test_gpu*.py tests/test_compile.py)
    for f in "${files[@]}"; do
        name=$(basename "$f" .py)
        python3 -m pytest -q -m "gpu or not gpu" "$f" -p no:cacheprovider > "$out/$name.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        file_rc=$?
        name=$(basename "${files[$i]}" .py)
        echo "$name: rc=$file_rc, $(tail -n 1 "$out/$name.log")"
        grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -n 10
        rc=$(( rc || file_rc ))
    done
fi

if [ "$part" = bench ] || [ "$part" = all ]; then
    for b in bench_routing bench_moe bench_train; do
        python3 "bench/$b.py" --out "$out" "$@" > "$out/$b.log" 2>&1
        b_rc=$?
        echo "== $b (rc=$b_rc)"
        grep -v -i warning "$out/$b.log" | tail -n 25
        rc=$(( rc || b_rc ))
    done
fi
exit $rc
