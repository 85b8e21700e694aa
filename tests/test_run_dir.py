"""What a reused run directory keeps (docs/reliability.md): a fresh start over an earlier run is refused before
anything in run.dir changes, run.overwrite=true moves the earlier run aside intact, --resume auto continues it;
and a metrics.jsonl holding bytes that are not UTF-8 JSON no longer stops every resume."""
import hashlib
import json
import logging
import os

import pytest

from megassm import train as T
from megassm.training import checkpoint as ckpt
from megassm.training.failures import EXIT_CONFIG, EXIT_OK

from multiproc import ROOT, launch

SMALL = ["model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=16",
         "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.attn.n_kv_heads=1", "model.mlp.ffn_hidden=64",
         "train.seq_len=32", "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1",
         "train.eval_interval=0", "optim.warmup_steps=1", "run.progress=false", "run.tensorboard=false",
         "train.device=cpu", "data.prefetch=0", "optim.decay=constant"]  # runs of any length share a schedule


def _args(run_dir, *extra):
    return ["--config", "configs/tiny.yaml", *SMALL, f"run.dir={run_dir}", *extra]


def _main(run_dir, *extra):
    return T.main(_args(run_dir, *extra))


def _tree(root):
    """Every entry under root: relative path -> (kind, size, mtime_ns, sha256); directories with their mtime, so
    an entry created and removed again shows too."""
    out = {".": ("dir", 0, os.stat(root).st_mtime_ns, None)}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.stat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if name in files else None
            out[os.path.relpath(path, root)] = ("file" if digest else "dir", st.st_size, st.st_mtime_ns, digest)
    return out


def _files(tree):
    return {k: v for k, v in tree.items() if v[0] == "file"}


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _steps(run_dir):
    return [r["step"] for r in _records(run_dir) if "loss" in r]


def _refusal(run_dir, newest, step):
    aside = os.path.join(run_dir, "previous-<UTC time>")
    return (f"megassm-train: config error: run.dir {run_dir} holds an earlier run (newest checkpoint {newest}; "
            f"metrics.jsonl up to step {step}) and run.resume is none: continue it with --resume auto, start this run "
            f"in another run.dir, or set run.overwrite=true to move the earlier run aside into {aside}/ and start "
            "at step 0")


def test_reused_run_dir_is_refused_untouched_then_resumed_or_moved_aside(tmp_path, capsys, caplog):
    run = str(tmp_path / "run")
    assert _main(run, "train.steps=4", "run.save_interval=2") == EXIT_OK
    before = _tree(run)
    newest = os.path.join(run, "checkpoints", "step_00000004")

    # the same command again, as its own process: refused before any compute, nothing in run.dir touched
    r = launch(ROOT, _args(run, "train.steps=4", "run.save_interval=2"))
    assert r.returncode == EXIT_CONFIG, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == _refusal(run, newest, 4)
    assert "materialized" not in r.stderr  # no model was built
    assert _tree(run) == before
    # run.resume=none set explicitly is the same fresh start
    capsys.readouterr()
    assert _main(run, "train.steps=4", "run.resume=none") == EXIT_CONFIG
    assert capsys.readouterr().err.strip().splitlines()[-1] == _refusal(run, newest, 4)
    assert _tree(run) == before

    # --resume auto continues the earlier run exactly (a straight 6-step run elsewhere gives the same losses)
    assert _main(run, "train.steps=6", "run.save_interval=2", "--resume", "auto") == EXIT_OK
    assert _main(tmp_path / "straight", "train.steps=6") == EXIT_OK
    assert _losses(run) == _losses(tmp_path / "straight")  # exact: fails on NaN
    old = _files(_tree(run))

    # a checkpoint of another run resumed into it is refused too (its lines and checkpoints would mix in)
    other = os.path.join(tmp_path, "straight", "checkpoints", "step_00000006")
    capsys.readouterr()
    assert _main(run, "train.steps=8", "--resume", other) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"run.resume={other} is a checkpoint of another run" in err and "run.overwrite=true" in err

    # run.overwrite=true: the earlier run moved aside whole (every file, byte for byte; its checkpoints verify)
    with caplog.at_level(logging.WARNING, logger="megassm.train"):
        assert _main(run, "train.steps=2", "run.save_interval=1", "run.keep_last=1", "run.overwrite=true") == EXIT_OK
    (aside,) = [os.path.join(run, d) for d in os.listdir(run) if d.startswith("previous-")]
    assert f"moved the earlier run in {run} (newest checkpoint {run}/checkpoints/step_00000006; metrics.jsonl up to " \
           f"step 6) aside into {aside}; this run starts at step 0" in caplog.text
    assert _files(_tree(aside)) == old
    assert [s for s, _ in ckpt.list_checkpoints(aside)] == [4, 6]
    assert all(ckpt.verify_checkpoint(p) == [] for _, p in ckpt.list_checkpoints(aside))
    # the new run: step 0 in a clean directory; run.keep_last pruned only its own checkpoints
    assert _steps(run) == [1, 2]
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    status = json.load(open(os.path.join(run, "last_exit.json")))
    assert status["exit_code"] == EXIT_OK and status["step"] == 2
    assert "overwrite: false" in open(os.path.join(run, "config.yaml")).read()  # acts once, never on a rerun
    # --resume auto now continues the new run, not the one moved aside
    assert _main(run, "train.steps=3", "--resume", "auto") == EXIT_OK
    assert _steps(run) == [1, 2, 3]
    assert _files(_tree(aside)) == old


