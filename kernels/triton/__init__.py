"""Triton kernels of megassm.kernels (imported lazily by kernels/core/dispatch.py: Triton reads TRITON_INTERPRET when
the kernels are decorated, i.e. at import). The ops' fake and autograd registrations live in ops.py."""
import triton  # noqa: F401  (ImportError here means: no Triton backend)

from .act import swiglu_bwd, swiglu_fwd  # noqa: E402
from .coffee import coffee_scan_bwd, coffee_scan_fwd  # noqa: E402
from .conv import causal_conv1d_bwd, causal_conv1d_fwd  # noqa: E402
from .ce import cross_entropy_bwd, cross_entropy_fwd  # noqa: E402
from .scan import selective_scan_bwd, selective_scan_fwd, selective_scan_step_fwd  # noqa: E402
from .norm import add_rmsnorm_bwd, add_rmsnorm_fwd, gated_rmsnorm_bwd, gated_rmsnorm_fwd  # noqa: E402
from .norm import (gated_rmsnorm_apply, gated_rmsnorm_bwd_apply, gated_rmsnorm_bwd_dot,  # noqa: E402
                   gated_rmsnorm_sumsq)
from .readout import readout_bwd, readout_fwd  # noqa: E402
from .readout import supported as readout_supported  # noqa: E402
from .ssd import ssd_fwd  # noqa: E402
from .ssd_bwd import ssd_bwd  # noqa: E402
from .ssd import supported as ssd_supported  # noqa: E402
from .ssd import kept_state_shape as ssd_kept_state_shape  # noqa: E402
from .step import causal_conv1d_step_fwd, ssd_step_fwd  # noqa: E402
from . import fp8  # noqa: E402  (FP8 casts: kernels/core/fp8.py calls fp8.cast_transpose)

HAS_SSD_BWD = True
HAS_SSD_STEP = True
HAS_CONV_STEP = True

# what ops.py and kernels/core/fp8.py reach through triton_kernels()
__all__ = ["swiglu_bwd", "swiglu_fwd", "coffee_scan_bwd", "coffee_scan_fwd", "causal_conv1d_bwd", "causal_conv1d_fwd",
           "cross_entropy_bwd", "cross_entropy_fwd", "selective_scan_bwd", "selective_scan_fwd",
           "selective_scan_step_fwd", "add_rmsnorm_bwd", "add_rmsnorm_fwd", "gated_rmsnorm_bwd", "gated_rmsnorm_fwd",
           "gated_rmsnorm_apply", "gated_rmsnorm_bwd_apply", "gated_rmsnorm_bwd_dot", "gated_rmsnorm_sumsq",
           "readout_bwd", "readout_fwd", "readout_supported", "ssd_fwd",
           "ssd_bwd", "ssd_supported", "ssd_kept_state_shape", "causal_conv1d_step_fwd", "ssd_step_fwd", "fp8",
           "HAS_SSD_BWD", "HAS_SSD_STEP", "HAS_CONV_STEP"]
