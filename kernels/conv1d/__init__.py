"""Causal depthwise conv1d (+SiLU), channels last (megassm.kernels.causal_conv1d, causal_conv1d_step).

    reference.py      the pure-PyTorch conv and its one-token step
    triton_conv.py    Triton forward, backward (MEGASSM_CONV_BWD's three modes) and decode step
    op.py             the custom ops megassm::causal_conv1d and megassm::causal_conv1d_step

Tests: tests/test_kernels_conv.py, tests/test_kernels_reference.py, tests/test_kernels_triton.py.
"""
