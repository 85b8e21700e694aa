"""The LM loss on the device: the fused Triton cross-entropy (kernels/loss/triton_ce.py, the model's loss) against the
eager F.cross_entropy(logits.float()) it replaced, at mamba2-1.3b's head (8192 tokens a micro-batch x 50304
padded vocabulary, bf16 logits). One JSON line per path: the loss's forward + backward given the logits (median
ms of triton.testing.do_bench), the same with the head matmul under bf16 autocast, the memory the loss adds
over the logits at its peak, and the largest differences from the eager path (loss, logits' gradient).

    python benchmarks/loss_head.py [--tokens 8192] [--vocab 50304] [--d-model 2048]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from megassm import kernels


def eager(logits, labels):
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def fused(logits, labels):
    return kernels.cross_entropy(logits, labels, -100).sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d-model", type=int, default=2048)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(args.tokens, args.d_model, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(args.vocab, args.d_model, device=dev, generator=g) * args.d_model ** -0.5).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=dev, generator=g)
    labels[:7] = -100
    logits0 = F.linear(h, w.detach().to(torch.bfloat16))
    ms = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
    ref = None
    for name, fn in (("eager", eager), ("fused", fused)):
        x = logits0.detach().clone().requires_grad_(True)

        def loss_only():
            x.grad = None
            fn(x, labels).backward()

        def head_and_loss():
            w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                fn(F.linear(h, w), labels).backward()

        loss_only()
        val, grad = fn(x, labels).item(), x.grad.float()
        diffs = {} if ref is None else {"loss_rel_diff": abs(val - ref[0]) / abs(ref[0]),
                                        "grad_max_diff": (grad - ref[1]).abs().max().item()}
        ref = ref or (val, grad)
        torch.cuda.synchronize()
        x.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_only()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        print(json.dumps({"path": name, "tokens": args.tokens, "vocab": args.vocab,
                          "loss_fwd_bwd_ms": round(ms(loss_only), 3), "head_and_loss_ms": round(ms(head_and_loss), 3),
                          "loss_peak_extra_gib": round(extra, 2),
                          **diffs}), flush=True)


if __name__ == "__main__":
    main()
