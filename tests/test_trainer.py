"""The single-device trainer end to end on CPU: exact resume, metrics, non-finite stop, CLI."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megassm.config import load_config
from megassm.training.trainer import NonFiniteLossError, Trainer

TINY = [
    "data.builtin=stdlib",
    "model.pattern=M*M-",
    "model.d_model=64",
    "model.mamba.d_state=16",
    "model.mamba.headdim=16",
    "model.mamba.chunk_size=16",
    "model.attn.n_heads=4",
    "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128",
    "train.seq_len=48",
    "train.micro_batch=2",
    "train.global_batch=4",  # two accumulation steps
    "train.log_interval=1",
    "train.eval_interval=3",
    "train.eval_batches=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "run.progress=false",
]


def tiny_cfg(run_dir, *extra):
    return load_config(None, TINY + [f"run.dir={run_dir}", *extra])


def test_resume_is_exact(tmp_path):
    straight = Trainer(tiny_cfg(tmp_path / "a", "train.steps=6", "run.save_interval=3")).fit()
    assert len(straight) == 6

    first = Trainer(tiny_cfg(tmp_path / "b", "train.steps=6", "run.save_interval=3"))
    first.cfg.train.steps = 3  # stop after N steps, as a preempted job would
    head = first.fit()
    resumed = Trainer(tiny_cfg(tmp_path / "b", "train.steps=6", "run.save_interval=3", "run.resume=auto"))
    assert resumed.step == 3
    tail = resumed.fit()
    assert head + tail == straight  # identical floats at every step


def test_metrics_checkpoints_and_config(tmp_path):
    run = tmp_path / "run"
    losses = Trainer(tiny_cfg(run, "train.steps=4", "run.save_interval=1", "run.keep_last=2")).fit()
    assert all(math.isfinite(x) for x in losses)
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    for r in train_lines:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
            assert key in r
    assert any("loss_val" in r or "val_loss" in r or "loss/val" in r for r in lines)
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert len([c for c in ckpts if c.startswith("step_")]) == 2  # keep_last
    assert (run / "config.yaml").exists()
    assert load_config(str(run / "config.yaml")).train.steps == 4
    assert any(name.startswith("events") for name in os.listdir(run / "tensorboard"))


def test_non_finite_loss_names_last_checkpoint(tmp_path):
    tr = Trainer(tiny_cfg(tmp_path / "nf", "train.steps=5", "run.save_interval=2"))
    real_forward = tr.model.forward
    calls = {"n": 0}

    def poisoned(*a, **k):
        out = real_forward(*a, **k)
        calls["n"] += 1
        if calls["n"] > 2 * tr.accum + 1:  # during step 3
            out.loss = out.loss * float("nan")
        return out

    tr.model.forward = poisoned
    with pytest.raises(NonFiniteLossError) as e:
        tr.fit()
    assert "step 3" in str(e.value) and "step_00000002" in str(e.value)


def test_cli_config_error_exits_before_compute(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "megassm.train", "--config", "configs/tiny.yaml", "model.d_modle=3",
         f"run.dir={tmp_path}/x"],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode == 2
    assert "model.d_model" in r.stderr and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("var,value", [("MEGASSM_KERNELS", "cuda"), ("MEGASSM_SSD_PRECISION", "fp8"),
                                       ("MEGASSM_SSD_STATE_SEGMENTS", "0"), ("MEGASSM_SSD_SAVE_STATES", "on"),
                                       ("MEGASSM_SSD_STREAMS", "yes"), ("MEGASSM_CONV_BWD", "fast")])
def test_cli_bad_kernel_environment_exits_before_compute(tmp_path, monkeypatch, capsys, var, value):
    """A bad kernel switch fails at startup (dry run or training), naming the variable and the value, with
    nothing written; the synthetic runner likewise."""
    from megassm import train as T
    from megassm.synthetic import run as S

    monkeypatch.setenv(var, value)
    for extra in ([], ["--dry-run"]):
        assert T.main(["--config", "configs/tiny.yaml", f"run.dir={tmp_path}/x", *extra]) == 2
        assert f"{var}={value!r}" in capsys.readouterr().err
    assert S.main(["--task", "induction_heads", "--out", str(tmp_path / "s")]) == 2
    assert f"{var}={value!r}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize("world", ["1", "2"])
def test_cli_rank_of_a_multi_process_run_exits_without_finalization(tmp_path, world):
    """`python -m megassm.train` / megassm-train: main()'s exit code either way, its stderr flushed; a rank of a
    multi-process run (WORLD_SIZE > 1) skips interpreter finalization (its atexit handlers never run), where
    gloo's teardown now and then aborted a finished rank."""
    code = ("import atexit, sys; atexit.register(lambda: print('ATEXIT', flush=True)); "
            "sys.argv = ['megassm-train', '--config', 'configs/tiny.yaml', 'model.d_modle=3', "
            f"'run.dir={tmp_path}/x']; from megassm.train import cli; cli()")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["WORLD_SIZE"] = world
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 2 and "model.d_model" in r.stderr
    assert ("ATEXIT" in r.stdout) == (world == "1")


def test_exit_status_is_written_before_the_final_barrier(tmp_path, monkeypatch):
    """A finished run writes last_exit.json before destroy()'s barrier: a rank that leaves after the barrier
    with a non-zero code (a preemption stop) gets torchrun to SIGTERM the rest, and rank 0 must have written
    the file by then (otherwise it recorded the launcher's SIGTERM as the signal)."""
    from megassm import train as T
    from megassm.parallel import state

    seen = []
    real = state.destroy
    monkeypatch.setattr(state, "destroy", lambda barrier=False: (
        seen.append((barrier, os.path.exists(tmp_path / "x" / "last_exit.json"))), real(barrier=barrier))[1])
    assert T.main(["--config", "configs/tiny.yaml", f"run.dir={tmp_path}/x", "train.steps=2"]) == 0
    assert seen == [(True, True)]
    assert json.load(open(tmp_path / "x" / "last_exit.json"))["exit_code"] == 0


def test_cli_refuses_unbuilt_parallelism(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "megassm.train", "--config", "configs/tiny.yaml", "parallel.tp=2", "parallel.world_size=2",
         f"run.dir={tmp_path}/x"],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode == 2 and "parallel.tp=2" in r.stderr


def test_cli_dry_run_meta(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "megassm.train", "--config", "configs/mamba2-1.3b.yaml", "--dry-run",
         "data.builtin=stdlib"],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode == 0, r.stderr
    assert "parameters:" in r.stdout


def test_embedded_default_run_learns(tmp_path):
    """The README's main job, shortened: configs/tiny.yaml on the builtin stdlib corpus, through the
    console script; the loss must fall visibly."""
    run = tmp_path / "tiny"
    r = subprocess.run(
        ["megassm-train", "--config", "configs/tiny.yaml", "train.steps=24", "train.eval_interval=12",
         "run.progress=false", f"run.dir={run}"],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train = [x["loss"] for x in lines if "loss" in x]
    assert train[0] > 4.0 and train[-1] < train[0] - 1.5, train
    assert any("loss_val" in x for x in lines)
