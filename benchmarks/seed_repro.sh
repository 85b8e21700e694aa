#!/usr/bin/env bash
# The seed papers' small reproductions on one GPU (docs/seeds.md, "Synthetic tasks and reproductions"):
# every run at once (the models are tiny, so they share the GPU; each is bound by its own Python loop),
# one JSON line per run, results under ${OUT:-/tmp/seed_repro}/<run>/. About 3 minutes on an H100:
#   source benchmarks/device_env.sh; MEGASSM_TRITON_AUTOTUNE=0 bash benchmarks/seed_repro.sh
set -u
OUT=${OUT:-/tmp/seed_repro}
LIMIT=${LIMIT:-200}   # seconds per run
mkdir -p "$OUT"
run() {  # name, args...   (in the background; results printed by report)
  local name=$1; shift
  (timeout "$LIMIT" python -m megassm.synthetic.run --device cuda --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1;
   echo $? > "$OUT/$name.rc") &
}
report() {
  for rc in "$OUT"/*.rc; do
    local name; name=$(basename "$rc" .rc)
    if [ "$(cat "$rc")" = 0 ]; then tail -n 1 "$OUT/$name.log" | sed "s/^{/{\"run\": \"$name\", /"
    else echo "{\"run\": \"$name\", \"failed\": $(cat "$rc"), \"log\": \"$(tail -n 2 "$OUT/$name.log" | tr '"\n' "' ")\"}"; fi
  done
}
# Mamba paper induction heads: train at 256, test to 16K (Mamba-2 `M` and Mamba-1 `S`)
run induction-M --config configs/synthetic/induction_mamba2.yaml
run induction-S --config configs/synthetic/induction_mamba1.yaml
# Mamba paper selective copying: S6 against its LTI ablation
run selcopy-S --config configs/synthetic/selective_copying.yaml
run selcopy-S-lti --config configs/synthetic/selective_copying.yaml model.mamba1.lti=true
# MQAR (Zoology settings, T = 256, 16 kv pairs, d_model 64): Mamba-2 vs Longhorn vs B'MOJO, state 4 and 16, 3 seeds
for n in 4 16; do
  for seed in 0 1 2; do
    run mqar-M-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps 1500 --seed $seed model.mamba.d_state=$n
    run mqar-L-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps 1500 --seed $seed model.pattern=LL \
        model.longhorn.d_state=$n
    run mqar-B-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps 1500 --seed $seed model.pattern=BB \
        model.mamba.d_state=$n model.bmojo.window=32 model.bmojo.n_eidetic=8 model.attn.n_heads=2
  done
done
wait
report
