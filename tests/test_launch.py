"""megassm-launch local: the torchrun command line it builds, and its errors."""
import shlex
import sys

from megassm.launch.cli import launch_env, main, torchrun_command


def test_torchrun_command_runs_the_trainer_module():
    cmd = torchrun_command(2, "configs/tiny.yaml", ["train.steps=5"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3):] == ["-m", "megassm.train", "--config", "configs/tiny.yaml", "train.steps=5"]


def test_dry_run_prints_and_runs_nothing(capsys):
    assert main(["local", "--config", "configs/tiny.yaml", "--dry-run", "train.steps=5"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[-5:] == ["-m", "megassm.train", "--config", "configs/tiny.yaml", "train.steps=5"]


def test_missing_config_is_an_error(capsys):
    assert main(["local", "--config", "nope.yaml", "--dry-run"]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_launcher_sets_threads_and_nccl_error_handling_unless_set(capsys, monkeypatch):
    """OMP_NUM_THREADS set by the launcher keeps torchrun from setting 1 with its warning banner; a failed
    NCCL collective ends the rank (docs/launch.md "Faults and timeouts"). The user's values win."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    env = launch_env(2)
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert main(["local", "--nproc-per-node", "2", "--config", "configs/tiny.yaml", "--dry-run",
                 "train.global_batch=16"]) == 0  # 8 a rank: the launcher checks the config at the job's world size
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[:2] == [f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", "TORCH_NCCL_ASYNC_ERROR_HANDLING=3"]
    assert launch_env(2, {"OMP_NUM_THREADS": "6", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}
