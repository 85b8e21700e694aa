"""The gated MLP's activation, swiglu = silu(a) * b (megassm.kernels.swiglu).

    reference.py      the pure-PyTorch activation
    triton_act.py     Triton forward and backward
    op.py             the custom op megassm::swiglu

Tests: tests/test_kernels_triton.py.
"""
