"""Nothing lost, nothing silent (docs/reliability.md): verified checkpoints and the fallback to the newest intact
one, one trainer per run directory, clean exits for the failures a user can cause (changed shapes, unwritable
paths, a full disk, token ids beyond the vocabulary, a launcher/world-size mismatch), Ctrl-C, the config-differs
warning, and the same decisions on every rank of a 2-process torchrun run."""
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megassm import train as T
from megassm.config import ConfigError, load_config
from megassm.training import checkpoint as ckpt
from megassm.training import preemption, runlock
from megassm.training.failures import (EXIT_ABORTED, EXIT_CONFIG, EXIT_IO, EXIT_LOCKED, EXIT_NO_CHECKPOINT,
                                       EXIT_OK, RunIOError)

from multiproc import stop, wait_until
from reliability_cases import ROOT, SMALL, base_run, copy_run, flip_bytes, last_exit, run_main, small_model_ckpt  # noqa: F401 (base_run: a fixture)


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x)["step"] for x in f if '"loss"' in x]


def _truncate(path, keep=0.6):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _nan_with_valid_record(ckpt_dir, rel="model.pt"):
    """NaN weights whose integrity record is rewritten to match: what only the non-finite check catches."""
    path = os.path.join(ckpt_dir, rel)
    state = torch.load(path, weights_only=True)
    if rel == "model.pt":
        name = next(k for k, v in state.items() if v.is_floating_point())
        state[name].view(-1)[0] = float("nan")
    else:
        first = next(iter(state["state"].values()))
        first["exp_avg"].view(-1)[0] = float("inf")
    torch.save(state, path)
    meta = json.load(open(os.path.join(ckpt_dir, "meta.json")))
    meta["integrity"]["files"][rel] = ckpt.file_record(path)
    json.dump(meta, open(os.path.join(ckpt_dir, "meta.json"), "w"))


# ----------------------------------------------------------------------------------------------------
# the integrity record (the public functions other checkpoint formats use)
# ----------------------------------------------------------------------------------------------------


def test_integrity_record_names_damage_per_file(tmp_path, caplog):
    model, opt, path = small_model_ckpt(tmp_path)
    meta = ckpt.read_meta(path)
    rec = meta["integrity"]
    assert rec["algo"] == "sha256" and set(rec["files"]) == set(meta["files"]) == {"model.pt", "optim.pt", "rng.pt"}
    # hashed while written == hashed from disk
    assert rec == ckpt.integrity_record(path, meta["files"])
    assert ckpt.verify_checkpoint(path) == []

    flip_bytes(os.path.join(path, "model.pt"))
    _truncate(os.path.join(path, "optim.pt"))
    with pytest.raises(ckpt.CheckpointDamagedError, match="model.pt: expected"):
        ckpt.load_checkpoint(path, model=model, optimizer=opt)
    os.remove(os.path.join(path, "rng.pt"))
    problems = ckpt.verify_checkpoint(path)
    m, o = rec["files"]["model.pt"], rec["files"]["optim.pt"]
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"model.pt: expected {m['bytes']} bytes sha256 {m['sha256'][:12]}.., found sha256 ")
    assert problems[1] == (f"optim.pt: expected {o['bytes']} bytes sha256 {o['sha256'][:12]}.., found "
                           f"{int(o['bytes'] * 0.6)} bytes")
    assert problems[2].startswith("rng.pt: expected") and problems[2].endswith("found no file")
    assert ckpt.verify_checkpoint(path, relpaths=["optim.pt"]) == problems[1:2]  # a rank's own files only
    assert ckpt.verify_checkpoint(path, relpaths=[]) == []
    with pytest.raises(ckpt.CheckpointDamagedError, match="rng.pt: listed in meta.json, found no file"):
        ckpt.load_checkpoint(path, model=model, optimizer=opt, verify=False)

    # files in subfolders (one per rank, as a sharded format writes them)
    shard = tmp_path / "sharded"
    (shard / "rank1").mkdir(parents=True)
    (shard / "rank1" / "w.bin").write_bytes(b"x" * 1000)
    (shard / "meta.json").write_text(json.dumps({"complete": True, "files": ["rank1/w.bin"],
                                                 "integrity": ckpt.integrity_record(shard, ["rank1/w.bin"])}))
    assert ckpt.verify_checkpoint(shard, relpaths=["rank1/w.bin"]) == []
    (shard / "rank1" / "w.bin").write_bytes(b"y" * 1000)
    assert ckpt.verify_checkpoint(shard)[0].startswith("rank1/w.bin: expected 1000 bytes")
    with pytest.raises(ValueError, match="inside the checkpoint"):
        ckpt.integrity_record(shard, ["../escape"])

    # a checkpoint from before the record: loads, with one warning that it cannot be verified
    _, _, old = small_model_ckpt(tmp_path / "old")
    meta = ckpt.read_meta(old)
    del meta["integrity"]
    json.dump(meta, open(os.path.join(old, "meta.json"), "w"))
    with caplog.at_level(logging.WARNING, logger="megassm.checkpoint"):
        assert ckpt.verify_checkpoint(old) == [] and ckpt.verify_checkpoint(old) == []
        ckpt.load_checkpoint(old, model=torch.nn.Linear(4, 3))
    assert sum("cannot be verified" in r.message for r in caplog.records) == 1


