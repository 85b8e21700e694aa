"""Tile sweep for the Triton causal conv (+SiLU) forward and backward, bf16, the mamba2-1.3b shape
(16 x 2048 tokens, conv_dim 4352 read as a strided slice of in_proj's output, as the model does).
Prints one JSON line per variant (median ms of triton.testing.do_bench) and the bytes-moved floor. The
backward rows cover the three modes: fused (one kernel), two_pass (dpre to fp32 scratch, then dx, at the tiles
this sweep picked on an H200, conv._two_pass_tiles) and two_pass_defer (the default: pass 1 reducing dweight /
dbias once per program; larger pass-1 tiles and blocks per program are its candidates).

    python benchmarks/conv_tiles.py [--seq-idx] [--batch 4] [--modes two_pass_defer two_pass]  # batch 4: the trainer's
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from megassm.kernels.conv1d import triton_conv as tc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-idx", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fused", "two_pass", "two_pass_defer"],
                    help="which rows to run: fwd and the backward modes")
    args = ap.parse_args()
    B, L, C, W = args.batch, args.seqlen, 4352, 4
    dev = "cuda"
    big = torch.randn(B, L, 2 * 4096 + 2 * 128 + 64 + 4096, device=dev, dtype=torch.bfloat16)
    x = big[:, :, 4096:4096 + C]  # strided like the model's xBC slice
    w = torch.randn(C, W, device=dev) * 0.5
    b = torch.randn(C, device=dev) * 0.1
    dy = torch.randn(B, L, C, device=dev, dtype=torch.bfloat16)
    seq = None
    if args.seq_idx:
        seq = torch.sort(torch.randint(0, 8, (B, L), device=dev), 1).values.to(torch.int32)
    elem = B * L * C
    floor_fwd = 2 * elem * 2 / 3.0e12 * 1e3  # read x, write y (bf16) at ~3 TB/s
    floor_bwd = 3 * elem * 2 / 3.0e12 * 1e3  # read x, dy, write dx
    floor_2p = (3 * 2 + 2 * 4) * elem / 3.0e12 * 1e3  # two_pass: and write + read dpre (fp32)
    print(json.dumps({"floor_fwd_ms": round(floor_fwd, 3), "floor_bwd_ms": round(floor_bwd, 3),
                      "floor_bwd_two_pass_ms": round(floor_2p, 3)}), flush=True)

    ms = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    y0 = tc.causal_conv1d_fwd(x, w, b, None, seq, True, False)[0]
    fwd_tiles = [None, (16, 128, 8), (16, 256, 8), (8, 256, 4), (16, 512, 8), (32, 256, 8), (8, 512, 8)]
    for tiles in fwd_tiles if "fwd" in args.modes else []:
        try:
            y = tc.causal_conv1d_fwd(x, w, b, None, seq, True, False, tiles=tiles)[0]
            err = (y.float() - y0.float()).abs().max().item()
            t = ms(lambda: tc.causal_conv1d_fwd(x, w, b, None, seq, True, False, tiles=tiles))
            print(json.dumps({"pass": "fwd", "tiles": tiles, "ms": round(t, 4), "max_diff": err}), flush=True)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            print(json.dumps({"pass": "fwd", "tiles": tiles, "error": str(e)[:200]}), flush=True)
    # backward, both modes (MEGASSM_CONV_BWD): rel_diff is the max over dx, dweight, dbias against the fused
    # kernel at 16 x 64 / 8 warps. two_pass rows: tiles for both passes, or (pass 1's, pass 2's) with the
    # other pass at its default, so each pass's column can be read off separately
    ref = tc.causal_conv1d_bwd(x, w, b, None, seq, True, dy, None, tiles=(16, 64, 8), mode="fused")
    d1, d2 = tc._two_pass_tiles(L + W - 1, C)
    bwd_tiles = {
        "fused": [None, (16, 64, 8), (32, 128, 8), (64, 64, 8), (128, 64, 8), (64, 32, 4), (128, 32, 8),
                  (64, 128, 8), (32, 64, 4)],
        "two_pass": [None, *[(t1, d2) for t1 in [(16, 32, 4), (8, 128, 8), (32, 32, 8), (16, 64, 4), (16, 128, 8),
                                                 (32, 64, 8), (32, 128, 8)]],
                     *[(d1, t2) for t2 in [(16, 128, 4), (8, 256, 4), (8, 512, 8), (16, 512, 8), (32, 256, 8)]]],
        # pass 1's tile, and (fourth entry) its position blocks per program
        "two_pass_defer": [None, *[(t1, d2) for t1 in [(16, 64, 4), (32, 32, 4), (32, 64, 4), (32, 64, 8),
                                                       (64, 32, 4), (64, 64, 8), (16, 128, 4), (32, 128, 8),
                                                       (16, 32, 4, 2), (16, 32, 4, 4), (16, 32, 4, 16),
                                                       (32, 64, 4, 4), (32, 64, 4, 16)]]],
    }
    for mode, candidates in bwd_tiles.items():
        if mode not in args.modes:
            continue
        for tiles in candidates:
            try:
                out = tc.causal_conv1d_bwd(x, w, b, None, seq, True, dy, None, tiles=tiles, mode=mode)
                err = max((o.float() - r.float()).abs().max().item() / (r.float().abs().max().item() + 1e-9)
                          for o, r in zip(out[:3], ref[:3]))
                t = ms(lambda: tc.causal_conv1d_bwd(x, w, b, None, seq, True, dy, None, tiles=tiles, mode=mode))
                print(json.dumps({"pass": "bwd", "mode": mode, "tiles": tiles, "ms": round(t, 4), "rel_diff": err}),
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"pass": "bwd", "mode": mode, "tiles": tiles, "error": str(e)[:200]}), flush=True)


if __name__ == "__main__":
    main()
