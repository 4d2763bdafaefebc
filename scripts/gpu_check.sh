#!/usr/bin/env bash
# The whole GPU check in one command (for the lent device machine or any CUDA box):
# GPU tests, the CLI on CUDA, then the routing benchmark; a short table comes last.
#   bash scripts/gpu_check.sh [--quick] [--sweep]      (results under $OUT or bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-bench/results}"
mkdir -p "$out"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m moe_route info
python3 -m moe_route demo --device cuda | tail -n 3
python3 -m pytest -q -m gpu tests -x -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}
python3 bench/bench_routing.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -n 80
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
