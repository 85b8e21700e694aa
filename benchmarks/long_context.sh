#!/usr/bin/env bash
# Issue 64's table in one device call: training tokens/s and peak memory at sequence lengths 2K-32K, the same 32K
# tokens a step (micro-batch x accumulation x length), for mamba2-1.3b and hybrid-1.3b (the trainer itself,
# benchmarks/engines_7b.py --nproc 1, CUDA graphs, the stdlib documents packed) and the Llama-style 1.3B
# (benchmarks/peers.py --rows llama, SDPA). Rows are appended to OUT_DIR/rows.jsonl, logs to OUT_DIR/log.txt; a row
# starts only while DEADLINE_SECONDS (from the script's start) leaves 50 s for it.
#
#   source benchmarks/device_env.sh
#   bash benchmarks/long_context.sh OUT_DIR [DEADLINE_SECONDS [LENGTH ...]]
set -u
out=${1:?usage: long_context.sh OUT_DIR [DEADLINE_SECONDS [LENGTH ...]]}
deadline=${2:-560}
shift $(( $# >= 2 ? 2 : $# ))
lengths=("${@:-2048 32768 8192 16384}")
read -r -a lengths <<< "${lengths[*]}"
mkdir -p "$out"
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
TOKENS=32768
trainer() {  # trainer CONFIG LENGTH
    local cfg=$1 len=$2 t mb accum
    t=$(left); [ "$t" -lt 50 ] && { echo "$cfg $len: skipped, ${t}s left" >> "$out/log.txt"; return; }
    mb=$(( TOKENS / len > 8 ? 8 : TOKENS / len )); accum=$(( TOKENS / len / mb ))
    timeout "$t" python3 benchmarks/engines_7b.py --nproc 1 --steps 6 --timed 3 --profile-step 0 \
        --config "configs/$cfg.yaml" --accum "$accum" --timeout "$t" \
        --layouts "train.micro_batch=$mb,train.seq_len=$len,train.cuda_graph=true" \
        --out "$out/rows.tmp" >> "$out/log.txt" 2>&1
    [ -f "$out/rows.tmp" ] && python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'model': sys.argv[1], 'seq_len': int(sys.argv[2])})) for l in open(sys.argv[3])]" "$cfg" "$len" "$out/rows.tmp" >> "$out/rows.jsonl"
    rm -f "$out/rows.tmp"
    echo "$cfg $len: done, $(left)s left" >> "$out/log.txt"
}
llama() {  # llama LENGTH
    local len=$1 t
    t=$(left); [ "$t" -lt 50 ] && { echo "llama $len: skipped, ${t}s left" >> "$out/log.txt"; return; }
    timeout "$t" python3 benchmarks/peers.py --rows llama --seq-len "$len" --llama-micro-batch $(( TOKENS / len > 8 ? 8 : TOKENS / len )) \
        --steps 5 --warmup 2 2>> "$out/log.txt" | python3 -c "import json,sys; [print(json.dumps({**json.loads(l), 'model': 'llama-1.3b', 'seq_len': int(sys.argv[1])})) for l in sys.stdin if l.startswith('{')]" "$len" >> "$out/rows.jsonl"
    echo "llama $len: done, $(left)s left" >> "$out/log.txt"
}
for len in "${lengths[@]}"; do
    trainer mamba2-1.3b "$len"
    llama "$len"
    trainer hybrid-1.3b "$len"
done
echo "done, $(left)s left" >> "$out/log.txt"
