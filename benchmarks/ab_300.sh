#!/usr/bin/env bash
# Issue 41's numerics check in one device call: the 300-step A/B recipe of docs/benchmarks.md (mamba2-370m,
# built-in stdlib bytes, seq 2048, 16 sequences a step, lr 1.5e-3, warm-up 30, CUDA graphs, validation on 131K
# tokens every 100 steps) once per SEED, with the kernels' defaults or the ENV=VALUE settings given. One row per
# run goes to OUT_DIR/rows.jsonl ({"seed", "env", "extra", "val": {step: loss}, "train_loss_300", "wall_s"}),
# every log to OUT_DIR/log.txt (the device returns at most 8 files).
#
#   source benchmarks/device_env.sh
#   bash benchmarks/ab_300.sh OUT_DIR "1234 1235 1236" [EXTRA_KEYS] [ENV=VALUE ...]
# (EXTRA_KEYS come last and override the recipe; AB_CONFIG names another config, for a quick check on CPU)
set -u
out=${1:?usage: ab_300.sh OUT_DIR SEEDS [EXTRA_KEYS] [ENV=VALUE ...]}
seeds=${2:?usage: ab_300.sh OUT_DIR SEEDS [EXTRA_KEYS] [ENV=VALUE ...]}
extra=${3:-}
shift $(( $# >= 3 ? 3 : $# ))
mkdir -p "$out"
for seed in $seeds; do
    run=$(mktemp -d)
    t0=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA_KEYS is a list of key=value words
    env "$@" python3 -m megassm.train --config "${AB_CONFIG:-configs/mamba2-370m.yaml}" data.builtin=stdlib train.steps=300 \
        train.seq_len=2048 train.micro_batch=8 train.global_batch=16 optim.lr=1.5e-3 optim.warmup_steps=30 \
        train.eval_interval=100 train.eval_tokens=131072 train.cuda_graph=true train.seed="$seed" \
        run.dir="$run" $extra >> "$out/log.txt" 2>&1
    rc=$?
    python3 - "$run/metrics.jsonl" "$seed" "$rc" "$(( $(date +%s) - t0 ))" "$extra" "$@" >> "$out/rows.jsonl" <<'PY'
import json, os, sys
path, seed, rc, wall, extra, *env = sys.argv[1:]
val, train = {}, None
if os.path.exists(path):
    for line in open(path):
        r = json.loads(line)
        if r.get("loss_val") is not None:
            val[r["step"]] = r["loss_val"]
        if r.get("step") == 300 and r.get("loss") is not None:
            train = r["loss"]
print(json.dumps({"row": "ab_300", "seed": int(seed), "rc": int(rc), "env": env, "extra": extra, "val": val,
                  "train_loss_300": train, "wall_s": int(wall)}))
PY
    rm -rf "$run"
done
