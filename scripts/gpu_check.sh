#!/usr/bin/env bash
# The whole GPU check in one command (for the lent device machine or any CUDA box):
# the demo on CUDA, the GPU tests, then the routing and MoE benchmarks; short tables come last.
#   bash scripts/gpu_check.sh [--quick]      (results under $OUT, else bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-bench/results}"
mkdir -p "$out"
python3 -m moe_route info
python3 -m moe_route demo --device cuda | tail -n 2
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -n 15
tests_rc=${PIPESTATUS[0]}
python3 bench/bench_routing.py --out "$out" "$@" > "$out/bench_routing.log" 2>&1
routing_rc=$?
python3 bench/bench_moe.py --out "$out" "$@" > "$out/bench_moe.log" 2>&1
moe_rc=$?
tail -n 40 "$out/bench_routing.log"
tail -n 45 "$out/bench_moe.log"
echo "gpu tests rc=$tests_rc, bench_routing rc=$routing_rc, bench_moe rc=$moe_rc"
exit $(( tests_rc || routing_rc || moe_rc ))
