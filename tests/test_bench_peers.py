"""benchmarks/peers.py on CPU: its help, and a clear skip (with the reason) where mamba_ssm is absent."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "peers.py")


def run(*args):
    env = {**os.environ, "PYTHONPATH": ""}  # no .peers/ on the path: mamba_ssm is absent
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def test_help_runs_on_cpu():
    out = run("--help")
    assert out.returncode == 0 and "--rows" in out.stdout and "mamba_ssm" in out.stdout


def test_mamba_ssm_absent_is_a_named_skip():
    try:
        import mamba_ssm  # noqa: F401
        import pytest

        pytest.skip("mamba_ssm is importable here")
    except ImportError:
        pass
    out = run("--rows", "mamba_ssm", "--device", "cpu")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    peer = [r for r in rows if r.get("row") == "mamba_ssm"]
    assert out.returncode == 0, out.stderr
    assert len(peer) == 1 and "mamba_ssm not importable" in peer[0]["skipped"]
    assert run("--rows", "mamba_ssm", "--device", "cpu", "--require-peers").returncode == 2


def test_llama_row_trains_on_cpu():
    out = run("--rows", "llama", "--device", "cpu", "--seq-len", "32", "--steps", "1", "--warmup", "0",
              "--llama-micro-batch", "2", "--llama-d-model", "32", "--llama-layers", "1", "--llama-heads", "2",
              "--llama-ffn", "64", "--llama-vocab", "64", "--llama-rope")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0, out.stderr
    llama = [r for r in rows if r.get("row") == "llama"][0]
    assert llama["tokens_per_s"] > 0 and llama["params"] > 0