def test_two_ranks_agree_on_the_refusal_and_move_the_run_aside_once(tmp_path):
    run = str(tmp_path / "run")
    assert _main(run, "train.steps=2") == EXIT_OK
    before = _tree(run)
    r = launch(ROOT, _args(run, "train.steps=2"), nproc=2)
    assert r.returncode == EXIT_CONFIG, r.stderr[-3000:]
    assert _refusal(run, os.path.join(run, "checkpoints", "step_00000002"), 2) in r.stderr
    assert "Traceback" not in r.stderr
    assert _tree(run) == before
    r = launch(ROOT, _args(run, "train.steps=2", "run.overwrite=true"), nproc=2)
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    (aside,) = [d for d in os.listdir(run) if d.startswith("previous-")]
    assert _files(_tree(os.path.join(run, aside))) == _files(before)
    assert _steps(run) == [1, 2]


def test_metrics_with_invalid_bytes_resume_and_the_lines_are_named(tmp_path, caplog):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = str(tmp_path / "run")
    assert _main(run, "train.steps=3", "run.save_interval=2", "run.save_final=false", "run.tensorboard=true") == EXIT_OK
    path = os.path.join(run, "metrics.jsonl")
    lines = open(path, "rb").read().splitlines(keepends=True)
    assert [json.loads(x)["step"] for x in lines] == [1, 1, 2, 3]  # start-up figures, then losses; checkpoint: 2
    damaged = lines[2].replace(b'"loss"', b'"lo\xff\xfe"')  # invalid UTF-8 inside step 2's line
    cut = b'{"step": 4, "loss": 5.1\xe2\x82'  # a crash in the middle of a line (and of a UTF-8 character)
    open(path, "wb").write(lines[0] + lines[1] + damaged + lines[3] + b"\x00" * 16 + b"\n" + cut)

    with caplog.at_level(logging.WARNING, logger="megassm.metrics"):
        assert _main(run, "train.steps=4", "run.tensorboard=true", "--resume", "auto") == EXIT_OK
    assert f"{path}: lines 3, 5-6 are not UTF-8 JSON (damaged bytes, or a line cut short by a crash): moved to " \
           f"{path}.unreadable" in caplog.text
    assert open(path + ".unreadable", "rb").read() == damaged + b"\x00" * 16 + b"\n" + cut + b"\n"
    text = open(path, "rb").read()
    assert text.startswith(lines[0] + lines[1])  # the valid lines up to the resumed step, byte for byte
    recs = _records(run)  # UTF-8, one JSON object per line
    assert [r["step"] for r in recs if "loss" in r] == [1, 3, 4]  # step 3 superseded by this attempt's
    # TensorBoard: its events are not the jsonl's; the resume purged the old step 3 and logged each step once
    ea = ea_mod.EventAccumulator(os.path.join(run, "tensorboard"))
    ea.Reload()
    events = ea.Scalars("loss/train")
    assert [e.step for e in events] == [1, 2, 3, 4]
    new = {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert all(abs(e.value - new[e.step]) <= 1e-6 * abs(new[e.step]) for e in events if e.step in new)


def test_slurm_launcher_refuses_run_overwrite(tmp_path, capsys):
    """The batch script always resumes (run.resume=auto, so that a requeue continues the run): run.overwrite, which
    would move each attempt aside, is refused at submission, before RUN_DIR/launch is written."""
    from megassm.launch.cli import main

    assert main(["slurm", "--nodes", "1", "--gpus-per-node", "1", "--config", "configs/tiny.yaml",
                 f"run.dir={tmp_path}/run", "run.overwrite=true"]) == EXIT_CONFIG
    assert "run.overwrite=true: a SLURM job resumes (run.resume=auto)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
