"""megassm-launch local: the torchrun command line it builds, and its errors."""
import shlex
import sys

from megassm.launch.cli import main, torchrun_command


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
