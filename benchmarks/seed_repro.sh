#!/usr/bin/env bash
# The seed papers' small reproductions on one GPU (docs/seeds.md, "Synthetic tasks and reproductions"):
# the chosen groups' runs at once (the models are tiny, so they share the GPU), one JSON line per run,
# results under ${OUT:-/tmp/seed_repro}/<run>/.
#   source benchmarks/device_env.sh; bash benchmarks/seed_repro.sh induction mqar bmojo-lr selcopy
# Groups:
#   induction   Mamba paper induction heads, the paper's 204,800 steps at batch 8: Mamba-2 `M` and Mamba-1 `S`
#               under CUDA graphs, and the attention control `**` (eager, INDUCTION_ATTN_STEPS)
#   induction-seeds the paper's S (Mamba-1) at batch 8 (its config: no gradient clipping), seeds $SEEDS, 256
#               evaluation samples per length, until LIMIT
#   selcopy     Mamba paper selective copying: S6 against its LTI ablation (CUDA graphs)
#   mqar        MQAR (Zoology settings, T = 256, 16 pairs, d_model 64): Mamba-2 vs Longhorn at state 4 and 16,
#               8,000 steps, seeds $SEEDS (CUDA graphs); B'MOJO in the bmojo groups
#   bmojo-lr    B'MOJO on the same MQAR at learning rates 1e-3 and 3e-4 (state 16, seed 0)
#   bmojo       B'MOJO on the same MQAR with M's settings (lr 3e-3, 8,000 steps), state 4 and 16, seeds $SEEDS,
#               under CUDA graphs (its forward is graph-safe without document resets)
#   bmojo-f     the same without eidetic tokens (B'MOJO-F)
#   bmojo-kv    B'MOJO's Fig. 2 ordering against the number of pairs: Mamba-2 (M), the Hybrid (B without memory
#               tokens: Mamba beside sliding-window attention), B'MOJO-F and B'MOJO, at n_kv $KVS (default
#               "8 24"), state $STATE (default 4), seeds $SEEDS, M's MQAR settings but $KV_STEPS steps (default
#               8000), no gradient clipping
#   bmojo-me    B'MOJO's eidetic ablation (Fig. 2, panel 4): the bmojo-kv B'MOJO with n_eidetic in $EIDETIC (default
#               "0 2 4 8 16 32"), at n_kv $KVS, state $STATE, seeds $SEEDS, $KV_STEPS steps
#   bmojo-mem   Fig. 2 at equal attention memory: $MEM tokens (default 48) per query as the Hybrid's window, as
#               B'MOJO-F's window + 1 fading token, and as B'MOJO's window + 1 fading + m_e eidetic tokens for m_e
#               in $EIDETIC_MEM (default "15 31"); n_kv $KVS, state $STATE, seeds $SEEDS, $KV_STEPS steps
#   bmojo-alg1  the same with the attention output only (model.bmojo.ssm_residual=false), lr 1e-3, until LIMIT
# LIMIT (s) is each run's training time limit (the runner stops, evaluates and records steps_done).
# GPUS (default 1): spread the runs round-robin over GPUs 0..GPUS-1 (CUDA_VISIBLE_DEVICES per run).
set -u
OUT=${OUT:-/tmp/seed_repro}
LIMIT=${LIMIT:-400}
SEEDS=${SEEDS:-0 1 2}
INDUCTION_ATTN_STEPS=${INDUCTION_ATTN_STEPS:-20000}
GPUS=${GPUS:-1}
case $GPUS in ''|*[!0-9]*|0) echo "seed_repro.sh: GPUS must be a positive integer, got '$GPUS'" >&2; exit 2 ;; esac
mkdir -p "$OUT"
n_runs=0
run() {  # name, args...   (in the background; results printed by report)
  local name=$1; shift
  local pin=()  # one GPU: keep the caller's CUDA_VISIBLE_DEVICES
  # rotate by one GPU each round, so a group's runs of one model do not all land on the same GPU
  [ "$GPUS" -gt 1 ] && pin=(env CUDA_VISIBLE_DEVICES=$(((n_runs + n_runs / GPUS) % GPUS))); n_runs=$((n_runs + 1))
  ("${pin[@]}" timeout $((LIMIT + 240)) python -m megassm.synthetic.run --device cuda --time-limit "$LIMIT" --out "$OUT/$name" \
     "$@" > "$OUT/$name.log" 2>&1; echo $? > "$OUT/$name.rc") &
}
report() {
  for rc in "$OUT"/*.rc; do
    local name; name=$(basename "$rc" .rc)
    if [ "$(cat "$rc")" = 0 ]; then tail -n 1 "$OUT/$name.log" | sed "s/^{/{\"run\": \"$name\", /"
    else echo "{\"run\": \"$name\", \"failed\": $(cat "$rc"), \"log\": \"$(tail -n 2 "$OUT/$name.log" | tr '"\n' "' ")\"}"; fi
  done
}
[ $# -gt 0 ] || set -- induction selcopy mqar bmojo-lr
for group in "$@"; do
  case $group in
    induction)
      run induction-M --config configs/synthetic/induction_mamba2.yaml --steps 204800 --cuda-graph
      run induction-S --config configs/synthetic/induction_mamba1.yaml --steps 204800 --cuda-graph
      run induction-attn --config configs/synthetic/induction_mamba2.yaml --steps "$INDUCTION_ATTN_STEPS" \
          model.pattern='**' model.d_model=128 model.attn.n_heads=8 ;;
    induction-seeds)
      for seed in $SEEDS; do
        run induction-S-s$seed --config configs/synthetic/induction_mamba1.yaml --steps 204800 --seed "$seed" \
            --eval-batches 32 --cuda-graph
      done ;;
    selcopy)
      run selcopy-S --config configs/synthetic/selective_copying.yaml --steps 400000 --cuda-graph
      run selcopy-S-lti --config configs/synthetic/selective_copying.yaml --steps 400000 --cuda-graph \
          model.mamba1.lti=true ;;
    mqar)
      for n in 4 16; do
        for seed in $SEEDS; do
          run mqar-M-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps 8000 --seed "$seed" --cuda-graph \
              model.mamba.d_state=$n
          run mqar-L-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps 8000 --seed "$seed" --cuda-graph \
              model.pattern=LL model.longhorn.d_state=$n
        done
      done ;;
    bmojo-lr)
      for lr in 1e-3 3e-4; do
        run mqar-B-N16-s0-lr$lr --config configs/synthetic/mqar_small.yaml --steps 6000 --seed 0 --lr "$lr" --cuda-graph \
            model.pattern=BB model.mamba.d_state=16 model.bmojo.window=32 model.bmojo.n_eidetic=8 model.attn.n_heads=2
      done ;;
    bmojo-mem)
      mem=${MEM:-48}
      for kv in ${KVS:-8 24}; do
        for seed in $SEEDS; do
          common=(--config configs/synthetic/mqar_small.yaml --steps "${KV_STEPS:-8000}" --seed "$seed" --lr 3e-3 --grad-clip 0
                  --cuda-graph task.n_kv=$kv model.mamba.d_state=${STATE:-4} model.pattern=BB model.attn.n_heads=2)
          run kv$kv-mem$mem-hybrid-s$seed "${common[@]}" model.bmojo.window=$mem model.bmojo.n_fading=0 model.bmojo.n_eidetic=0
          run kv$kv-mem$mem-bmojo-f-s$seed "${common[@]}" model.bmojo.window=$((mem - 1)) model.bmojo.n_eidetic=0
          for me in ${EIDETIC_MEM:-15 31}; do
            run kv$kv-mem$mem-me$me-s$seed "${common[@]}" model.bmojo.window=$((mem - 1 - me)) model.bmojo.n_eidetic=$me
          done
        done
      done ;;
    bmojo-kv|bmojo-me)
      # the MQAR runs of B'MOJO's Fig. 2: M's settings at KV_STEPS steps, no clipping; bm: the B layer's shape
      bm=(model.pattern=BB model.bmojo.window=32 model.attn.n_heads=2)
      for kv in ${KVS:-8 24}; do
        for seed in $SEEDS; do
          common=(--config configs/synthetic/mqar_small.yaml --steps "${KV_STEPS:-8000}" --seed "$seed" --lr 3e-3 --grad-clip 0
                  --cuda-graph task.n_kv=$kv model.mamba.d_state=${STATE:-4})
          if [ "$group" = bmojo-me ]; then
            for me in ${EIDETIC:-0 2 4 8 16 32}; do
              run kv$kv-me$me-s$seed "${common[@]}" "${bm[@]}" model.bmojo.n_eidetic=$me
            done
            continue
          fi
          run kv$kv-M-s$seed "${common[@]}"
          run kv$kv-hybrid-s$seed "${common[@]}" "${bm[@]}" model.bmojo.n_fading=0 model.bmojo.n_eidetic=0
          run kv$kv-bmojo-f-s$seed "${common[@]}" "${bm[@]}" model.bmojo.n_eidetic=0
          run kv$kv-bmojo-s$seed "${common[@]}" "${bm[@]}" model.bmojo.n_eidetic=8
        done
      done ;;
    bmojo|bmojo-f|bmojo-alg1)
      # bmojo: B'MOJO as configured by default (the SSM output joins the layer output), the M/L settings;
      # bmojo-f: its B'MOJO-F ablation (no eidetic tokens); bmojo-alg1: attention output only, lr 1e-3
      extra=(); lr=3e-3; steps=8000
      [ "$group" = bmojo-f ] && extra=(model.bmojo.n_eidetic=0)
      [ "$group" = bmojo-alg1 ] && { extra=(model.bmojo.ssm_residual=false); lr=1e-3; steps=100000; }
      for n in 4 16; do
        for seed in $SEEDS; do
          run mqar-$group-N$n-s$seed --config configs/synthetic/mqar_small.yaml --steps $steps --seed "$seed" \
              --lr $lr --cuda-graph model.pattern=BB model.mamba.d_state=$n model.bmojo.window=32 \
              model.bmojo.n_eidetic=8 model.attn.n_heads=2 "${extra[@]}"
        done
      done ;;
    *) echo "seed_repro.sh: unknown group '$group' (induction, induction-seeds, selcopy, mqar, bmojo-lr, bmojo, bmojo-f, bmojo-kv, bmojo-me, bmojo-alg1)" >&2; exit 2 ;;
  esac
done
wait
report
