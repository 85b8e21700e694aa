"""Logs once per job (megassm/training/logs.py): rank 0 speaks, the other ranks warn, every line of a
multi-process run names its rank, third-party INFO (megatron-core) stays quiet, `--log-level DEBUG` shows
everything on rank 0; `megassm-launch local` sets OMP_NUM_THREADS, so torchrun prints no thread notice."""
import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import use_megatron_groups
from megassm.training import logs
from megassm.training.logs import setup_logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_logging():
    """setup_logging as a CLI run calls it, on a root logger without handlers (pytest's capture handlers are
    set aside for the call, then kept beside ours); the root logger is restored after the test."""
    root = logging.getLogger()
    level = root.level

    def setup(lvl):
        kept = [h for h in root.handlers if not isinstance(h, logs._StderrHandler)]
        root.handlers[:] = [h for h in root.handlers if h not in kept]
        try:
            setup_logging(lvl)
        finally:
            root.handlers[:] = [*kept, *root.handlers]

    yield setup
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, logs._StderrHandler)]
    root.setLevel(level)
    logging.captureWarnings(False)


def _emit():
    logging.getLogger("megassm.train").debug("own debug")
    logging.getLogger("megassm.train").info("own info")
    logging.getLogger("megatron.core.distributed").info("third-party info")
    logging.getLogger("megatron.core.distributed").warning("third-party warning")
    logging.getLogger("py.warnings").warning("a FutureWarning")  # what logging.captureWarnings routes


@pytest.mark.parametrize("rank,world,level,shown,hidden", [
    (0, 2, "INFO", ["[rank 0] megassm.train INFO: own info", "[rank 0] megatron.core.distributed WARNING: "
                    "third-party warning", "[rank 0] py.warnings WARNING: a FutureWarning"],
     ["own debug", "third-party info"]),
    (1, 2, "INFO", ["[rank 1] megatron.core.distributed WARNING: third-party warning"],
     ["own info", "own debug", "third-party info", "FutureWarning"]),
    (0, 2, "debug", ["[rank 0] megassm.train DEBUG: own debug", "[rank 0] megatron.core.distributed INFO: "
                     "third-party info"], []),
    (1, 2, "DEBUG", ["[rank 1] megatron.core.distributed WARNING"], ["own info", "own debug", "third-party info"]),
    (0, 1, "INFO", ["megassm.train INFO: own info", "megatron.core.distributed WARNING: third-party warning"],
     ["[rank", "third-party info"]),
])
def test_rank_zero_speaks_and_the_others_warn(fresh_logging, monkeypatch, capsys, rank, world, level, shown, hidden):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    fresh_logging(level)
    fresh_logging(level)  # a second call replaces the first: no line twice
    _emit()
    err = capsys.readouterr().err
    for text in shown:
        assert err.count(text) == 1, (text, err)
    for text in hidden:
        assert text not in err, (text, err)
    if world == 1:  # a single process logs as it always did: time, logger, level
        assert re.search(r"^\d{4}-\d\d-\d\d [\d:,]+ megassm.train INFO: own info$", err, re.M), err


def test_configured_root_logger_is_left_alone(fresh_logging, capsys):
    """Like logging.basicConfig: a program that configured logging and runs main() keeps its setup."""
    root = logging.getLogger()
    level = root.level
    setup_logging("DEBUG")  # pytest's capture handlers configure the root logger here
    assert not [h for h in root.handlers if isinstance(h, logs._StderrHandler)] and root.level == level


def test_unknown_level_is_a_config_error(fresh_logging, capsys):
    with pytest.raises(SystemExit) as e:
        setup_logging("LOUD")
    assert e.value.code == 2 and "--log-level 'LOUD'" in capsys.readouterr().err


def test_two_rank_job_logs_once(tmp_path, monkeypatch):
    """megassm-launch local, 2 ranks, groups through megatron-core (which logs INFO at import on every rank):
    rank 0's INFO lines once, none from rank 1, no megatron-core INFO, no torchrun thread notice, nothing
    on stdout but rank 0's closing line."""
    use_megatron_groups(monkeypatch)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megassm.launch.cli", "local", "--nproc-per-node", "2", "--config",
           "configs/tiny.yaml", "data.builtin=stdlib", "model.d_model=32", "model.mamba.d_state=8",
           "model.mamba.headdim=8", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=64", "train.seq_len=32",
           "train.micro_batch=2", "train.global_batch=4", "train.steps=2", "train.eval_interval=0",
           "train.device=cpu", "run.tensorboard=false", f"run.dir={run}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    err = r.stderr.splitlines()
    assert [x for x in err if "megassm.parallel INFO: process groups: megatron-core" in x]  # it was imported
    model_lines = [x for x in err if "megassm.train INFO: model:" in x]
    assert len(model_lines) == 1 and "[rank 0]" in model_lines[0], err
    assert not [x for x in err if "[rank 1]" in x and " INFO: " in x], err
    assert not [x for x in err if re.search(r"megatron\S* INFO", x)], err
    assert "Setting OMP_NUM_THREADS" not in r.stderr  # torchrun's notice (the launcher's command names the variable)
    # stdout: the trainer's closing line (rank 0's), the result; the launcher's command is logged on stderr
    assert r.stdout.splitlines() == [f"megassm-train: done, 2 steps; run directory {run}"], r.stdout
    assert "torch.distributed.run" in r.stderr
