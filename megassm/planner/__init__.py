"""megassm-plan: predicted step time, tokens/s and MFU of every layout the trainer accepts for a cluster, from a
compute table calibrated on one GPU and an alpha-beta model of the collectives (docs/planner.md).

    calibrate.py   `megassm-plan calibrate --out FILE`: the compute table, measured on the GPU at hand
    costs.py       the model: a layout's per-rank compute, collectives, overlap, pipeline bubble, host time
    search.py      the layouts of a cluster the trainer accepts and that fit (its own checks and estimate)
    rows.py        the measured rows of docs/benchmarks.md the model is validated against
    cli.py         the command
"""
