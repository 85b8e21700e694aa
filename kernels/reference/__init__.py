"""Pure-PyTorch reference ops: the CPU implementation and the test oracle for the Triton kernels."""
from .act import swiglu
from .coffee import coffee_scan
from .conv import causal_conv1d, causal_conv1d_step
from .loss import cross_entropy
from .norm import (add_rmsnorm, gated_rmsnorm, gated_rmsnorm_apply, gated_rmsnorm_bwd_apply, gated_rmsnorm_bwd_dot,
                   gated_rmsnorm_sumsq, rmsnorm)
from .scan import selective_scan, selective_scan_sequential, selective_scan_step
from .ssd import segsum, ssd, ssd_sequential, ssd_step

__all__ = [
    "ssd",
    "ssd_sequential",
    "ssd_step",
    "segsum",
    "causal_conv1d",
    "causal_conv1d_step",
    "rmsnorm",
    "gated_rmsnorm",
    "add_rmsnorm",
    "swiglu",
    "gated_rmsnorm_sumsq",
    "gated_rmsnorm_apply",
    "gated_rmsnorm_bwd_dot",
    "gated_rmsnorm_bwd_apply",
    "selective_scan",
    "selective_scan_sequential",
    "selective_scan_step",
    "coffee_scan",
    "cross_entropy",
]
