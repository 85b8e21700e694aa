#!/usr/bin/env bash
# Issue 41's one-GPU table in one device call: the trainer's whole step (benchmarks/engines_7b.py --nproc 1,
# seq 2048, 32K tokens a step, CUDA graphs, one profiled step) for mamba2-1.3b and hybrid-1.3b at micro-batch 4
# and 8, bf16 and FP8, the opt-in SSD dB / dC split, then the peers (benchmarks/peers.py; mamba_ssm from .peers/).
# Every row is appended to OUT_DIR/rows.jsonl and every log to OUT_DIR/log.txt: the device returns at most 8
# files from $OUT. Rows start while DEADLINE_SECONDS (from the script's start) leaves room for them; the peers
# need ~200 s on a fresh machine (mamba_ssm's autotuning), so they run first when PEERS_FIRST=1; PEER_ROWS
# picks them (default "mamba_ssm llama").
#
#   source benchmarks/device_env.sh
#   bash benchmarks/one_gpu_step.sh OUT_DIR [DEADLINE_SECONDS [ROW ...]]
#
# ROWs (optional) replace the default table, in order: "CONFIG MICRO_BATCH [EXTRA_KEYS|- [ENV=VALUE ...]]" (one
# quoted argument each; EXTRA_KEYS starts with a comma, - for none) or "peers", e.g.
#   bash benchmarks/one_gpu_step.sh $OUT 560 peers "mamba2-1.3b 8" "mamba2-1.3b 8 ,train.cast_weights_once=true"
set -u
out=${1:?usage: one_gpu_step.sh OUT_DIR [DEADLINE_SECONDS [ROW ...]]}
deadline=${2:-560}
mkdir -p "$out"
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
peers() {
    local t; t=$(left); [ "$t" -lt 150 ] && { echo "peers: skipped, ${t}s left" >> "$out/log.txt"; return; }
    PYTHONPATH=${PYTHONPATH:-}:$(pwd)/.peers timeout $(( t < 240 ? t : 240 )) python3 benchmarks/peers.py \
        --rows ${PEER_ROWS:-mamba_ssm llama} --steps 5 >> "$out/rows.jsonl" 2>> "$out/log.txt"
}
# row CONFIG MICRO_BATCH [EXTRA_KEYS] [ENV=VALUE ...]: one trainer run, its JSON line tagged with the env set
row() {
    local cfg=$1 mb=$2 extra=${3:-} t; shift $(( $# >= 3 ? 3 : $# ))
    t=$(left); [ "$t" -lt 50 ] && { echo "row $cfg $mb $extra $*: skipped, ${t}s left" >> "$out/log.txt"; return; }
    env "$@" timeout "$t" python3 benchmarks/engines_7b.py --nproc 1 --steps 6 --timed 3 --profile-step 3 \
        --config "configs/$cfg.yaml" --accum $(( 16 / mb )) --timeout "$t" \
        --layouts "train.micro_batch=$mb,train.seq_len=2048,train.cuda_graph=true$extra" \
        --out "$out/rows.tmp" >> "$out/log.txt" 2>&1
    [ -f "$out/rows.tmp" ] && python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'env': sys.argv[1:]})) for l in open('$out/rows.tmp')]" "$@" >> "$out/rows.jsonl"
    rm -f "$out/rows.tmp"
    echo "row $cfg $mb $extra $*: done, $(left)s left" >> "$out/log.txt"
}
if [ $# -gt 2 ]; then
    specs=("${@:3}")
    for spec in "${specs[@]}"; do
        if [ "$spec" = peers ]; then peers; continue; fi
        read -r -a f <<< "$spec"
        [ "${f[2]:--}" = - ] && f[2]=""
        row "${f[0]}" "${f[1]}" "${f[2]:-}" "${f[@]:3}"
    done
    echo "done, $(left)s left" >> "$out/log.txt"
    exit 0
fi
[ "${PEERS_FIRST:-0}" = 1 ] && peers
row mamba2-1.3b 4
row hybrid-1.3b 4
row mamba2-1.3b 4 "" MEGASSM_SSD_DBC_SPLIT=2
row mamba2-1.3b 4 "" MEGASSM_SSD_DBC_SPLIT=4
row mamba2-1.3b 8
row hybrid-1.3b 8
row mamba2-1.3b 4 ",train.fp8=true"
row hybrid-1.3b 4 ",train.fp8=true"
[ "${PEERS_FIRST:-0}" = 1 ] || peers
echo "done, $(left)s left" >> "$out/log.txt"
