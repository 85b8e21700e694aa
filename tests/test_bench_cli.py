"""benchmarks/kernels_ssd.py refuses bad arguments before any GPU work (these run on a CPU-only machine, where
reaching the GPU part would end in its "needs a CUDA GPU" assertion instead)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_ssd.py"


def _run(args, **env):
    full = {k: v for k, v in os.environ.items() if k != "MEGASSM_SSD_PRECISION"}  # the library default ...
    full.update(env)  # ... unless the case sets one
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full,
                          timeout=120)


@pytest.mark.parametrize("args,env,message", [
    # the default mode (bf16) has no megassm_bf16 row: its rows are megassm*; the other mode's are megassm_split*
    (["--only", "ssd", "--impls", "megassm,megassm_bf16"], {}, "--impls: unknown ['megassm_bf16']"),
    (["--only", "ssd", "--impls", "megassm_split"], {"MEGASSM_SSD_PRECISION": "split"}, "megassm_split"),
    (["--repeat", "0"], {}, "--repeat 0: expected a positive integer"),
    ([], {"MEGASSM_SSD_PRECISION": "fp8"}, "MEGASSM_SSD_PRECISION='fp8'"),
])
def test_kernels_ssd_refuses_bad_arguments(args, env, message):
    res = _run(args, **env)
    assert res.returncode == 2, res.stderr[-500:]
    assert message in res.stderr and "CUDA" not in res.stderr, res.stderr[-500:]