def test_loaders_refuse_unreadable_files_and_non_finite_values(tmp_path):
    model, opt, path = small_model_ckpt(tmp_path / "nan", nan=True)
    for load in (lambda: ckpt.load_checkpoint(path, model=model), lambda: ckpt.read_model_and_optim(path)):
        with pytest.raises(ckpt.CheckpointDamagedError, match=r"model.pt: non-finite values in 'weight' \(1 of 12"):
            load()
    _, _, path = small_model_ckpt(tmp_path / "inf")
    _nan_with_valid_record(path, "optim.pt")
    with pytest.raises(ckpt.CheckpointDamagedError, match=r"optim.pt: non-finite values in 'state.0.exp_avg'"):
        ckpt.load_checkpoint(path, model=model, optimizer=opt)
    _, _, path = small_model_ckpt(tmp_path / "cut")
    _truncate(os.path.join(path, "model.pt"))
    with pytest.raises(ckpt.CheckpointDamagedError, match=r"model.pt: unreadable \("):
        ckpt.load_checkpoint(path, model=model, verify=False)  # the loader alone, as for an unverifiable checkpoint
    _, _, path = small_model_ckpt(tmp_path / "shape")
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"'weight' is \[3, 4\] in the checkpoint, \[5, 4\] in the model"):
        ckpt.load_checkpoint(path, model=torch.nn.Linear(4, 5))


def test_temp_dirs_of_crashes_are_cleaned(tmp_path):
    _, _, first = small_model_ckpt(tmp_path)
    # what kills during a save leave: a temp dir, and a replaced checkpoint moved aside before its successor's rename
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000003-4242").mkdir()
    (root / ".tmp-step_00000003-4242" / "model.pt").write_bytes(b"0" * 4096)
    os.rename(first, root / ".old-step_00000001-4242")
    done = ckpt.clean_temp_dirs(tmp_path)
    assert sorted(os.listdir(root)) == ["step_00000001"] and len(done) == 2, done
    assert ckpt.verify_checkpoint(first) == []
    shutil.copytree(first, root / ".old-step_00000001-99")  # its successor exists: the old copy goes
    ckpt.clean_temp_dirs(tmp_path)
    assert sorted(os.listdir(root)) == ["step_00000001"]
    os.rename(first, root / ".old-step_00000001-4242-1401")  # moved aside by a background writer (pid, thread)
    ckpt.clean_temp_dirs(tmp_path)
    assert sorted(os.listdir(root)) == ["step_00000001"] and ckpt.verify_checkpoint(first) == []


# ----------------------------------------------------------------------------------------------------
# the run directory's lock
# ----------------------------------------------------------------------------------------------------


def _foreign_lock(run_dir, pid, host=None, job=None, age_s=0.0):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, runlock.LOCK_NAME)
    owner = {"host": host or socket.gethostname(), "pid": pid, "pid_start": runlock._proc_start(pid),
             "slurm_job_id": job, "started": "earlier", "token": f"foreign-{pid}-{host}"}
    with open(path, "w") as f:
        json.dump(owner, f)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


