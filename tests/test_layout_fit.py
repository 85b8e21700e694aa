"""A layout that does not fit the GPU its job runs on (docs/launch.md "A layout that does not fit"): the dry run
exits 2 and names the nearest layouts that fit, each one the trainer accepts and that fits by the same estimate;
--gpu names the card, --no-memory-check and train.device=cpu let a misfit through; the launchers refuse before
writing or starting anything; every shipped config fits the machine its header names, or names the recipe that
lays it out."""
import glob
import json
import os
import re

import pytest
import torch

from megassm.config import load_config, validate, world_size
from megassm.launch.cli import main as launch
from megassm.train import main as train
from megassm.training import memory
from megassm.training.checks import check_supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dry(capsys, *args):
    code = train(["--dry-run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _accepted_and_fits(config, overrides, card, monkeypatch):
    """The trainer's own checks at the layout's world size (as the launched job on GPUs sees them), then the fit."""
    cfg = load_config(os.path.join(ROOT, config), ["data.builtin=stdlib", *overrides])
    monkeypatch.setenv("WORLD_SIZE", str(world_size(cfg)))
    cfg.train.device, cfg.train.precision = "auto", "auto"
    check_supported(cfg, device=torch.device("cuda"))
    est = memory.estimate(cfg)
    return memory.needed_gib(cfg, est) < memory.GPU_MEMORY_GIB[card]


def test_a_7b_flavor_without_a_layout_is_refused_naming_layouts_that_fit(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = _dry(capsys, "--config", "configs/hybrid-7b.yaml")
    assert code == 2
    lines = err.splitlines()
    assert re.match(r"megassm-train: config error: the layout does not fit H100 80GB: 139\.\d GiB estimated per "
                    r"GPU, 15\d\.\d GiB with the allocator's reserve \(x1\.09 for parallel\.engine=ddp\)", lines[0]), \
        lines[0]
    assert "neither H100 80GB nor H200 141GB holds it" in lines[0]
    fit = json.loads(out.splitlines()[-1])["fit"]
    assert (fit["gpu"], fit["fits"], fit["checked"]) == ("H100 80GB", False, True)
    nearest = fit["nearest"]
    assert 1 <= len(nearest) <= 4
    # nothing fits one GPU: the layouts take more (parallel.world_size), among them the 4-GPU recipe's FSDP2
    assert all(f["overrides"][0].startswith("parallel.world_size=") for f in nearest)
    assert ["parallel.world_size=4", "parallel.engine=fsdp2"] in [f["overrides"] for f in nearest]
    order = [(f["changes"], f["needed_gib"]) for f in nearest]
    assert order == sorted(order)  # fewest changes first, then the most room
    for f in nearest:  # printed one a line, ready for a command line; each accepted and fitting
        assert any(x.startswith("  " + " ".join(f["overrides"]) + "  ") for x in lines), (f, lines)
        assert _accepted_and_fits("configs/hybrid-7b.yaml", f["overrides"], "H100 80GB", monkeypatch), f
    assert lines[-1].endswith("or go on regardless (--no-memory-check)")


def test_the_cards_are_the_same_everywhere():
    from megassm import train as train_module
    from megassm.launch import cli

    assert train_module.GPU_CHOICES == cli.GPU_CHOICES == tuple(memory.GPU_NAMES)
    assert train_module.DEFAULT_GPU in memory.GPU_NAMES and set(memory.GPU_NAMES.values()) == set(memory.GPU_MEMORY_GIB)


def test_the_card_is_named_and_the_check_can_be_waived(capsys, monkeypatch):
    """mamba2-1.3b at micro-batch 16 (114 GiB estimated) fits only an H200: the refusal says so; --gpu h200-141gb
    passes it; --no-memory-check makes it a warning; a job on CPUs has no GPU memory to fit."""
    monkeypatch.chdir(ROOT)
    over = ["--config", "configs/mamba2-1.3b.yaml", "data.builtin=stdlib", "train.micro_batch=16",
            "train.global_batch=64"]
    code, out, err = _dry(capsys, *over)
    assert code == 2 and "it fits H200 141GB (--gpu h200-141gb)" in err.splitlines()[0]
    nearest = json.loads(out.splitlines()[-1])["fit"]["nearest"]
    assert nearest and all(f["world_size"] == 1 for f in nearest)  # something fits the same GPU count
    assert ["train.micro_batch=8"] in [f["overrides"] for f in nearest]  # the largest micro-batch that fits
    assert not [f for f in nearest if f["overrides"] in (["train.micro_batch=4"], ["train.micro_batch=2"])]
    code, out, err = _dry(capsys, "--gpu", "h200-141gb", *over)
    assert code == 0 and "# memory check: fits H200 141GB (139.8 GiB)" in out and err == ""
    code, out, err = _dry(capsys, "--no-memory-check", *over)
    assert code == 0 and err.startswith("megassm-train: warning: --no-memory-check: the layout does not fit H100 80GB")
    fit = json.loads(out.splitlines()[-1])["fit"]
    assert (fit["fits"], fit["checked"]) == (False, False)
    code, out, err = _dry(capsys, *over, "train.device=cpu")
    assert code == 0 and "# memory check: none: train.device=cpu" in out and err == ""
    with pytest.raises(SystemExit) as e:  # the card is a property of the dry run's job, not of training
        train(["--config", "configs/tiny.yaml", "--gpu", "h200-141gb"])
    assert e.value.code == 2 and "--gpu and --no-memory-check go with --dry-run" in capsys.readouterr().err


def test_launchers_refuse_a_job_that_does_not_fit_before_writing_or_starting(tmp_path, capsys, monkeypatch):
    """slurm: checked at the job's world size (nodes x GPUs) before any file is written. local: a job on GPUs is
    checked (train.device=cuda here), --no-memory-check lets it through with the warning; a job on CPUs is not
    checked."""
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    assert launch(["slurm", "--nodes", "1", "--gpus-per-node", "8", "--config", "configs/mamba2-1.3b.yaml", "--time",
                   "1:00:00", f"run.dir={run}", "data.builtin=stdlib", "train.micro_batch=16",
                   "train.global_batch=128"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and not run.exists()
    assert "the job's dry run (world size 8, --gpu h100-80gb) refuses it; nothing was written" in out.err
    assert "does not fit H100 80GB" in out.err and "the nearest layouts that fit H100 80GB" in out.err

    local = ["local", "--config", "configs/mamba2-1.3b.yaml", "--dry-run", "data.builtin=stdlib",
             "train.micro_batch=16", "train.global_batch=64"]
    assert launch([*local, "train.device=cuda", "--no-memory-check"]) == 0
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "torch.distributed.run" in out.out  # the command: the dry run's result
    assert "warning: --no-memory-check: the layout does not fit H100 80GB" in out.err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine: no GPU, whatever runs the test
    assert launch(local) == 0
    out = capsys.readouterr()
    assert "torch.distributed.run" in out.out
    assert "memory check: none: train.device=auto and no GPU is visible here" in out.err


MACHINE = re.compile(r"^# machine: (?:(CPU)\b|(\d+) x (H100 80GB|H200 141GB)\b)")
LAYOUT = re.compile(r"^# layout: (configs/recipes/\S+\.yaml)\b")


def _header(path):
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line)
    return lines


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")) +
                                        glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml"))),
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_shipped_config_fits_its_machine_or_names_its_layout(path, monkeypatch):
    """Each config's header says `# machine: N x CARD` (it fits N of them at world size N as shipped, by the
    estimate with the reserve factor, and the trainer accepts the layout), `# machine: CPU` (a one-process CPU run,
    which any card holds too), or `# layout: configs/recipes/R.yaml` (it fits no card as shipped; the recipe holds
    the same model and is checked by its own header)."""
    machine = [m for m in map(MACHINE.match, _header(path)) if m]
    layout = [m for m in map(LAYOUT.match, _header(path)) if m]
    assert len(machine) + len(layout) == 1, f"{path}: one `# machine:` or `# layout:` header line"
    cfg = load_config(path, validate_config=False)
    cfg.data.paths, cfg.data.builtin = [], "stdlib"  # the recipes' placeholder shards
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    validate(cfg)
    est = memory.estimate(cfg)
    if layout:
        recipe = os.path.join(ROOT, layout[0].group(1))
        assert os.path.isfile(recipe) and [m for m in map(MACHINE.match, _header(recipe)) if m], recipe
        assert load_config(recipe, validate_config=False).model == cfg.model
        assert not any(memory.fits(cfg, est, card) for card in memory.GPU_MEMORY_GIB)  # else name the machine
        return
    cpu, n, card = machine[0].groups()
    n, card = (1, "H100 80GB") if cpu else (int(n), card)
    assert world_size(cfg) == n, (path, world_size(cfg), n)
    monkeypatch.setenv("WORLD_SIZE", str(n))
    cfg.train.device, cfg.train.precision = "auto", "auto"
    check_supported(cfg, device=torch.device("cuda"))
    assert memory.fits(cfg, est, card), (path, memory.needed_gib(cfg, est), card)
