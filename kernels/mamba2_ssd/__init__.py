"""Mamba-2's chunked SSD scan (megassm.kernels.ssd, ssd_step, ssd_sequential; state_readout_add). The folder is not
kernels/ssd/: a subpackage megassm.kernels.ssd would share its name with the function kernels.ssd.

    reference.py          the pure-PyTorch chunked scan, its one-token step and the token-by-token oracle
    triton_ssd.py         Triton forward (chunk states and the chunk walks: triton_ssd_states.py)
    triton_ssd_bwd.py     Triton backward
    triton_ssd_common.py  the autotuner, the tile table, the precision-aware products, the stored-state format
    triton_step.py        Triton decode step (one token)
    op.py                 the custom ops megassm::ssd and megassm::ssd_step, their fake and autograd registrations
    readout.py            state_readout_add, context parallelism's state read-out (y + w * (C_t . h)): an autograd
                          Function over triton_readout.py, or torch products

Tests: tests/test_kernels_ssd.py, tests/test_kernels_reference.py, tests/test_kernels_triton.py,
tests/test_kernels_readout.py, tests/test_compile.py.
"""