@pytest.fixture
def live_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def test_lock_refuses_a_live_owner_and_takes_over_stale_ones(tmp_path, live_process, monkeypatch, caplog):
    run = str(tmp_path / "run")
    _foreign_lock(run, live_process.pid)
    with pytest.raises(runlock.RunLockedError, match=rf"in use by another trainer \(pid {live_process.pid} on "
                                                      rf"{socket.gethostname()}"):
        runlock.acquire(run)
    live_process.kill()
    live_process.wait()
    with caplog.at_level(logging.WARNING):
        lock = runlock.acquire(run)
    assert f"process {live_process.pid} on this host is gone" in caplog.text and runlock.holds(run)
    assert json.load(open(lock.path))["pid"] == os.getpid()
    runlock.release(run)
    assert not os.path.exists(lock.path) and not runlock.holds(run)

    # another host: its heartbeat decides; a requeue of the same SLURM job takes its own lock at once
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _foreign_lock(run, 1, host="node-a", job="77", age_s=100)
    with pytest.raises(runlock.RunLockedError, match="node-a, SLURM job 77"):
        runlock.acquire(run, stale_after_s=300)
    runlock.release(runlock.acquire(run, stale_after_s=60).run_dir)  # heartbeat older than 60 s: stale
    _foreign_lock(run, 1, host="node-a", job="77", age_s=0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    runlock.release(runlock.acquire(run).run_dir)

    # an unwritable run directory (simulated: the tests may run as root, who writes anywhere)
    _deny_writes(monkeypatch, tmp_path / "ro")
    with pytest.raises(RunIOError, match="cannot lock run.dir .*ro.*Read-only file system"):
        runlock.acquire(str(tmp_path / "ro" / "run"))


def _deny_writes(monkeypatch, under):
    """os.open / os.mkdir under `under` fail as on a read-only file system."""
    under = os.path.abspath(under)
    real_open, real_mkdir = os.open, os.mkdir

    def guard(path):
        if os.path.abspath(path).startswith(under):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def fake_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            guard(path)
        return real_open(path, flags, *a, **k)

    def fake_mkdir(path, *a, **k):
        guard(path)
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def test_second_trainer_refuses_before_writing_anything(tmp_path, live_process, capsys):
    run = str(tmp_path / "run")
    _foreign_lock(run, live_process.pid)
    assert run_main(run, "train.steps=1") == EXIT_LOCKED
    err = capsys.readouterr().err
    assert f"pid {live_process.pid} on {socket.gethostname()}" in err and "in use by another trainer" in err
    assert os.listdir(run) == [runlock.LOCK_NAME]  # no config.yaml, metrics, pids, last_exit.json
    live_process.kill()
    live_process.wait()
    assert run_main(run, "train.steps=1") == EXIT_OK  # the owner is gone: its lock is stale
    assert not os.path.exists(os.path.join(run, runlock.LOCK_NAME))  # released at exit


# ----------------------------------------------------------------------------------------------------
# resume: damaged checkpoints are named and skipped
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["model.pt flip", "optim.pt flip", "model.pt cut", "optim.pt cut", "rng.pt cut",
                                    "model.pt nan", "optim.pt nan"])
def test_resume_auto_skips_a_damaged_checkpoint(base_run, tmp_path, caplog, damage):
    run = copy_run(base_run, tmp_path)
    rel, how = damage.split()
    latest = os.path.join(run, "checkpoints", "step_00000004")
    {"flip": lambda: flip_bytes(os.path.join(latest, rel)), "cut": lambda: _truncate(os.path.join(latest, rel)),
     "nan": lambda: _nan_with_valid_record(latest, rel)}[how]()
    with caplog.at_level(logging.WARNING):
        assert run_main(run, "train.steps=3", "run.save_final=false", resume="auto") == EXIT_OK
    assert f"checkpoint {latest} is damaged and is skipped: " in caplog.text
    assert (f"{rel}: expected" if how != "nan" else f"{rel}: non-finite values") in caplog.text
    assert "resumed from " + os.path.join(run, "checkpoints", "step_00000002") in caplog.text
    assert _steps(run) == [1, 2, 3]  # step 3 trained after the intact step 2 (an intact step 4 would leave none)


