"""The kernels' switches as config keys: the `kernels:` section becomes the
MEGASSM_* variables at start-up, a variable that is set wins and is recorded, run.dir/config.yaml holds the values
in effect and every MEGASSM_* variable that was set, a bad value fails before any file is written, --print-config
writes nothing, and a resume with other values in effect warns."""
import dataclasses
import hashlib
import logging
import os
import subprocess
import sys

import pytest
import yaml

from megassm import train as T
from megassm.config import ConfigError, KernelsConfig, load_config
from megassm.kernels import env as kernel_env
from megassm.training import run_config
from megassm.training.failures import EXIT_CONFIG, EXIT_OK
from megassm.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["data.builtin=stdlib", "model.pattern=M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch=2", "train.global_batch=2", "train.log_interval=1", "train.eval_interval=0",
        "optim.warmup_steps=1", "run.progress=false", "run.tensorboard=false", "train.device=cpu",
        "data.prefetch=0", "train.steps=1"]
SWITCH_VARS = [s.var for s in kernel_env.SWITCHES.values()]


@pytest.fixture(autouse=True)
def _kernel_environment(monkeypatch):
    """Each test starts without the kernels' variables (tests/kernel_cases.py sets MEGASSM_TRITON_AUTOTUNE=0 in
    this process) and leaves none behind: apply_settings sets them in os.environ, beyond monkeypatch's record."""
    for var in SWITCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(run_config, "_SET_FROM_CONFIG", {})
    yield
    for var in SWITCH_VARS:
        os.environ.pop(var, None)  # then monkeypatch puts back what was there before the test


def _cfg(run_dir, *extra):
    return load_config(None, TINY + [f"run.dir={run_dir}", *extra])


def _saved(run_dir):
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


def test_the_section_is_the_switches_with_their_defaults():
    """One key per switch of kernels/core/env.py, its default the variable's (so an unset key changes nothing)."""
    fields = {f.name: f.default for f in dataclasses.fields(KernelsConfig)}
    assert set(fields) == set(kernel_env.SWITCHES)
    for key, switch in kernel_env.SWITCHES.items():
        assert switch.record(switch.value(None)) == fields[key], key


def test_tile_names_match_the_triton_table():
    pytest.importorskip("triton")
    from megassm.kernels.mamba2_ssd import triton_ssd_common as ssd_common

    assert set(kernel_env.SSD_TILE_NAMES) == set(ssd_common.TILES)


