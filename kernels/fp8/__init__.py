"""FP8 matmuls for the projections (train.fp8): fp8_linear and the casts it runs on (megassm.kernels.fp8, the
import path megassm/training/fp8.py uses).

    reference.py      the power-of-two scales, the casts in torch, and fp8_linear_reference (the test oracle)
    triton_fp8.py     Triton casts (amax; scale, cast and transpose)
    op.py             fp8_linear: the autograd Function over torch._scaled_mm, and cast_fp8 / fp8_weight

Tests: tests/test_fp8.py.
"""
from .op import cast_fp8, fp8_eligible, fp8_linear, fp8_weight
from .reference import E4M3, E5M2, fp8_linear_reference, to_fp8

__all__ = ["E4M3", "E5M2", "cast_fp8", "fp8_eligible", "fp8_linear", "fp8_linear_reference", "fp8_weight", "to_fp8"]