def test_resume_auto_skips_a_damaged_sharded_checkpoint(tmp_path, caplog):
    """The sharded format (every rank's DCP file in meta.json's integrity record): a flipped chunk file is named
    and skipped like a canonical file."""
    run = str(tmp_path / "run")
    assert run_main(run, "train.steps=4", "run.save_interval=2", "run.checkpoint_format=sharded") == EXIT_OK
    latest = os.path.join(run, "checkpoints", "step_00000004")
    chunk = next(f for f in ckpt.read_meta(latest)["integrity"]["files"] if f.endswith(".distcp"))
    flip_bytes(os.path.join(latest, chunk))
    with caplog.at_level(logging.WARNING):
        assert run_main(run, "train.steps=3", "run.save_final=false", "run.checkpoint_format=sharded",
                     resume="auto") == EXIT_OK
    assert f"checkpoint {latest} is damaged and is skipped: {chunk}: expected" in caplog.text
    assert _steps(run) == [1, 2, 3]  # step 3 trained after the intact step 2 (the later lines superseded)


def test_no_intact_checkpoint_exits_6_naming_each(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path)
    config_before = open(os.path.join(run, "config.yaml")).read()
    flip_bytes(os.path.join(run, "checkpoints", "step_00000004", "model.pt"))
    _truncate(os.path.join(run, "checkpoints", "step_00000002", "optim.pt"))
    assert run_main(run, "train.steps=5", resume="auto") == EXIT_NO_CHECKPOINT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no intact checkpoint" in err and "step_00000004: model.pt: expected" in err
    assert "step_00000002: optim.pt: expected" in err
    assert last_exit(run)["exit_code"] == EXIT_NO_CHECKPOINT
    assert open(os.path.join(run, "config.yaml")).read() == config_before
    # a checkpoint named by path gets no stand-in
    assert run_main(run, "train.steps=5", resume=os.path.join(run, "checkpoints", "step_00000004")) == EXIT_NO_CHECKPOINT
    assert "has no stand-in" in capsys.readouterr().err


def test_non_finite_stop_names_a_checkpoint_that_verifies(tmp_path):
    from megassm.training.trainer import NonFiniteLossError, Trainer

    tr = Trainer(load_config("configs/tiny.yaml", SMALL + [f"run.dir={tmp_path}/nf", "train.steps=5",
                                                           "run.save_interval=2"]))
    real_forward, calls = tr.model.forward, {"n": 0}

    def poisoned(*a, **k):
        out = real_forward(*a, **k)
        calls["n"] += 1
        if calls["n"] == 4 * tr.accum + 1:  # step 5 begins; the step-4 checkpoint gets damaged on disk
            flip_bytes(os.path.join(tmp_path, "nf", "checkpoints", "step_00000004", "model.pt"))
        if calls["n"] > 4 * tr.accum:
            out.loss = out.loss * float("nan")
        return out

    tr.model.forward = poisoned
    with pytest.raises(NonFiniteLossError) as e:
        tr.fit()
    assert "step 5" in str(e.value) and "the last good checkpoint is" in str(e.value)
    assert str(e.value).split("the last good checkpoint is ")[1].startswith(
        os.path.join(str(tmp_path), "nf", "checkpoints", "step_00000002"))
    tr.close()


# ----------------------------------------------------------------------------------------------------
# clean failures
# ----------------------------------------------------------------------------------------------------


def test_resume_with_changed_shape_exits_2_and_keeps_config(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path)
    config_before = open(os.path.join(run, "config.yaml")).read()
    assert run_main(run, "train.steps=6", "model.d_model=64", resume="auto") == EXIT_CONFIG
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    last = lines[-1]
    assert last.startswith("megassm-train: config error: run.resume: checkpoint ") and "does not fit the model" in last
    assert "model.d_model: 32 in the checkpoint, 64 now" in last
    assert open(os.path.join(run, "config.yaml")).read() == config_before
    assert last_exit(run)["exit_code"] == EXIT_CONFIG


def test_unwritable_checkpoints_exit_4(base_run, tmp_path, monkeypatch, capsys):
    run = copy_run(base_run, tmp_path)
    with monkeypatch.context() as m:
        _deny_writes(m, os.path.join(run, "checkpoints"))
        assert run_main(run, "train.steps=6", resume="auto") == EXIT_IO
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megassm-train: I/O error: cannot write checkpoints to ") and "Read-only" in err
    assert last_exit(run)["exit_code"] == EXIT_IO

    # a read-only run directory: the lock cannot be taken, nothing can be recorded there
    ro = tmp_path / "ro"
    with monkeypatch.context() as m:
        _deny_writes(m, ro)
        assert run_main(str(ro / "run"), "train.steps=1") == EXIT_IO
    assert "cannot lock run.dir" in capsys.readouterr().err


