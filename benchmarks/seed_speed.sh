#!/usr/bin/env bash
# Each seed mixer's training step at the ~370M shape (d_model 1024, 48 blocks, seq 2048, micro-batch 4, bf16
# autocast, AdamW) against Mamba-2 (docs/benchmarks.md, "Seed mixers"). One JSON line per mixer:
#   source benchmarks/device_env.sh; bash benchmarks/seed_speed.sh [LETTERS]      (default: M S L B C)
# SEQ / MB / STEPS / EXTRA (more overrides) change the shape, e.g. for a quick CPU check.
set -u
for c in ${@:-M S L B C}; do
  pat=$(printf "$c%.0s" $(seq ${BLOCKS:-48}))
  extra=()
  # COFFEE: the token loop (one Triton kernel; DEER hits its cap at L=2048) and 3x channels (357M parameters)
  [ "$c" = C ] && extra=(model.coffee.solver=sequential model.coffee.expand=3)
  lim=120; [ "$c" = C ] && lim=${C_LIMIT:-150}
  row=$(timeout $lim python benchmarks/train_step.py --config configs/mamba2-370m.yaml --seq-len ${SEQ:-2048} \
        --micro-batch ${MB:-4} --steps ${STEPS:-4} --warmup ${WARMUP:-2} model.pattern=$pat "${extra[@]}" ${EXTRA:-} \
        2>&1 | grep '^{')
  if [ -n "$row" ]; then echo "$row" | sed "s/^{/{\"mixer\": \"$c\", /"
  else echo "{\"mixer\": \"$c\", \"failed\": \"no result within ${lim}s\"}"; fi
done
