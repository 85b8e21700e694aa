"""The LM head's cross-entropy: per-row fp32 losses (megassm.kernels.cross_entropy).

    reference.py      the pure-PyTorch loss
    triton_ce.py      Triton forward and backward (the logits read without an fp32 copy)
    op.py             the custom op megassm::cross_entropy

Tests: tests/test_kernels_ce.py, tests/test_kernels_triton.py.
"""