def test_a_shard_with_another_shards_idx_exits_2(tmp_path, capsys):
    """Two shards whose .bin have the same size, their .idx swapped: trained with exit 0 on the wrong document
    boundaries until the manifest's record of the .idx was checked."""
    from test_data_loader import _equal_size_corpora

    a, b = _equal_size_corpora(tmp_path)
    os.rename(a + ".idx", tmp_path / "swap")
    os.rename(b + ".idx", a + ".idx")
    os.rename(tmp_path / "swap", b + ".idx")
    assert run_main(tmp_path / "run", "data.builtin=null", f"data.paths=[{a}]", "train.steps=2") == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"megassm-train: config error: data: {a}.idx: sha256 ") and \
        f"but {a}.manifest.json records " in err and "swapped with another shard's .idx?" in err, err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_temp_checkpoints_of_crashes_are_removed_at_start(base_run, tmp_path, caplog):
    run = copy_run(base_run, tmp_path)
    left = os.path.join(run, "checkpoints", ".tmp-step_00000006-999999")
    shutil.copytree(os.path.join(run, "checkpoints", "step_00000004"), left)
    os.remove(os.path.join(left, "meta.json"))
    with caplog.at_level(logging.WARNING):
        assert run_main(run, "train.steps=5", "run.save_final=false", resume="auto") == EXIT_OK
    assert not os.path.exists(left) and "removed .tmp-step_00000006-999999" in caplog.text


def test_bad_token_ids_are_named_with_their_file(tmp_path, monkeypatch, capsys):
    from megassm.data_tools import dataset
    from megassm.data_tools.indexed import IndexedWriter

    prefix = str(tmp_path / "corpus")
    with IndexedWriter(prefix, np.uint16) as w:
        for i in range(40):  # most documents hold the id, so training reads one whatever the split
            w.add_document(np.array([5000 if i >= 5 else 65] * 30 + [256]))
    json.dump({"tokenizer": {"name": "byte", "sha256": "b", "vocab_size": 257, "eos_id": 256}},
              open(prefix + ".manifest.json", "w"))
    args = ("data.builtin=null", f"data.paths=[{prefix}]", "train.steps=30", "data.split=[90,5,5]")
    assert run_main(tmp_path / "a", *args) == EXIT_CONFIG  # scanned at start: before any compute
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{prefix}.bin: token id 5000 in document 5 (token 0) is outside the model's vocabulary of 257" in err
    assert "manifest.json says vocabulary 257" in err and not os.path.exists(tmp_path / "a" / "metrics.jsonl")

    monkeypatch.setattr(dataset, "SCAN_TOKENS", 0)  # a corpus too large to scan: the read that meets the id fails
    assert run_main(tmp_path / "b", *args) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megassm-train: data error: ") and "token id 5000 in document " in err
    assert last_exit(tmp_path / "b")["exit_code"] == EXIT_CONFIG


def test_launcher_world_size_must_match_the_config(monkeypatch):
    from megassm.training.trainer import check_supported

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config("configs/tiny.yaml", SMALL + ["parallel.world_size=1"], validate_config=False)
    with pytest.raises(ConfigError, match=r"parallel.world_size=1, but the launcher started 2 processes"):
        check_supported(cfg)


