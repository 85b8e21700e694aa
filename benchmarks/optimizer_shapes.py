"""The optimizer step (clipping + fused AdamW + the gradients dropped, as calibrate.py times it) in ns per
parameter: over the calibration's synthetic 200 tensors of 1M parameters, and over each named config's real
parameter shapes (the whole model on one GPU). Tests whether the synthetic figure, which the planner multiplies by
a rank's parameters, overstates the trainer's step (docs/planner.md "Against the goals"). JSON on stdout.

    source benchmarks/device_env.sh && python benchmarks/optimizer_shapes.py mamba2-2.7b hybrid-1.3b
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megassm.config import load_config  # noqa: E402
from megassm.models.lm import build_model  # noqa: E402
from megassm.planner.calibrate import Measurer  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_shapes.py: needs a GPU")
    dev = torch.device("cuda")
    meas = Measurer(dev, iters=12, warmup=3)  # calibrate.py's own timing: the median of three windows
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    out["synthetic_200x1M"] = {"ns_per_param": round(meas.optimizer_ns_per_param([(1_000_000,)] * 200), 5),
                               "params": 200_000_000, "tensors": 200}
    torch.cuda.empty_cache()
    for name in sys.argv[1:]:
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), ["data.builtin=stdlib"], validate_config=False)
        shapes = [p.shape for p in build_model(cfg.model, vocab_size=cfg.model.vocab_size or 50277,
                                               device="meta").parameters()]
        out[name] = {"ns_per_param": round(meas.optimizer_ns_per_param(shapes), 5),
                     "params": sum(s.numel() for s in shapes), "tensors": len(shapes)}
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
