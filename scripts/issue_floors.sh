#!/usr/bin/env bash
# The open issues' floors measured again in one job (GPU), each part fitting a 10-minute job:
#   bash scripts/issue_floors.sh host    the host stage at the decode sizes of olmoe-1b-7b,
#                                        qwen3-30b-a3b and deepseek-v3 (issue 11's per-op
#                                        ratios, eager against graph at deepseek-v3's sizes),
#                                        a small op's host time layer by layer, the
#                                        transformers client against "eager" and "grouped_mm"
#   bash scripts/issue_floors.sh train   train + backward stages at qwen3-30b-a3b T=32768
#                                        (issue 12's 480 TFLOP/s floor, the backward GEMMs
#                                        at a large shape), then at the three quick
#                                        training shapes
# Logs and the suite's JSON under $OUT (else bench/results); a short summary at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
out="${OUT:-bench/results}"
mkdir -p "$out/bench"
rc=0
run() {  # name, command...: log to $out/name.log, keep the worst exit status
    local name=$1
    shift
    "$@" > "$out/$name.log" 2>&1
    local r=$?
    echo "$name: rc=$r"
    rc=$(( rc || r ))
}
case "${1:-host}" in
host)
    run host python3 -m moe_route bench --stages host --shapes olmoe qwen3 deepseek decode \
        --name host --out "$out/bench"
    run op_layers python3 scripts/op_layers.py --tokens 1
    run hf python3 bench/bench_hf.py --rounds 3
    grep -v -i warning "$out/host.log" | tail -n 45
    tail -n 30 "$out/op_layers.log"
    tail -n 12 "$out/hf.log"
    ;;
train)
    # (the backward stage skips the models' larger standard sizes: qwen3's T=32768 as custom)
    run train_large python3 -m moe_route bench --stages train backward --shapes qwen3 \
        --tokens 32768 --custom 32768,2048,768,128,8 --no-loop --name train_large \
        --out "$out/bench"
    run train python3 -m moe_route bench --stages train backward --shapes mixtral qwen3 \
        deepseek --quick --no-loop --name train --out "$out/bench"
    grep -v -i warning "$out/train_large.log" | tail -n 25
    grep -v -i warning "$out/train.log" | tail -n 45
    ;;
*)
    echo "usage: $0 host|train" >&2
    exit 2
    ;;
esac
exit $rc
