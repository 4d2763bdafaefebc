#!/usr/bin/env bash
# Session baseline on the lent GPU: the transformers client (prefill / decode per experts
# implementation), the host stage at decode sizes, the forward at the largest standard shapes.
#   OUT=... bash scripts/baseline_probe.sh [hf] [host] [forward]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-bench/results}"
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(hf host forward)
for part in "${parts[@]}"; do
    case "$part" in
    hf) python3 bench/bench_hf.py > "$out/hf.log" 2>&1; echo "hf rc=$?"; tail -n 8 "$out/hf.log" ;;
    host) python3 -m moe_route bench --stages host --quick --shapes qwen3 deepseek \
              --tokens 1 8 64 --custom 1,2048,1024,64,8 --custom 64,2048,1024,64,8 --no-loop \
              --no-plots --out "$out/host" > "$out/host.log" 2>&1
          echo "host rc=$?"; grep -v -i "warning" "$out/host.log" | tail -n 70 ;;
    forward) python3 -m moe_route bench --stages forward --shapes qwen3 deepseek --tokens 16384 32768 \
              --no-loop --no-plots --no-alt-backends --out "$out/fwd" > "$out/fwd.log" 2>&1
          echo "forward rc=$?"; grep -v -i "warning" "$out/fwd.log" | tail -n 40 ;;
    esac
done
