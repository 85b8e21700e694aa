"""run.wandb (training/wandb_sink.py): offline, rank 0 logs the scalars metrics.jsonl has, at the same steps, and a
resume continues the same wandb run (its id in run.dir/wandb_id); run.wandb=off never imports wandb; a missing
wandb with run.wandb on is a one-line config error before any compute. No network: offline mode."""
import glob
import json
import os
import sys

import pytest

from megassm.config import ConfigError, load_config
from megassm.training.trainer import Trainer

TINY = ["data.builtin=stdlib", "model.pattern=M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=8", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch=2", "train.global_batch=2", "train.log_interval=1", "train.eval_interval=0",
        "optim.warmup_steps=1", "run.progress=false", "run.tensorboard=false"]


def _cfg(run, *extra):
    return load_config(None, [*TINY, f"run.dir={run}", *extra])


def _records(path):
    """The protobuf Records of a .wandb file: wandb's ':W&B' header (7 bytes), then LevelDB log records (a 7-byte
    header: crc32c, little-endian length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, parts = 7, 1 << 15, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec


def _history(path) -> dict[int, dict]:
    """{step: {key: value}} of a .wandb file's history records."""
    out = {}
    for rec in _records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            out.setdefault(row.pop("_step"), {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return out


def test_offline_run_has_the_scalars_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # nothing in the user's home
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    run = tmp_path / "run"
    wb = ["run.wandb=offline", "run.wandb_project=megassm-test", "run.save_interval=2"]
    Trainer(_cfg(run, "train.steps=2", *wb)).fit()
    run_id = open(run / "wandb_id").read().strip()
    Trainer(_cfg(run, "train.steps=4", "run.resume=auto", *wb)).fit()
    assert open(run / "wandb_id").read().strip() == run_id  # the same wandb run, continued
    attempts = sorted(glob.glob(str(run / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb")))
    assert len(attempts) == 2, os.listdir(run / "wandb")
    logged = {}
    for path in attempts:
        logged.update(_history(path))
    jsonl = {}
    for line in open(run / "metrics.jsonl"):
        rec = json.loads(line)
        jsonl.setdefault(rec.pop("step"), {}).update({k: v for k, v in rec.items() if k != "time"})
    assert sorted(logged) == sorted(jsonl) == [1, 2, 3, 4]
    for step, row in jsonl.items():
        assert row["loss"] == logged[step]["loss/train"] and row["lr"] == logged[step]["optim/lr"], step
        assert {k.replace("/", "_") for k in logged[step]} >= {k for k in row if k not in ("loss", "lr", "grad_norm",
                                                                                        "tokens_per_s", "mfu")}
    runs = [r.run for r in _records(attempts[0]) if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].run_id == run_id and runs[0].project == "megassm-test"
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["model"]["pattern"] == "M-" and config["run"]["wandb"] == "offline"  # the resolved config


def test_wandb_off_never_imports_it_and_missing_wandb_is_refused(tmp_path, monkeypatch):
    # any `import wandb` raises ImportError; pyarrow too: the main job on the built-in data needs neither
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    Trainer(_cfg(tmp_path / "off", "train.steps=1", "run.save_final=false")).fit()
    # ranks other than 0 keep no logger at all: no wandb import, nothing written
    from megassm.training.metrics import MetricsLogger
    from megassm.training.wandb_sink import wandb_settings

    settings = wandb_settings(_cfg(tmp_path / "r1", "run.wandb=offline"))
    assert settings["mode"] == "offline" and settings["config"]["run"]["wandb"] == "offline"
    other = MetricsLogger(tmp_path / "r1", rank=1, wandb=settings)
    other.log(1, {"loss/train": 1.0})
    other.close()
    assert other.wandb is None and not os.path.exists(tmp_path / "r1")
    with pytest.raises(ConfigError) as e:
        Trainer(_cfg(tmp_path / "on", "train.steps=1", "run.wandb=online"))
    assert str(e.value) == ("run.wandb=online needs the wandb package: pip install wandb (or pip install "
                            "'megassm[wandb]'), or set run.wandb=off")
    assert not os.path.exists(tmp_path / "on")  # refused before the run directory was touched
    with pytest.raises(ConfigError, match=r"^run.wandb must be off, online or offline, got 'yes'$"):
        _cfg(tmp_path / "x", "run.wandb=yes")