def test_config_differs_warning_names_keys_and_ignores_run_only_ones(base_run, tmp_path, caplog):
    run = copy_run(base_run, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert run_main(run, "train.steps=4", "run.save_final=false", "run.keep_last=5", "data.prefetch=0",
                     resume="auto") == EXIT_OK
    assert "differs" not in caplog.text  # run.resume, run.keep_last, run.save_final, data.prefetch changed
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert run_main(run, "train.steps=4", "optim.lr=1e-3", "run.save_final=false", resume="auto") == EXIT_OK
    assert "differs from the one it was saved with: optim.lr: 0.003 in the checkpoint, 0.001 now" in caplog.text


def test_cli_options_and_overrides_in_any_order():
    p = T.build_parser()
    for argv in (["--config", "c", "a=1", "--resume", "auto", "b=2"], ["a=1", "--resume", "auto", "--config", "c", "b=2"],
                 ["--resume", "auto", "--config", "c", "a=1", "b=2"]):
        args = p.parse_intermixed_args(argv)
        assert (args.config, args.resume, args.overrides) == ("c", "auto", ["a=1", "b=2"])


# ----------------------------------------------------------------------------------------------------
# Ctrl-C
# ----------------------------------------------------------------------------------------------------


def test_ctrl_c_asks_for_a_checkpoint_and_a_second_one_aborts(monkeypatch):
    preemption.reset()
    preemption.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested() and preemption.reason() == "SIGINT"
        os.kill(os.getpid(), signal.SIGINT)  # within the grace: the launcher forwarding the same Ctrl-C
        monkeypatch.setattr(preemption, "INTERRUPT_GRACE_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes
    finally:
        preemption.uninstall()
        preemption.reset()


def test_aborted_run_exits_130_with_its_record(tmp_path, monkeypatch, capsys):
    from megassm.training.trainer import Trainer

    def interrupted(self):
        self.step = 1
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", interrupted)
    assert run_main(tmp_path / "r", "train.steps=3") == EXIT_ABORTED
    assert "aborted by a second Ctrl-C at step 1" in capsys.readouterr().err
    assert last_exit(tmp_path / "r")["exit_code"] == EXIT_ABORTED


def test_sigint_checkpoints_and_exits_99(tmp_path):
    run = str(tmp_path / "c")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.Popen([sys.executable, "-m", "megassm.train", "--config", "configs/tiny.yaml", *SMALL,
                          "train.steps=400", f"run.dir={run}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_until(p, lambda: os.path.exists(os.path.join(run, "metrics.jsonl")) and _steps(run), 120, "a logged step")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        stop(p)
    assert p.returncode == T.EXIT_PREEMPTED, err[-2000:]
    status = last_exit(run)
    assert status["signal"] == "SIGINT" and status["exit_code"] == T.EXIT_PREEMPTED
    assert ckpt.verify_checkpoint(status["checkpoint"]) == [] and "press Ctrl-C again" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------
# two ranks (torchrun, gloo): the lock and the damaged-checkpoint fallback are decided once for both
# ----------------------------------------------------------------------------------------------------


def _torchrun(args, timeout=300):
    from multiproc import launch

    return launch(ROOT, ["--config", "configs/tiny.yaml", *SMALL, *args], nproc=2, env={"CUDA_VISIBLE_DEVICES": ""},
                  timeout=timeout, torchrun=True)


def test_two_ranks_share_the_lock_refusal_and_the_fallback(base_run, tmp_path, live_process):
    run = copy_run(base_run, tmp_path)
    os.remove(os.path.join(run, "last_exit.json"))
    shutil.rmtree(os.path.join(run, "pids"))
    flip_bytes(os.path.join(run, "checkpoints", "step_00000004", "optim.pt"))
    lock = _foreign_lock(run, live_process.pid)
    r = _torchrun([f"run.dir={run}", "train.steps=5", "--resume", "auto"])
    assert r.returncode != 0
    assert r.stderr.count("in use by another trainer") == 2, r.stderr[-3000:]  # both ranks, one line each
    assert f'File "{ROOT}' not in r.stderr  # no trainer traceback (torchrun prints its own for a failed worker)
    assert not os.path.exists(os.path.join(run, "last_exit.json"))
    assert not os.path.exists(os.path.join(run, "pids"))
    live_process.kill()
    live_process.wait()

    r = _torchrun([f"run.dir={run}", "train.steps=5", "--resume", "auto"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("step_00000004 is damaged and is skipped: optim.pt: expected") == 2  # both ranks agree
    assert _steps(run) == [1, 2, 3, 4, 5] and last_exit(run)["exit_code"] == EXIT_OK
    assert len(os.listdir(os.path.join(run, "pids"))) == 2 and not os.path.exists(lock)
    assert ckpt.verify_checkpoint(os.path.join(run, "checkpoints", "step_00000005")) == []


def test_every_fault_row_names_tests_that_exist():
    """docs/reliability.md's fault matrix: every row names at least one test, as `tests/FILE.py::NAME`, and every
    named test is a test function of that file."""
    import re

    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    section = text.split("## What is guaranteed: the fault matrix", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| fault or bad")]
    assert len(rows) >= 20, len(rows)
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.rsplit("|", 2)[-2])
        assert named, row[:120]
        for path, name in named:
            with open(os.path.join(ROOT, path)) as f:
                assert re.search(rf"^def {name}\(", f.read(), re.M), (path, name)
