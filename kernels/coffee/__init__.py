"""COFFEE's state-feedback recurrence with its read-out fused (seed mixer C; megassm.kernels.coffee_scan).

    reference.py       the pure-PyTorch recurrence (sequential, DEER and the one-token step the mixer uses too)
    triton_coffee.py   Triton forward and backward (segment checkpoints, recomputed in the backward)
    op.py              the custom op megassm::coffee_scan

Tests: tests/test_seed_scan.py, tests/test_mixers_cb.py.
"""
