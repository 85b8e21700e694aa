"""What the commands print on stdout: their result and nothing else (logs, progress and errors go to stderr), so a
script can read it without filtering; docs/interop.md's CPU commands run as written (the smoke run's hybrid as
shipped, exported into a folder that does not exist yet); a refused export says why in one line and leaves nothing,
not even the parent folders it would have made."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from megassm.config import load_config
from megassm.models import build_model
from megassm.training import checkpoint as ckpt

from test_docs_quickstart import fenced_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.builtin=stdlib", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=8",
         "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.attn.n_kv_heads=1", "model.mlp.ffn_hidden=64"]


def _checkpoint(tmp_path, *over):
    from megassm.config import dump_config

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*SMALL, *over])
    model = build_model(cfg.model, vocab_size=257)
    model.init_weights(0)
    return ckpt.save_checkpoint(tmp_path / "run", 3, model=model, optimizer=None,
                                extra={"config": dump_config(cfg)})


def test_interop_doc_commands_run_as_written(tmp_path):
    """docs/interop.md's `sh cpu` lines, in order, in a fresh directory with the repository's configs beside them:
    megassm-train's stdout is its closing line, megassm-export's the directory it made (exports/ did not exist)."""
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    cmds = [c.strip() for b in fenced_blocks(open(os.path.join(ROOT, "docs", "interop.md")).read(), "sh cpu")
            for c in b.splitlines() if c.strip() and not c.strip().startswith("#")]
    assert [c.split()[0] for c in cmds] == ["megassm-train", "megassm-export"]
    outs = []
    for cmd in cmds:
        argv = shlex.split(cmd) + (["run.progress=false"] if cmd.startswith("megassm-train") else [])
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        outs.append(r.stdout)
    assert outs[0] == "megassm-train: done, 2 steps; run directory runs/x\n"
    out = os.path.join(os.path.realpath(tmp_path), "exports", "x")
    assert outs[1] == f"{out}\n"
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert sorted(os.listdir(tmp_path / "exports")) == ["x"]  # no temporary directory left beside it


def test_refused_export_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """configs/tiny.yaml with a squared-ReLU MLP and its RoPE attention, which no transformers class computes
    (Nemotron-H has no RoPE, GraniteMoeHybrid no relu2): exit 2, one line naming both blocks and the key to train
    with; the output's missing parents are not made."""
    from megassm.export_cli import main

    path = _checkpoint(tmp_path, "model.mlp.activation=relu2")
    assert main(["--checkpoint", path, "--format", "hf", "--output", str(tmp_path / "new" / "deeper" / "x")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    assert "block 1 '*': attention uses RoPE" in out.err and "block 3 '-': model.mlp.activation=relu2" in out.err
    assert "To export, train with model.attn.rope=false (NemotronHForCausalLM)" in out.err
    assert not (tmp_path / "new").exists()


def test_failed_export_removes_the_parents_it_made(tmp_path, monkeypatch):
    """A failure while writing (here the weights' writer raising ENOSPC) leaves neither the temporary directory nor
    the parent folders the export made; a parent that existed before stays."""
    import errno

    from megassm.interop import hf

    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      [*SMALL, "model.attn.rope=false", "model.mlp.activation=relu2"])
    state = build_model(cfg.model, vocab_size=257).state_dict()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "_write_weights", full)
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="No space left"):
        hf.export_hf(cfg.model, state, str(tmp_path / "kept" / "a" / "b" / "x"), tokenizer_spec=None)
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_preprocess_prints_the_shard_prefixes(tmp_path, capsys):
    from megassm.data_tools.indexed import shard_prefixes
    from megassm.data_tools.preprocess import main

    src = tmp_path / "a.txt"
    src.write_text("some text to tokenize\n" * 2000)
    assert main(["--input", str(src), "--format", "text", "--output-prefix", str(tmp_path / "one"), "--quiet"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'one'}\n"
    assert main(["--input", str(src), "--format", "text", "--text-per-line", "--output-prefix", str(tmp_path / "n"),
                 "--shard-size", "10K"]) == 0
    out = capsys.readouterr()
    prefixes = shard_prefixes(str(tmp_path / "n"))
    assert len(prefixes) > 1 and out.out.splitlines() == prefixes
    assert "tokens/s" in out.err  # the summary is a log


def test_checkpoint_convert_prints_the_path(tmp_path, capsys):
    from megassm.checkpoint_cli import main

    path = _checkpoint(tmp_path)
    dst = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert main(["convert", "--input", path, "--output", str(dst), "--to", "sharded"]) == 0
    out = capsys.readouterr()
    assert out.out == f"{dst}\n" and "megassm-checkpoint: wrote" in out.err


def test_launch_slurm_prints_the_script_path_or_the_job_id(tmp_path, capsys, monkeypatch):
    from megassm.launch.cli import main

    monkeypatch.chdir(ROOT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho "4242;cluster"\n')  # `sbatch --parsable` stand-in
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    job = ["slurm", "--nodes", "1", "--gpus-per-node", "2", "--config", "configs/tiny.yaml", "--time", "1:00:00",
           "train.device=cpu", "train.global_batch=16"]
    assert main([*job, f"run.dir={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr()
    script = tmp_path / "a" / "launch" / "job.sbatch"
    assert out.out == f"{script}\n" and "#SBATCH --nodes=1" in out.err and "# submit with: sbatch" in out.err
    assert main([*job, f"run.dir={tmp_path / 'b'}", "--submit"]) == 0
    out = capsys.readouterr()
    assert out.out == "4242\n" and "submitted job 4242" in out.err


def test_documented_output_folders_are_git_ignored():
    """The folders the docs' commands write into, so that a launch records a clean checkout as clean."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    paths = ["data/mydocs.bin", "exports/x/config.json", "runs/x/metrics.jsonl"]
    r = subprocess.run(["git", "-C", ROOT, "check-ignore", *paths], capture_output=True, text=True)
    assert r.stdout.split() == paths
