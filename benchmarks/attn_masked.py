"""Masked attention on the GPU: what `masked_sdpa` (megassm/models/attention.py) costs and what it avoids.

Training-time masked calls are steered around cuDNN's SDPA backward bugs: a key length of 64 mod 128 is padded to
the next multiple of 128 with masked-out keys (NaN query gradients otherwise, pytorch/pytorch#196678), a single
query leaves cuDNN out (NaN key / value gradients, NVIDIA/cudnn-frontend#1072). This prints JSON lines:
  - `bug`: each bug's shape (every logit ~ -120, explicit mask, bf16): non-finite gradient entries (dq, dk, dv)
    with the default backends and with masked_sdpa;
  - `speed`: forward + backward ms and peak memory above the inputs at the hybrid configs' attention shapes,
    document-packed rows and a sliding window, with L keys and with L + 64 (a 64-token carried KV cache: 64 mod
    128), for the default backend choice (`default`), masked_sdpa (`guarded`), cuDNN left out altogether with the
    grouped heads shared out (`no_cudnn`, the previous guard) and, for scale, the mask-free causal call (`causal`).

    source benchmarks/device_env.sh; python3 benchmarks/attn_masked.py
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
import triton.testing

from megassm.models.attention import masked_sdpa, sdpa_without_cudnn

SHAPES = [  # (label, batch, seq_len, query heads, K / V heads, head dim)
    ("hybrid-1.3b", 4, 2048, 12, 4, 128),
    ("hybrid-7b", 1, 4096, 32, 8, 128),
]


def doc_mask(bsz, L, mean_doc, keys, seed=0):
    """[B, 1, L, keys] same-document causal mask for rows packed with documents of random lengths; the first
    keys - L columns are a carried cache that the row's first document sees."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(bsz):
        lens = []
        while sum(lens) < L:
            lens.append(int(torch.randint(mean_doc // 4, 2 * mean_doc, (1,), generator=g)))
        ids.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:L])
    sid = torch.stack(ids).to("cuda")
    sid_k = torch.cat([sid.new_zeros(bsz, keys - L), sid], 1)
    causal = torch.ones(L, keys, dtype=torch.bool, device="cuda").tril(keys - L)
    return (causal & (sid[:, :, None] == sid_k[:, None, :]))[:, None]


def window_mask(L, keys, w):
    i = torch.arange(L, device="cuda")[:, None] + (keys - L)
    j = torch.arange(keys, device="cuda")[None, :]
    return ((j <= i) & (i - j < w))[None, None]


def fwd_bwd(fn, q, k, v):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    gout = torch.randn_like(q)

    def step():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, gout)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return round(ms, 4), round(peak, 1)


def bug_row(lq, lk, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 2, lq, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    k = torch.randn(1, 2, lk, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    v = torch.randn(1, 2, lk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(d)
    mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)[None, None]
    row = {"bench": "bug", "queries": lq, "keys": lk}
    for name, fn in (("default", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask)),
                     ("guarded", lambda a, b, c: masked_sdpa(a, b, c, mask))):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward(torch.randn_like(q))
        row[f"{name}_nonfinite"] = [int((~torch.isfinite(t.grad)).sum()) for t in leaves]
    return row


def main():
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    print(json.dumps({"bench": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    for lq, lk in ((704, 704), (2048, 2112), (1, 576), (1, 512)):
        print(json.dumps(bug_row(lq, lk)), flush=True)
    for label, B, L, hq, hkv, D in SHAPES:
        for keys in (L, L + 64):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(B, hkv, keys, D, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(B, hkv, keys, D, device="cuda", dtype=torch.bfloat16, generator=g)
            masks = (("documents", doc_mask(B, L, 512, keys)), ("window 1024", window_mask(L, keys, 1024)))
            for mask_name, mask in masks:
                row = {"bench": "speed", "shape": label, "B": B, "L": L, "keys": keys, "heads": f"{hq}/{hkv}x{D}",
                       "mask": mask_name}
                routes = [
                    ("default", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask,
                                                                               enable_gqa=True)),
                    ("guarded", lambda a, b, c: masked_sdpa(a, b, c, mask, enable_gqa=True)),
                    ("no_cudnn", lambda a, b, c: sdpa_without_cudnn(a, b, c, mask, enable_gqa=True)),
                ]
                if keys == L:
                    routes.append(("causal", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                                         enable_gqa=True)))
                for name, fn in routes:
                    try:
                        row[f"{name}_ms"], row[f"{name}_peak_mib"] = fwd_bwd(fn, q, k, v)
                    except RuntimeError as e:  # a backend refusing the shape: say so in the row
                        row[f"{name}_error"] = str(e).splitlines()[0][:200]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
