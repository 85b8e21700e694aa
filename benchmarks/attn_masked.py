"""Masked attention on the GPU: what `masked_sdpa` (megassm/models/attention.py) costs and what it avoids.

Training-time masked calls leave cuDNN's SDPA backend out (its backward returns NaN query gradients for some
masked shapes, pytorch/pytorch#196678) and share grouped K / V heads out for the memory-efficient kernel.
This prints JSON lines:
  - `bug`: the issue's shape (keys 704 = 64 mod 128, every logit ~ -120, explicit causal mask, bf16): how
    many query-gradient entries are non-finite with the default backends and with masked_sdpa;
  - `speed`: forward + backward ms and peak memory above the inputs at the hybrid configs' attention shapes,
    document-packed rows (mask) and a sliding window, for the default backend choice (`default`),
    masked_sdpa (`guarded`) and, for scale, the mask-free causal call (`causal`).

    source benchmarks/device_env.sh; python3 benchmarks/attn_masked.py
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
import triton.testing

from megassm.models.attention import masked_sdpa

SHAPES = [  # (label, batch, seq_len, query heads, K / V heads, head dim)
    ("hybrid-1.3b", 4, 2048, 12, 4, 128),
    ("hybrid-7b", 1, 4096, 32, 8, 128),
]


def doc_mask(bsz, L, mean_doc, seed=0):
    """[B, 1, L, L] causal same-document mask for rows packed with documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(bsz):
        lens = []
        while sum(lens) < L:
            lens.append(int(torch.randint(mean_doc // 4, 2 * mean_doc, (1,), generator=g)))
        ids.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:L])
    sid = torch.stack(ids).to("cuda")
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
    return (causal & (sid[:, :, None] == sid[:, None, :]))[:, None]


def window_mask(L, w):
    i = torch.arange(L, device="cuda")
    return ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w))[None, None]


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


def bug_row():
    torch.manual_seed(0)
    L, D = 704, 64
    q = torch.randn(1, 2, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 2, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 2, L, D, device="cuda", dtype=torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)
    mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()[None, None]
    row = {"bench": "bug", "keys": L}
    for name, fn in (("default", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask)),
                     ("guarded", lambda a, b, c: masked_sdpa(a, b, c, mask))):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward(torch.randn_like(q))
        row[f"{name}_nonfinite_dq"] = int((~torch.isfinite(leaves[0].grad)).sum())
    return row


def main():
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    print(json.dumps({"bench": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    print(json.dumps(bug_row()), flush=True)
    for label, B, L, hq, hkv, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        for mask_name, mask in (("documents", doc_mask(B, L, 512)), ("window 1024", window_mask(L, 1024))):
            row = {"bench": "speed", "shape": label, "B": B, "L": L, "heads": f"{hq}/{hkv}x{D}", "mask": mask_name}
            for name, fn in (
                ("default", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True)),
                ("guarded", lambda a, b, c: masked_sdpa(a, b, c, mask, enable_gqa=True)),
                ("causal", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)),
            ):
                try:
                    row[f"{name}_ms"], row[f"{name}_peak_mib"] = fwd_bwd(fn, q, k, v)
                except RuntimeError as e:  # a backend refusing the shape: say so in the row
                    row[f"{name}_error"] = str(e).splitlines()[0][:200]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
