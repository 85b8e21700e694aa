"""RMS norms (megassm.kernels.rmsnorm, gated_rmsnorm, add_rmsnorm, and gated_rmsnorm in stages for tensor
parallelism: gated_rmsnorm_sumsq / _apply / _bwd_dot / _bwd_apply).

    reference.py      the pure-PyTorch norms and the staged gated norm
    triton_norm.py    Triton forwards and backwards (the gated kernel, without a gate, is rmsnorm's)
    op.py             the custom ops megassm::gated_rmsnorm, megassm::rmsnorm and megassm::add_rmsnorm

Tests: tests/test_kernels_norm.py, tests/test_kernels_reference.py, tests/test_kernels_triton.py.
"""
