"""Pure-PyTorch reference ops: the CPU implementation and the test oracle for the Triton kernels."""
from .coffee import coffee_scan
from .conv import causal_conv1d, causal_conv1d_step
from .norm import add_rmsnorm, gated_rmsnorm, rmsnorm
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
    "selective_scan",
    "selective_scan_sequential",
    "selective_scan_step",
    "coffee_scan",
]
