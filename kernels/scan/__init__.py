"""The selective (diagonal) scan of the seed mixers S (Mamba-1, decay="exp") and L (Longhorn, decay="longhorn")
(megassm.kernels.selective_scan, selective_scan_step, selective_scan_sequential).

    reference.py      the pure-PyTorch scan, its one-token step and the token-by-token oracle
    triton_scan.py    Triton forward, backward and decode step
    op.py             the custom ops megassm::selective_scan and megassm::selective_scan_step

Tests: tests/test_seed_scan.py, tests/test_mixers_sl.py.
"""
