"""Every command that reads a checkpoint verifies it as run.resume does (docs/reliability.md "Commands that read a
checkpoint"): export, model.init_from, generate, eval, convert refuse a damaged named checkpoint (exit 6, nothing
written) and take a run directory's newest intact one."""
import json
import logging
import os

import pytest

from megassm.training import checkpoint as ckpt
from megassm.training.failures import EXIT_NO_CHECKPOINT, EXIT_OK

from reliability_cases import copy_run, flip_bytes, run_main


EXPORTABLE = ("model.attn.rope=false", "model.mlp.activation=relu2")  # a hybrid transformers' NemotronH takes


@pytest.fixture(scope="module")
def exportable_run(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("exportable") / "run")
    assert run_main(run, *EXPORTABLE, "train.steps=4", "run.save_interval=2") == EXIT_OK
    return run


def _damage_newest(run):
    """Flip bytes of the newest checkpoint's model.pt: (it, the older one, the problem as verification words it)."""
    newest, older = (os.path.join(run, "checkpoints", f"step_0000000{s}") for s in (4, 2))
    rec = ckpt.read_meta(newest)["integrity"]["files"]["model.pt"]
    flip_bytes(os.path.join(newest, "model.pt"))
    found = ckpt.file_record(os.path.join(newest, "model.pt"))["sha256"]
    return newest, older, (f"model.pt: expected {rec['bytes']} bytes sha256 {rec['sha256'][:12]}.., found sha256 "
                           f"{found[:12]}.. (same size, other bytes)")


def _one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_export_and_convert_verify_the_checkpoint_they_read(exportable_run, tmp_path, capsys, caplog):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from megassm.checkpoint_cli import main as convert
    from megassm.export_cli import main as export

    run = copy_run(exportable_run, tmp_path)
    newest, older, problem = _damage_newest(run)
    out = tmp_path / "out"
    out.mkdir()
    assert export(["--checkpoint", newest, "--format", "hf", "--output", str(out / "hf")]) == EXIT_NO_CHECKPOINT
    err = _one_error_line(capsys)
    assert err.startswith(f"megassm-export: error: --checkpoint: checkpoint {newest} is damaged: {problem}"), err
    assert os.listdir(out) == []  # nothing written
    with caplog.at_level(logging.WARNING):
        assert export(["--run", run, "--format", "hf", "--output", str(out / "hf")]) == EXIT_OK
    assert f"checkpoint {newest} is damaged and is skipped: {problem}" in caplog.text
    assert f"reading {older}, the newest intact checkpoint" in caplog.text
    assert f"`{older}`" in (out / "hf" / "README.md").read_text()  # exported from the intact older one
    capsys.readouterr()

    # convert: a damaged input is refused (its copy would get a fresh record and pass for intact), nothing written
    assert convert(["convert", "--input", newest, "--output", str(out / "c"), "--to", "sharded"]) == EXIT_NO_CHECKPOINT
    assert problem in _one_error_line(capsys) and sorted(os.listdir(out)) == ["hf"]
    # sharded checkpoints likewise: a changed chunk is named
    assert convert(["convert", "--input", older, "--output", str(out / "sharded"), "--to", "sharded"]) == EXIT_OK
    capsys.readouterr()
    chunk = next(f for f in ckpt.read_meta(str(out / "sharded"))["integrity"]["files"] if f.endswith(".distcp"))
    flip_bytes(out / "sharded" / chunk)
    assert export(["--checkpoint", str(out / "sharded"), "--format", "hf", "--output", str(out / "hf2")]) == 6
    assert f"{chunk}: expected" in _one_error_line(capsys) and not os.path.exists(out / "hf2")
    assert convert(["convert", "--input", str(out / "sharded"), "--output", str(out / "c"), "--to", "canonical"]) == 6
    assert f"{chunk}: expected" in _one_error_line(capsys) and not os.path.exists(out / "c")


def test_init_from_verifies_the_checkpoint_it_reads(exportable_run, tmp_path, capsys, caplog):
    run = copy_run(exportable_run, tmp_path)
    newest, older, problem = _damage_newest(run)
    new = tmp_path / "new"
    assert run_main(new, *EXPORTABLE, f"model.init_from={newest}", "train.steps=1") == EXIT_NO_CHECKPOINT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"megassm-train: model.init_from: checkpoint {newest} is damaged: {problem}. A checkpoint named by "
                   "path has no stand-in: restore it, or name another (a run directory takes its newest intact one)")
    assert not os.path.exists(new)  # refused before the run directory was claimed
    with caplog.at_level(logging.INFO):
        assert run_main(new, *EXPORTABLE, f"model.init_from={run}", "train.steps=1", "run.save_final=false") == EXIT_OK
    assert f"checkpoint {newest} is damaged and is skipped: {problem}" in caplog.text
    assert f"model.init_from: initial weights from {older} (megassm layout)" in caplog.text


def test_generate_and_eval_verify_the_checkpoint_they_read(exportable_run, tmp_path, capsys, caplog):
    from megassm.evaluation.cli import main as evaluate
    from megassm.generate_cli import main as generate

    run = copy_run(exportable_run, tmp_path)
    newest, older, problem = _damage_newest(run)
    gen = ["--prompt", "def", "--max-new-tokens", "2", "--json"]
    assert generate(["--checkpoint", newest, *gen]) == EXIT_NO_CHECKPOINT
    err = _one_error_line(capsys)
    assert err.startswith(f"megassm-generate: --checkpoint: checkpoint {newest} is damaged: {problem}"), err
    with caplog.at_level(logging.WARNING):
        assert generate(["--run", run, *gen]) == EXIT_OK
    assert json.loads(capsys.readouterr().out.splitlines()[0])["step"] == 2
    assert f"checkpoint {newest} is damaged and is skipped: {problem}" in caplog.text
    ctx = ["context", "--run", run, "--max-tokens", "64", "--docs", "2", "--batch-size", "2", "--no-baseline"]
    assert evaluate([*ctx, "--checkpoint", newest]) == EXIT_NO_CHECKPOINT
    assert _one_error_line(capsys).startswith(f"megassm-eval: --checkpoint: checkpoint {newest} is damaged: {problem}")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert evaluate(ctx) == EXIT_OK  # --checkpoint auto: the run's newest intact one
    assert json.load(open(os.path.join(run, "eval", "context_step_00000002.json")))["checkpoint"] == older
    assert f"checkpoint {newest} is damaged and is skipped: {problem}" in caplog.text