def test_config_key_is_applied_and_recorded(tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(run, "kernels.ssd_precision=split", "kernels.ssd_dbc_split=2", "kernels.ssd_save_states=true",
               "kernels.ssd_tiles= dx_bs=64 ,dbc_bs=32")
    tr = Trainer(cfg)
    # the kernels read the variables: set from the config in this process, before any kernel ran
    assert (kernel_env.ssd_precision(), kernel_env.ssd_dbc_split(), kernel_env.ssd_save_states()) == ("split", 2, True)
    assert kernel_env.ssd_tiles() == {"dx_bs": 64, "dbc_bs": 32}
    tr.fit()
    saved = _saved(run)
    assert saved["kernels"] == {**dataclasses.asdict(KernelsConfig()), "ssd_precision": "split", "ssd_dbc_split": 2,
                                "ssd_save_states": True, "ssd_tiles": "dx_bs=64,dbc_bs=32"}
    assert not any(e.split("=")[0] in SWITCH_VARS for e in saved["environment"])  # set from the config, not by the user
    assert load_config(str(run / "config.yaml")).kernels.ssd_precision == "split"  # reloads


def test_a_trained_model_is_loaded_with_its_runs_kernel_settings(tmp_path):
    """Evaluation and generation (load_trained) compute as the run trained: its kernels: section applied."""
    from megassm.evaluation.loading import load_trained

    run = tmp_path / "run"
    Trainer(_cfg(run, "kernels.ssd_dbc_split=2", "run.save_final=true")).fit()
    os.environ.pop("MEGASSM_SSD_DBC_SPLIT")
    run_config._SET_FROM_CONFIG.clear()
    assert kernel_env.ssd_dbc_split() != 2
    lm = load_trained(run=str(run), device="cpu")
    assert lm.cfg.kernels.ssd_dbc_split == 2 and kernel_env.ssd_dbc_split() == 2


def test_a_later_default_config_unsets_what_an_earlier_one_set():
    cfg = load_config(None, ["data.builtin=stdlib", "kernels.ssd_streams=false", "kernels.backend=reference"])
    run_config.apply_settings(cfg)
    assert os.environ["MEGASSM_SSD_STREAMS"] == "0" and os.environ["MEGASSM_KERNELS"] == "torch"
    assert cfg.kernels.backend == "torch" and cfg.kernels.ssd_streams is False
    run_config.apply_settings(load_config(None, ["data.builtin=stdlib"]))
    assert "MEGASSM_SSD_STREAMS" not in os.environ and "MEGASSM_KERNELS" not in os.environ


def test_environment_overrides_the_config_and_is_recorded(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", " Split")
    monkeypatch.setenv("MEGASSM_CONV_BWD", "two_pass_defer")  # the config's value: recorded, no override
    monkeypatch.setenv("MEGASSM_PEAK_FLOPS", "1e12")  # environment-only: recorded
    cfg = _cfg(run, "kernels.ssd_precision=bf16", "kernels.tune_log=false")
    with caplog.at_level(logging.INFO, logger="megassm.train"):
        Trainer(cfg).fit()
    lines = [r.getMessage() for r in caplog.records if "overrides the config" in r.getMessage()]
    assert len(lines) == 1 and "kernels.ssd_precision=split (MEGASSM_SSD_PRECISION; the config says bf16)" in lines[0]
    assert "conv_bwd" not in lines[0]
    assert os.environ["MEGASSM_SSD_PRECISION"] == " Split"  # the user's variable untouched
    saved = _saved(run)
    assert saved["kernels"]["ssd_precision"] == "split" and saved["kernels"]["conv_bwd"] == "two_pass_defer"
    env = saved["environment"]
    assert {"MEGASSM_SSD_PRECISION= Split", "MEGASSM_CONV_BWD=two_pass_defer", "MEGASSM_PEAK_FLOPS=1e12"} <= set(env)
    assert env == sorted(env) and all(e.startswith("MEGASSM_") for e in env)


@pytest.mark.parametrize("override, message", [
    ("kernels.ssd_precision=fp8", "kernels.ssd_precision='fp8': expected one of bf16, split"),
    ("kernels.ssd_dbc_split=3", "kernels.ssd_dbc_split='3': expected one of 1, 2, 4, 8"),
    ("kernels.ssd_dbc_split=0", "kernels.ssd_dbc_split must be positive, got 0"),
    ("kernels.ssd_state_segments=0", "kernels.ssd_state_segments='0': expected a positive integer or auto"),
    ("kernels.backend=cuda", "kernels.backend='cuda': expected one of auto, triton, torch"),
    ("kernels.ssd_tiles=dx_bs=48", "kernels.ssd_tiles='dx_bs=48': dx_bs='48' must be a power of two >= 16"),
    ("kernels.ssd_save_states=maybe", "command line: kernels.ssd_save_states: expected true or false, got 'maybe'"),
])
def test_bad_value_fails_before_any_file_is_written(tmp_path, capsys, override, message):
    run = tmp_path / "run"
    for extra in ([], ["--dry-run"], ["--print-config"]):
        code = T.main(["--config", "configs/tiny.yaml", f"run.dir={run}", override, *extra])
        assert code == EXIT_CONFIG
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"megassm-train: config error: {message}"
        assert not os.path.exists(run)
    if "must be positive" in message or "command line" in message:
        return  # refused by load_config itself
    cfg = _cfg(run, override)  # the Trainer checks them too (a Trainer built in-process)
    with pytest.raises(ConfigError, match=message.split(":")[0]):
        Trainer(cfg)
    assert not os.path.exists(run)


def test_print_config_prints_the_values_in_effect_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_VARS}
    env.update(MEGASSM_CONV_BWD="fused", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "megassm.train", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                        "--print-config", "kernels.ssd_save_states=true", "kernels.conv_bwd=two_pass",
                        f"run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == EXIT_OK, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["kernels"]["ssd_save_states"] is True and printed["kernels"]["conv_bwd"] == "fused"
    assert "MEGASSM_CONV_BWD=fused" in printed["environment"]
    assert "kernels.conv_bwd=fused (MEGASSM_CONV_BWD; the config says two_pass)" in r.stderr
    assert printed["run"]["dir"] == str(tmp_path / "run")
    assert os.listdir(tmp_path) == []  # no run.dir, nothing in the working directory
    path = tmp_path / "printed.yaml"
    path.write_text(r.stdout)
    assert load_config(str(path)).kernels.conv_bwd == "fused"  # a config file as it is


def test_print_config_and_dry_run_are_one_or_the_other(capsys):
    with pytest.raises(SystemExit) as e:
        T.main(["--config", "configs/tiny.yaml", "--print-config", "--dry-run"])
    assert e.value.code == 2 and "--print-config and --dry-run" in capsys.readouterr().err


def test_resume_with_other_kernel_values_warns(tmp_path, caplog):
    run = tmp_path / "run"
    Trainer(_cfg(run, "train.steps=2")).fit()
    with caplog.at_level(logging.WARNING, logger="megassm.train"):
        tr = Trainer(_cfg(run, "train.steps=3", "run.resume=auto", "kernels.ssd_dbc_split=2",
                          "kernels.backend=torch"))
    assert tr.step == 2  # resumed, not refused
    (line,) = [r.getMessage() for r in caplog.records if "differs from the one it was saved with" in r.getMessage()]
    assert "kernels.ssd_dbc_split: 1 in the checkpoint, 2 now" in line
    assert "kernels.backend: 'auto' in the checkpoint, 'torch' now" in line
    tr.fit()
    assert _saved(run)["kernels"]["ssd_dbc_split"] == 2


def test_an_older_checkpoint_config_without_the_section_names_no_kernel_keys():
    """Checkpoints saved before the section existed: their config names no kernels.* (the values then were not
    recorded), and the hash of the oldest ones (the whole dump) still matches."""
    cfg = load_config(None, ["data.builtin=stdlib", "kernels.ssd_precision=split"])
    before = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("kernels", "environment")}
    assert run_config.config_differences(yaml.safe_dump(before), cfg) == []
    legacy = hashlib.sha256(yaml.safe_dump(before, sort_keys=False).encode()).hexdigest()[:16]
    assert run_config.legacy_hash_matches(legacy, cfg)


def test_reference_backend_gives_the_default_losses_on_cpu(tmp_path):
    """On CPU auto resolves to the reference: kernels.backend=torch is the same computation, bit for bit."""
    auto = Trainer(_cfg(tmp_path / "a", "train.steps=2")).fit()
    ref = Trainer(_cfg(tmp_path / "b", "train.steps=2", "kernels.backend=torch")).fit()
    assert auto == ref and len(auto) == 2
