"""The optimizer step (clipping + fused AdamW + the gradients dropped, as calibrate.py times it) in ns per
parameter: over the calibration's synthetic 200 tensors of 1M parameters, and over each named config's real
parameter shapes (the whole model on one GPU). Tests whether the synthetic figure, which the planner multiplies by
a rank's parameters, overstates the trainer's step (docs/planner.md "Against the goals"). JSON on stdout.

    source benchmarks/device_env.sh && python benchmarks/optimizer_shapes.py mamba2-2.7b hybrid-1.3b
"""
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megassm.config import OptimConfig, load_config  # noqa: E402
from megassm.models.lm import build_model  # noqa: E402
from megassm.training.optim import build_optimizer, clip_grad_norm  # noqa: E402


def ns_per_param(params: list, iters: int = 12) -> float:
    """The median of three timed windows, after three warm-up steps."""
    grads = [torch.randn_like(p) for p in params]
    opt = build_optimizer([{"params": params, "weight_decay": 0.1}], OptimConfig(), "cuda")

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        clip_grad_norm(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters // 3):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / (iters // 3))
    return sorted(times)[1] * 1e9 / sum(p.numel() for p in params)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_shapes.py: needs a GPU")
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    params = [torch.nn.Parameter(torch.randn(1_000_000, device=dev)) for _ in range(200)]
    out["synthetic_200x1M"] = {"ns_per_param": round(ns_per_param(params), 5), "params": 200_000_000, "tensors": 200}
    del params
    torch.cuda.empty_cache()
    for name in sys.argv[1:]:
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), ["data.builtin=stdlib"], validate_config=False)
        shapes = [p.shape for p in build_model(cfg.model, vocab_size=cfg.model.vocab_size or 50277,
                                               device="meta").parameters()]
        params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
        out[name] = {"ns_per_param": round(ns_per_param(params), 5), "params": sum(p.numel() for p in params),
                     "tensors": len(params)}
        del params
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
