"""docs/quickstart.md runs as written: its CPU code blocks (fenced as ```sh cpu), in order, in a fresh
directory, then the TensorBoard tags it documents are the ones the run wrote."""
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "quickstart.md")


def fenced_blocks(text: str, info: str) -> list[str]:
    """The bodies of the fenced code blocks whose info string is exactly `info` (indentation allowed)."""
    out = []
    for m in re.finditer(r"^( *)```" + re.escape(info) + r"[ \t]*\n(.*?)^\1```[ \t]*$", text, re.M | re.S):
        indent = len(m.group(1))
        out.append("\n".join(line[indent:] for line in m.group(2).splitlines()))
    return out


def cpu_commands() -> list[str]:
    text = open(DOC).read()
    cmds = [line.strip() for block in fenced_blocks(text, "sh cpu") for line in block.splitlines()]
    return [c for c in cmds if c and not c.startswith("#")]


def test_quickstart_has_cpu_commands():
    cmds = cpu_commands()
    assert any(c.startswith("megassm-train") for c in cmds) and any("--resume" in c for c in cmds)
    assert any("data.paths=" in c for c in cmds)


def test_quickstart_cpu_commands_run_as_written(tmp_path):
    # the user's view: a directory with the repository's configs and docs beside them, the console scripts of
    # this environment on PATH, nothing written outside tmp_path (the builtin corpus goes to MEGASSM_CACHE,
    # which conftest points at a per-session folder)
    for name in ("configs", "docs"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "MEGASSM_CACHE": os.environ["MEGASSM_CACHE"]}
    for cmd in cpu_commands():
        argv = shlex.split(cmd)
        if argv[0] == "megassm-train":  # no progress bar in a log
            argv.append("run.progress=false")
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        # stdout: the result only (the quickstart says so); the dry run's is its table and JSON line
        if argv[0] == "megassm-train" and "--dry-run" not in argv:
            assert len(out.stdout.splitlines()) == 1 and out.stdout.startswith("megassm-train: done, "), out.stdout
        if argv[0] == "megassm-preprocess":
            assert out.stdout == argv[argv.index("--output-prefix") + 1] + "\n", out.stdout

    # the documented tags are the ones the CPU run wrote
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    documented = sorted(fenced_blocks(open(DOC).read(), "text tensorboard-tags-cpu")[0].split())
    ea = ea_mod.EventAccumulator(str(tmp_path / "runs" / "quick" / "tensorboard"))
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == documented
    # the resumed run went on from the first one's checkpoint
    assert (tmp_path / "runs" / "quick" / "checkpoints" / "step_00000006").is_dir()
    assert (tmp_path / "runs" / "mydocs" / "checkpoints" / "step_00000002").is_dir()
