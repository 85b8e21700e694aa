"""The optimizer step (clipping + fused AdamW + the gradients dropped, as calibrate.py times it) in ns per
parameter: over the calibration's synthetic 200 tensors of 1M parameters, over tensors of one size at a time
(4K to 64M parameters), and over each named layout's real parameter shapes (one rank's model: `NAME` is
configs/NAME.yaml on one GPU, `NAME:tp=N` one TP rank of it). Tests whether the synthetic figure, which the planner
multiplies by a rank's parameters, overstates the trainer's step (docs/planner.md "Against the goals"). JSON on
stdout.

    source benchmarks/device_env.sh && python benchmarks/optimizer_shapes.py mamba2-2.7b hybrid-1.3b hybrid-7b:tp=2
"""
import json
import os
import sys

import torch

from megassm.config import load_config
from megassm.planner.calibrate import Measurer
from megassm.training.memory import rank_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # configs/ beside benchmarks/

SIZES = (4096, 65536, 1 << 20, 1 << 24, 1 << 26)  # one size at a time: 200M parameters, at most 5,000 tensors


def layout_shapes(spec: str) -> list:
    name, _, opts = spec.partition(":")
    overrides = ["data.builtin=stdlib"] + [f"parallel.{kv}" for kv in opts.split(",") if kv]
    if any(o.startswith("parallel.tp=") and o != "parallel.tp=1" for o in overrides):
        overrides.append("parallel.sp=true")
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), overrides, validate_config=False)
    model = rank_models(cfg, cfg.model.vocab_size or 50277)[0]
    return [tuple(p.shape) for p in model.parameters()]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_shapes.py: needs a GPU")
    dev = torch.device("cuda")
    meas = Measurer(dev, iters=12, warmup=3)  # calibrate.py's own timing: the median of three windows

    def one(shapes) -> dict:
        ns = meas.optimizer_ns_per_param(shapes)
        torch.cuda.empty_cache()
        return {"ns_per_param": round(ns, 5), "params": sum(int(torch.Size(s).numel()) for s in shapes),
                "tensors": len(shapes)}

    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    out["synthetic_200x1M"] = one([(1_000_000,)] * 200)
    out["sizes"] = {str(n): one([(n,)] * max(2, min(5000, (200 << 20) // n))) for n in SIZES}
    for spec in sys.argv[1:]:
        out[spec] = one(layout_shapes(spec))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
